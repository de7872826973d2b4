"""The chart as a user installs it, on a real node (e2e/realnode): `helm install` with only the
image reference given, the image built here (`make image`) imported into the node's containerd.

The operator's two replicas and the agent's DaemonSet pod run from that image under the chart's
securityContexts, mounts and RBAC; the API server calls the admission webhooks through the
chart's Service (kube-proxy's rules, as in a cluster), scrapes reach `/metrics` through the
metrics Services with a token; `helm upgrade` to a changed values file rolls the pods.
"""

from __future__ import annotations

import json
import sys

import pytest

from e2e import image, support
from e2e.realnode import install
from e2e.realnode.node import RealNode, why_unavailable

pytestmark = pytest.mark.cluster

NAMESPACE = install.NAMESPACE


@pytest.fixture(scope="module")
def node(request, tmp_path_factory):
    if reason := why_unavailable() or image.why_unavailable():
        support.cannot_run(request, "real-node", reason, once_key="realnode")
    started = RealNode(project_image=True).start()
    try:
        started.values = install.set_up(started, tmp_path_factory.mktemp("values"), image.name())
        yield started
    finally:
        started.stop()
        assert started.leftovers() == []


def _running(pods: list[dict]) -> dict[str, list[dict]]:
    by_component: dict[str, list[dict]] = {}
    for pod in pods:
        if pod["status"].get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp"):
            component = pod["metadata"]["labels"].get("app.kubernetes.io/component", "")
            by_component.setdefault(component, []).append(pod)
    return by_component


def test_helm_install_runs_the_chart_pods_from_the_image_built_here(node):
    listing = node.kubectl("get", "pods", "-A").stdout
    running = _running(install.pods(node))
    assert len(running.get("operator", [])) == 2, listing
    assert len(running.get("agent", [])) == 1, listing
    for pod in running["operator"] + running["agent"]:
        for status in pod["status"]["containerStatuses"]:
            assert status["ready"] and status["restartCount"] == 0, (pod["metadata"]["name"], status)
            assert status["image"].endswith(image.name()), status
            assert status["containerID"].startswith("containerd://")


def refused_pod(node: RealNode, namespace: str) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "wants-a-device", "namespace": namespace},
        "spec": {
            "containers": [
                {
                    "name": "compute",
                    "image": "virt-launcher:test",
                    "resources": {"limits": {"passthrough.io/pci-does-not-exist": "1"}},
                }
            ]
        },
    }
    result = node.kubectl("create", "-f", "-", input=json.dumps(pod), check=False)
    assert result.returncode != 0, "a pod naming a device its namespace does not hold was admitted"
    return result.stderr


def test_the_api_server_calls_the_webhooks_through_the_charts_service(node):
    node.kubectl("create", "namespace", "tenant-a")
    # Rolled out is not yet reachable: until kube-proxy has the Service's ready endpoints, the call is refused.
    message = install.wait_for(lambda: "connection refused" not in (m := refused_pod(node, "tenant-a")) and m, 60,
                               "the webhook reachable through its Service")  # fmt: skip
    assert 'admission webhook "pods.admission.passthrough.io" denied the request' in message, message
    assert "pci-does-not-exist" in message


SCRAPE = """
import sys, urllib.error, urllib.request
headers = {"Authorization": "Bearer " + sys.argv[2]} if sys.argv[2] else {}
try:
    with urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers=headers), timeout=10) as response:
        print(response.status)
        print(response.read().decode())
except urllib.error.HTTPError as exc:
    print(exc.code)
"""


def scrape(node: RealNode, url: str, token: str = "", check: bool = True) -> tuple[int, str]:
    """A scrape as Prometheus makes it, from the node's network (through kube-proxy's rules);
    without `check`, (0, why) when no answer came (the connection refused)."""
    result = node.in_node(sys.executable, "-c", SCRAPE, url, token)
    if not check and result.returncode != 0:
        return 0, result.stderr
    assert result.returncode == 0, result.stderr
    status, _, body = result.stdout.partition("\n")
    return int(status), body


