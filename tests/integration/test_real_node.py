"""A real node (e2e/realnode): containerd 2.x, runc, the CNI bridge and kube-proxy under the
project's kubelet, in network, mount and PID namespaces of its own, with its own control plane.

A pod runs for real from the pause image built here, gets an address of the pod network, a
Service's ClusterIP reaches it from where the API server runs, and once the node stops the host
has nothing of it: no process, cgroup, mount, link or iptables rule.
"""

from __future__ import annotations

import ipaddress
import json
import sys

import pytest

from e2e import build, support
from e2e.realnode import config, install
from e2e.realnode.node import RealNode, why_unavailable

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def node(request):
    if reason := why_unavailable():
        support.cannot_run(request, "real-node", reason, once_key="realnode")
    started = RealNode().start()
    yield started
    started.stop()


def _pod(node: RealNode, namespace: str, name: str) -> dict:
    return json.loads(node.kubectl("get", "pod", "-n", namespace, name, "-o", "json").stdout)


def test_a_pod_runs_for_real_with_an_address_of_the_pod_network(node):
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sleeper", "namespace": "default"},
        "spec": {
            "containers": [{"name": "pause", "image": config.PAUSE_IMAGE, "imagePullPolicy": "Never"}],
            "terminationGracePeriodSeconds": 2,
        },
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(pod))
    running = install.wait_for(
        lambda: (p := _pod(node, "default", "sleeper"))["status"].get("phase") == "Running" and p,
        120,
        "the pod Running",
    )
    status = running["status"]
    assert running["spec"]["nodeName"] == node.name
    assert ipaddress.ip_address(status["podIP"]) in ipaddress.ip_network(config.POD_CIDR), status
    [container] = status["containerStatuses"]
    assert container["ready"] and container["containerID"].startswith("containerd://"), container
    # The pod's address is routed to the CNI bridge, in the node's network namespace only.
    route = node.in_node("ip", "-j", "route", "get", status["podIP"]).stdout
    assert json.loads(route)[0]["dev"] == "cni0", route


PROBE = """
import json, ssl, sys, urllib.request
context = ssl.create_default_context(cafile=sys.argv[1])
request = urllib.request.Request("https://10.0.0.1:443/version", headers={"Authorization": "Bearer " + sys.argv[2]})
print(json.load(urllib.request.urlopen(request, timeout=10, context=context))["gitVersion"])
"""


def test_the_kubernetes_service_reaches_the_api_server_through_kube_proxy(node):
    """What every pod does to reach the API server: the ClusterIP 10.0.0.1:443, rewritten by
    kube-proxy's rules to the node's address, verified against the cluster's CA."""
    ca = str(node.workdir / "cluster" / "pki" / "ca.crt")
    answer = node.in_node(sys.executable, "-c", PROBE, ca, node.info["token"])
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == build.kubernetes_version()
    assert "KUBE-SVC-" in node.in_node("iptables-save", "-t", "nat").stdout


def test_a_running_node_has_nothing_on_the_host(node):
    assert node.host_leftovers() == []


def test_a_stopped_node_leaves_nothing(node):
    assert node.leftovers(), "a running node has processes and cgroups"
    node.stop()
    assert node.leftovers() == []