def test_scrapes_reach_metrics_through_the_metrics_services_with_a_token(node):
    """The operator's metrics Service (a ClusterIP) and the agents' (headless: each pod's
    address), with the token of a ServiceAccount bound to the chart's metrics-reader role."""
    node.kubectl("create", "namespace", "monitoring")
    node.kubectl("create", "serviceaccount", "prometheus", "-n", "monitoring")
    node.kubectl("create", "clusterrolebinding", "prometheus-passthrough-metrics",
                 f"--clusterrole={install.FULLNAME}-metrics-reader", "--serviceaccount=monitoring:prometheus")  # fmt: skip
    token = node.kubectl("create", "token", "prometheus", "-n", "monitoring").stdout.strip()
    service = json.loads(node.kubectl("get", "service", f"{install.OPERATOR}-metrics", "-n", NAMESPACE, "-o", "json").stdout)
    url = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}/metrics"
    status, body = install.wait_for(lambda: (r := scrape(node, url, token, check=False))[0] == 200 and r, 60, "a scrape of the operator")
    assert "# TYPE passthrough_" in body
    assert scrape(node, url)[0] == 401
    slices = json.loads(node.kubectl("get", "endpointslices", "-n", NAMESPACE, "-o", "json",
                                     f"-l=kubernetes.io/service-name={install.AGENT}-metrics").stdout)["items"]  # fmt: skip
    [address] = [a for s in slices for e in s["endpoints"] for a in e["addresses"]]
    [port] = [p["port"] for s in slices for p in s["ports"]]
    status, body = scrape(node, f"http://{address}:{port}/metrics", token)
    assert status == 200 and "# TYPE passthrough_" in body


def test_helm_upgrade_to_changed_values_rolls_the_pods(node, tmp_path):
    before = {p["metadata"]["name"] for p in install.pods(node)}
    changed = install.write_values(tmp_path, {**install.values(image.name()), "operator": {"workers": 8}})
    install.upgrade(node, changed)
    install.wait_rolled_out(node)
    deployment = json.loads(node.kubectl("get", "deployment", install.OPERATOR, "-n", NAMESPACE, "-o", "json").stdout)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert "--workers=8" in container["command"]
    operators = install.wait_for(
        lambda: (r := _running(install.pods(node)).get("operator", [])) and len(r) == 2 and r,
        120,
        "two operator replicas Running after the upgrade",
    )
    assert not {p["metadata"]["name"] for p in operators} & before
    assert "denied the request" in refused_pod(node, "tenant-a")


RELEASE_LABEL = f"app.kubernetes.io/instance={install.RELEASE}"
CLUSTER_KINDS = ("clusterroles", "clusterrolebindings", "mutatingwebhookconfigurations", "validatingwebhookconfigurations",
                 "validatingadmissionpolicies", "validatingadmissionpolicybindings")  # fmt: skip


def _kubevirt(node: RealNode) -> dict:
    return json.loads(node.kubectl("get", "kubevirt", "kubevirt", "-n", "kubevirt", "-o", "json").stdout)


def test_helm_uninstall_runs_its_hooks_and_leaves_nothing_of_the_release(node):
    """Last here: it removes what the others use. KubeVirt's release CR holds nothing in
    spec.configuration but what the operator applies, so letting go of it all must still leave a
    valid CR (the post-delete hook failed with 422 on that before)."""
    applied = install.wait_for(lambda: (kv := _kubevirt(node))["spec"]["configuration"].get("permittedHostDevices") and kv, 120,
                               "the operator's allow-list on the KubeVirt CR")  # fmt: skip
    assert "HostDevices" in applied["spec"]["configuration"]["developerConfiguration"]["featureGates"]
    install.uninstall(node)  # fails (RealNodeError) when a hook's Job fails
    assert node.helm("list", "-n", NAMESPACE, "-q").stdout.strip() == ""
    # The hooks' Jobs are deleted once they succeed; nothing of the release is left, in its namespace or cluster-wide.
    left = node.kubectl("get", "all,serviceaccounts,roles,rolebindings,configmaps,secrets,jobs", "-n", NAMESPACE, "-l", RELEASE_LABEL,
                        "-o", "name").stdout.split()  # fmt: skip
    assert left == [], left
    assert node.kubectl("get", "jobs", "-n", NAMESPACE, "-o", "name").stdout.split() == []
    for kind in CLUSTER_KINDS:
        assert node.kubectl("get", kind, "-l", RELEASE_LABEL, "-o", "name").stdout.split() == [], kind
    # The KubeVirt CR as KubeVirt's release manifest wrote it: the operator's entries, gate and record gone.
    kv = _kubevirt(node)
    assert kv["spec"]["configuration"] == install.KUBEVIRT["spec"]["configuration"], kv["spec"]
    assert "passthrough.io/feature-gates" not in (kv["metadata"].get("annotations") or {})
    # As Helm leaves a chart's CRDs: they stay.
    for crd in ("nodepcidevices", "pcidevices", "passthroughconfigs"):
        node.kubectl("get", "crd", f"{crd}.passthrough.io")
