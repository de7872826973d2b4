"""The Helm chart, rendered by the real helm and checked against the real API server.

The chart's service accounts, roles and the agent's admission policies are created for real,
and the real agent and operator run with those accounts' tokens (the agent's bound to a pod on
its node, as a DaemonSet pod's is): the RBAC and the policies are enough when the code does its
work with no Forbidden answer, and no more than that where `kubectl auth can-i` says no.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from e2e import chart, fakesysfs, identities, support
from e2e.chart import CHART, template
from e2e.fakekernel import FakeKernel
from e2e.processes import OperatorProcess, WebhookServing, start_binder
from passthrough import __version__
from passthrough.api import crds
from passthrough.api.models import PassthroughConfigSpec
from passthrough.controller.world import FINALIZER
from passthrough.api.labels import NODE_LABEL, VFIO_LABEL
from passthrough.kube.custom import Custom
from passthrough.kubevirt.values import parse_values
from passthrough.pci.naming import exclusive_resource_name

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPUS = ("0000:3b:00.0", "0000:af:00.0")

# Platform values as an admin writes them: every key of the PassthroughConfig spec.
PLATFORM = {
    "kubevirt": {"name": "kubevirt", "namespace": "cozy-kubevirt", "extraFeatureGates": ["Snapshot", "VMExport"]},
    "gpu": {
        "variant": "default",
        "replaceDefaults": True,
        "permittedHostDevices": {
            "pciHostDevices": [
                {"pciVendorSelector": "10de:2bb5", "resourceName": "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION",
                 "externalResourceProvider": True},
            ],
            "mediatedDevices": [],
        },
        "mediatedDevicesConfiguration": {"mediatedDeviceTypes": [], "nodeMediatedDeviceTypes": []},
    },
    "devices": {"notFoundGracePeriodSeconds": 120, "confirmNewNamespaces": False},
    "discovery": {"sriovVirtualFunctions": True},
}
# What a denied request leaves in a log: the API's answer, or Kopf's warning about it. (A bare
# "403" would also match the milliseconds of a timestamp, ",403".)
DENIED = re.compile(r"forbidden|not enough permissions|[(\s:]403\b", re.IGNORECASE)


# -- helpers -------------------------------------------------------------------------------


def one(objects: list[dict], kind: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def container(objects: list[dict], kind: str, name: str = "") -> dict:
    """The pod's container `name`; without a name, its first (the operator, the agent)."""
    containers = one(objects, kind)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == name) if name else containers[0]


def values_file(path: Path, values: dict) -> str:
    path.write_text(yaml.safe_dump(values))
    return f"--values={path}"


# -- what helm renders -------------------------------------------------------------------------


def test_default_values_render_the_models_defaults_and_two_operator_replicas(helm):
    helm("lint", "--strict", str(CHART))
    objects = template(helm, "passthrough", "passthrough-system")
    assert sorted(o["kind"] for o in objects) == sorted(
        ["ServiceAccount", "ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding",
         "Role", "RoleBinding", "Deployment", "DaemonSet", "PassthroughConfig",
         # Two operator replicas (tests/integration/test_chart_ha.py): the Lease's Role, the disruption budget.
         "Role", "RoleBinding", "PodDisruptionBudget",
         # Who may do what: the tenants' read (aggregated), the device admin, the agent's confinement.
         "ClusterRole", "ClusterRole", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicy",
         "ValidatingAdmissionPolicyBinding", "ValidatingAdmissionPolicyBinding",
         # PCIDevices: the operator's alone.
         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
         # The admission webhooks, served by the operator (and the one that dates an assignment).
         "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration", "Service", "Secret",
         # Metrics: the operator's and the agents' Services, the Grafana dashboard, and who may read them.
         "Service", "Service", "ConfigMap", "ClusterRole",
         # helm uninstall's post-delete hook (controller/uninstall.py), with its own account while it runs.
         "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job",
         # and its pre-delete hook that has the agents give back what they bound (passthrough uninstall --give-back).
         "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Job"]
    )
    config = one(objects, "PassthroughConfig")
    assert config["metadata"]["name"] == "cluster"
    # values.yaml documents the models' own defaults, so an install without values changes nothing.
    assert config["spec"] == PassthroughConfigSpec().model_dump(by_alias=True)

    deployment = one(objects, "Deployment")
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    operator = container(objects, "Deployment")
    assert operator["command"][:3] == ["passthrough", "operator", "--liveness=http://0.0.0.0:8080/healthz"]
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert operator["ports"] == [{"name": "healthz", "containerPort": 8080, "protocol": "TCP"},
                                 {"name": "readyz", "containerPort": 8081, "protocol": "TCP"},
                                 {"name": "webhook", "containerPort": 9443, "protocol": "TCP"},
                                 {"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and operator["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["serviceAccountName"] == "passthrough-operator"
    assert operator["image"] == f"passthrough-operator:{__version__}"  # pyproject.toml reads it from there

    daemonset = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert daemonset["serviceAccountName"] == "passthrough-agent"
    assert daemonset["tolerations"] == [{"operator": "Exists"}]
    agent = container(objects, "DaemonSet")
    assert agent["command"][:3] == ["passthrough", "agent", "--proc-root=/host/proc"]
    assert agent["env"] == [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                            {"name": "SSL_CERT_FILE", "value": "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"}]  # fmt: skip
    assert {"--sysfs-root=/host/sys", "--dev-root=/host/dev", "--state-dir=/run/passthrough",
            "--binder-socket=/run/passthrough-binder/binder.sock"} <= set(agent["command"])  # fmt: skip
    # Two binder containers, in the agent's order of preference: the standby binds while the first
    # cannot restart (killed while a child of it is blocked in the kernel).
    assert [a for a in agent["command"] if a.startswith("--binder-socket=")] == [
        "--binder-socket=/run/passthrough-binder/binder.sock", "--binder-socket=/run/passthrough-binder/standby.sock"]
    assert [c["name"] for c in daemonset["containers"]] == ["agent", "binder", "binder-standby"]
    for name, socket in (("binder", "binder.sock"), ("binder-standby", "standby.sock")):
        assert container(objects, "DaemonSet", name)["command"] == [
            "passthrough", "binder", f"--listen=/run/passthrough-binder/{socket}", "--sysfs-root=/host/sys",
            "--dev-root=/host/dev", "--proc-root=/host/proc"]  # fmt: skip
    assert "--no-pool-resources" not in agent["command"] and "--sriov-virtual-functions" not in agent["command"]


def agent_mounts(daemonset: dict, agent: dict) -> dict:
    """Container path -> (host path, read-only: False, True, or "recursive")."""
    host_paths = {v["name"]: v["hostPath"]["path"] if "hostPath" in v else "(emptyDir)" for v in daemonset["volumes"]}

    def read_only(m: dict) -> bool | str:
        return "recursive" if m.get("recursiveReadOnly") == "Enabled" and m.get("readOnly") else m.get("readOnly", False)

    return {m["mountPath"]: (host_paths[m["name"]], read_only(m)) for m in agent["volumeMounts"]}


def test_the_agent_pod_has_only_the_privilege_binding_needs(helm):
    """uid 0, and writable only where the bind sequence writes; nothing of the host's network."""
    objects = template(helm, "passthrough", "passthrough-system")
    daemonset = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    agent = container(objects, "DaemonSet")
    # The pod network: the kubelet's APIs are unix sockets, uevents reach a pod's namespace (Linux 4.18+).
    assert "hostNetwork" not in daemonset and "dnsPolicy" not in daemonset
    assert agent["ports"] == [{"name": "metrics", "containerPort": 9091, "protocol": "TCP"}]  # on the pod's address
    # uid 0 for root's sysfs files and sockets; no capability, not privileged, the runtime's AppArmor profile.
    assert daemonset["securityContext"] == {"runAsUser": 0}
    security = agent["securityContext"]
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "appArmorProfile" not in security and security["readOnlyRootFilesystem"] is True
    # The host's /sys and /proc read-only down to every mount below them (cgroups, securityfs, ...)
    # for the agent, which serves gRPC and talks to the API server: it writes no sysfs file.
    assert agent_mounts(daemonset, agent) == {
        "/host/sys": ("/sys", "recursive"),
        "/host/proc": ("/proc", "recursive"),
        "/host/usr/share": ("/usr/share", True),
        "/var/lib/kubelet/device-plugins": ("/var/lib/kubelet/device-plugins", False),
        "/var/lib/kubelet/pod-resources": ("/var/lib/kubelet/pod-resources", True),  # a client only
        "/host/dev/vfio": ("/dev/vfio", True),
        "/run/passthrough": ("/run/passthrough", False),
        "/run/passthrough-binder": ("(emptyDir)", False),
    }
    # The binder container, which does the bind sequence alone: writable only /sys/bus/pci
    # (unbind, drivers_probe) and /sys/devices (driver_override).
    binder = container(objects, "DaemonSet", "binder")
    assert binder["securityContext"] == security
    assert agent_mounts(daemonset, binder) == {
        "/run/passthrough-binder": ("(emptyDir)", False),
        "/host/sys": ("/sys", "recursive"),
        "/host/sys/bus/pci": ("/sys/bus/pci", False),
        "/host/sys/devices": ("/sys/devices", False),
        "/host/proc": ("/proc", "recursive"),
        "/host/dev/vfio": ("/dev/vfio", True),
    }

    # Its standby is the same in all but its name and socket: securityContext and mounts included.
    def but_name_and_socket(c: dict) -> dict:
        return {**c, "name": "", "command": [a for a in c["command"] if not a.startswith("--listen=")]}

    assert but_name_and_socket(container(objects, "DaemonSet", "binder-standby")) == but_name_and_socket(binder)


def test_the_agents_network_apparmor_and_read_only_mounts_can_be_loosened_per_cluster(helm, tmp_path):
    values = {"agent": {"hostNetwork": True, "appArmorProfile": {"type": "Unconfined"}, "recursiveReadOnly": "IfPossible"}}
    objects = template(helm, "p", "ns", values_file(tmp_path / "v.yaml", values))
    daemonset = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    agent = container(objects, "DaemonSet")
    assert daemonset["hostNetwork"] is True and daemonset["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert agent["securityContext"]["appArmorProfile"] == {"type": "Unconfined"}
    assert {m["mountPath"]: m.get("recursiveReadOnly") for m in agent["volumeMounts"] if m.get("recursiveReadOnly")} == {
        "/host/sys": "IfPossible", "/host/proc": "IfPossible"}
    out = helm("lint", "--strict", str(CHART), "--set=agent.recursiveReadOnly=Always", refused=True)
    assert "at '/agent/recursiveReadOnly': value must be one of 'Enabled', 'IfPossible', 'Disabled'" in out, out


def test_the_sriov_opt_in_reaches_the_agents_and_the_passthrough_config(helm):
    objects = template(helm, "p", "ns", "--set=discovery.sriovVirtualFunctions=true")
    assert "--sriov-virtual-functions" in container(objects, "DaemonSet")["command"]
    assert one(objects, "PassthroughConfig")["spec"]["discovery"] == {"sriovVirtualFunctions": True}


def test_the_chart_needs_the_kubernetes_that_has_its_admission_policies(helm):
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_yaml["kubeVersion"] == ">=1.30.0-0"  # ValidatingAdmissionPolicy is GA in 1.30
    out = helm("template", "p", str(CHART), "--kube-version=1.29.9", refused=True)
    assert "chart requires kubeVersion: >=1.30.0-0 which is incompatible with Kubernetes v1.29.9" in out, out
    helm("template", "p", str(CHART), "--kube-version=1.30.0")
    # What an admin reads before installing says so, and why.
    assert "Kubernetes 1.30 or later" in (REPO / "README.md").read_text()
    install = " ".join((REPO / "docs" / "install" / "index.md").read_text().split())
    assert "Kubernetes 1.30 or later (the chart's ValidatingAdmissionPolicies are GA there" in install


def test_pools_left_to_nvidias_plugin_and_a_reporting_only_agent(helm, tmp_path):
    objects = template(helm, "p", "ns", values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"poolResources": False}}}))
    assert "--no-pool-resources" in container(objects, "DaemonSet")["command"]
    objects = template(helm, "p", "ns", values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"enabled": False}}}))
    agent = container(objects, "DaemonSet")
    assert "--no-device-plugin" in agent["command"] and "appArmorProfile" not in agent["securityContext"]
    # Reporting only: nothing of the kubelet's, the host's sysfs read-only throughout, and not root.
    daemonset = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert agent_mounts(daemonset, agent) == {
        "/host/sys": ("/sys", "recursive"),
        "/host/proc": ("/proc", "recursive"),
        "/host/usr/share": ("/usr/share", True),
    }
    assert daemonset["securityContext"] == {"runAsUser": 65534, "runAsGroup": 65534, "runAsNonRoot": True}


def test_the_chart_ships_the_crds_the_models_generate(helm):
    rendered = template(helm, "passthrough", "passthrough-system", "--include-crds")
    shipped = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "CustomResourceDefinition"}
    assert shipped == {c["metadata"]["name"]: c for c in crds.all_crds()}


def test_a_values_file_is_the_platform_values(helm, tmp_path):
    values = {**PLATFORM, "agent": {"nodeSelector": {"passthrough.io/gpu": "true"}}, "operator": {"workers": 4}}
    objects = template(helm, "passthrough", "passthrough-system", values_file(tmp_path / "values.yaml", values))
    spec = one(objects, "PassthroughConfig")["spec"]
    assert spec == {**PLATFORM, "dra": {"enabled": False, "perNode": False}}  # `dra` is the agents' mode, not a value of its own
    parse_values(spec)  # what the operator will read: valid platform values
    # Helm merges maps: the values file's label joins the default one.
    selector = one(objects, "DaemonSet")["spec"]["template"]["spec"]["nodeSelector"]
    assert selector == {"kubernetes.io/os": "linux", "passthrough.io/gpu": "true"}
    assert "--workers=4" in container(objects, "Deployment")["command"]
    assert one(objects, "Deployment")["spec"]["replicas"] == 2  # the default: one leads, both serve the webhooks


def test_the_agents_dra_mode_is_what_the_operator_tells_kubevirt(helm, tmp_path):
    # One switch: the agents' DRA mode is the PassthroughConfig's spec.dra, so the operator turns
    # KubeVirt's DRA gates on exactly where the nodes publish ResourceSlices.
    for flags, enabled in ((("--set=agent.devicePlugin.dra=true",), True), ((), False),
                           (("--set=agent.devicePlugin.dra=true", "--set=agent.devicePlugin.enabled=false"), False)):
        objects = template(helm, "passthrough", "passthrough-system", *flags)
        assert one(objects, "PassthroughConfig")["spec"]["dra"] == {"enabled": enabled, "perNode": False}, flags
    values = values_file(tmp_path / "values.yaml", {"dra": {"enabled": True}})
    refused = helm("template", "passthrough", str(CHART), values, refused=True)
    assert "dra" in refused  # not a value of its own: the schema refuses it


def test_config_create_false_leaves_the_passthrough_config_to_someone_else(helm):
    objects = template(helm, "passthrough", "passthrough-system", "--set=config.create=false")
    assert "PassthroughConfig" not in {o["kind"] for o in objects}


# -- the values schema: what the templates would silently ignore, helm refuses ------------------


def test_the_default_values_and_documented_overrides_pass_lint_strict(helm, tmp_path):
    helm("lint", "--strict", str(CHART))
    values = {
        **PLATFORM,
        "imagePullSecrets": [{"name": "registry"}],
        # null drops a default (Helm removes the key before the schema sees it); durations as the CLI reads them.
        "agent": {"nodeSelector": None, "rescanInterval": 300, "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}]},
        "operator": {"resources": {"requests": {"cpu": 1, "memory": "256Mi"}}},
        "webhook": {"certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}},
        "global": {"imageRegistry": "registry.example.com"},  # what a parent chart passes to its subcharts
    }
    helm("lint", "--strict", str(CHART), values_file(tmp_path / "values.yaml", values))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--set=gpu.replaceDefault=true", "at '/gpu': additional properties 'replaceDefault' not allowed"),
        ("--set=operator.replica=2", "at '/operator': additional properties 'replica' not allowed"),
        ("--set=agent.devicePlugin.poolResource=false", "at '/agent/devicePlugin': additional properties 'poolResource' not allowed"),
    ],
)
def test_lint_strict_refuses_a_misspelt_key_naming_it(helm, flag, message):
    out = helm("lint", "--strict", str(CHART), flag, refused=True)
    assert message in out, out


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"devices": {"notFoundGracePeriodSeconds": "ten"}}, "at '/devices/notFoundGracePeriodSeconds': got string, want integer"),
        ({"gpu": {"replaceDefaults": "yes"}}, "at '/gpu/replaceDefaults': got string, want boolean"),
        ({"gpu": {"variant": "sriov"}}, "at '/gpu/variant': value must be one of 'default', 'vgpu'"),
        ({"operator": {"workers": "16"}}, "at '/operator/workers': got string, want integer"),
    ],
)
def test_lint_strict_refuses_a_wrong_type_naming_the_key(helm, tmp_path, values, message):
    out = helm("lint", "--strict", str(CHART), values_file(tmp_path / "values.yaml", values), refused=True)
    assert message in out, out


def test_namespace_roles_read_pcidevices_and_the_policies_confine_this_releases_agent(helm):
    objects = template(helm, "p", "infra")
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    tenants = roles["p-passthrough-pcidevices-view"]
    aggregation = {k: v for k, v in tenants["metadata"]["labels"].items() if k.startswith("rbac.authorization.k8s.io/")}
    assert aggregation == {f"rbac.authorization.k8s.io/aggregate-to-{r}": "true" for r in ("view", "edit", "admin")}
    assert tenants["rules"] == [{"apiGroups": ["passthrough.io"], "resources": ["pcidevices"], "verbs": ["get", "list", "watch"]}]
    assert roles["p-passthrough-device-admin"]["rules"] == [
        {"apiGroups": ["passthrough.io"], "resources": ["nodepcidevices"], "verbs": ["get", "list", "watch", "patch", "update"]},
        {"apiGroups": ["passthrough.io"], "resources": ["pcidevices", "passthroughconfigs"], "verbs": ["get", "list", "watch"]},
    ]
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "ValidatingAdmissionPolicy"}
    assert sorted(policies) == ["p-passthrough-agent-devices", "p-passthrough-agent-node", "p-passthrough-pcidevices"]
    for name, spec in policies.items():
        assert spec["failurePolicy"] == "Fail"
        if name.startswith("p-passthrough-agent"):
            assert spec["matchConditions"] == [
                {"name": "the-agent", "expression": "request.userInfo.username == 'system:serviceaccount:infra:p-passthrough-agent'"}
            ]
    # PCIDevices: everyone but this release's operator (and the controller-manager, system:masters) is judged.
    pcidevices = policies["p-passthrough-pcidevices"]
    assert pcidevices["matchConditions"][0] == {
        "name": "not-the-operator", "expression": "request.userInfo.username != 'system:serviceaccount:infra:p-passthrough-operator'"}
    assert pcidevices["matchConstraints"]["resourceRules"] == [{
        "apiGroups": ["passthrough.io"], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["pcidevices", "pcidevices/status"]}]  # fmt: skip
    bindings = {o["spec"]["policyName"]: o["spec"] for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"}
    assert bindings == {name: {"policyName": name, "validationActions": ["Deny"]} for name in policies}


# -- against the API server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def release(cluster, helm, tmp_path_factory):
    """The chart's accounts, roles and agent policies, created for real in a namespace of their own.

    Yields the rendered objects and the operator's kubeconfig, which logs in with a token of
    its service account (the agent's is bound to a pod on its node: see `agent`).
    """
    suffix = os.urandom(3).hex()
    namespace, name = f"chart-{suffix}", f"passthrough-{suffix}"
    cluster.kubectl("create", "namespace", namespace)
    objects = template(helm, name, namespace)
    try:
        with chart.installed(cluster, chart.access(objects)):
            folder = tmp_path_factory.mktemp("kubeconfigs")
            operator = identities.identity(cluster, namespace, f"{name}-operator", folder)
            yield {"namespace": namespace, "name": name, "objects": objects, "kubeconfig": {"operator": operator.kubeconfig},
                   "folder": folder}  # fmt: skip
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_api_server_accepts_every_rendered_object(cluster, helm, release, tmp_path):
    # Another release name, so that each object is a create and validated whole (but for the
    # one `cluster` PassthroughConfig, which may exist: hence --force-conflicts).
    flags = [values_file(tmp_path / "values.yaml", PLATFORM), "--set=imagePullSecrets[0].name=registry",
             "--set=operator.extraArgs[0]=--verbose", "--set=agent.hotplug=false"]
    objects = template(helm, f"dry-{release['name']}", release["namespace"], *flags)
    out = cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(objects)
    ).stdout
    assert out.count("serverside-applied (server dry run)") == len(objects), out


def test_helm_install_refuses_a_misspelt_key_and_records_no_release(cluster, helm, release):
    where = (f"--kubeconfig={cluster.kubeconfig}", f"--namespace={release['namespace']}")
    out = helm("install", f"typo-{release['name']}", str(CHART), *where, "--set=gpu.replaceDefault=true", refused=True)
    assert "at '/gpu': additional properties 'replaceDefault' not allowed" in out, out
    assert helm("list", "--all", "--short", *where).strip() == ""


def test_a_config_that_names_no_variant_gets_the_default_one_from_the_api_server(cluster):
    """`kubectl get ptconfig` shows VARIANT (.spec.gpu.variant) even for `spec: {}`: the CRD
    defaults each level, spec, gpu, then variant. In a dry run: `cluster` is a singleton."""
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": {}}
    live = cluster.kubectl("get", "ptconfig", "cluster", "-o", "json", check=False)
    if live.returncode == 0:  # another test's: replace it with ours, in the dry run only
        body["metadata"]["resourceVersion"] = json.loads(live.stdout)["metadata"]["resourceVersion"]
    verb = "replace" if live.returncode == 0 else "create"
    out = cluster.kubectl(verb, "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(body)).stdout
    assert json.loads(out)["spec"] == {
        "kubevirt": {"name": "kubevirt", "namespace": "kubevirt"},
        "gpu": {"variant": "default", "replaceDefaults": False, "permittedHostDevices": {}},
        "discovery": {"sriovVirtualFunctions": False},
        "dra": {"enabled": False, "perNode": False},
        # No `devices`: without one, the operator's --not-found-grace applies.
    }


def explained(cluster, field: str, timeout: float = 30) -> str:
    """The DESCRIPTION of `kubectl explain FIELD`, on one line (the API server publishes a
    CRD's OpenAPI a moment after it is established)."""
    deadline = time.monotonic() + timeout
    while True:
        result = cluster.kubectl("explain", field, check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert result.returncode == 0, result.stderr
    description = result.stdout.split("DESCRIPTION:", 1)[1].split("FIELDS:", 1)[0]
    return " ".join(description.split())


@pytest.mark.parametrize(
    ("field", "says"),
    [
        ("passthroughconfig.spec", "The platform values."),
        ("passthroughconfig.spec.gpu", "GPU variant and the KubeVirt allow-list"),
        ("passthroughconfig.spec.gpu.permittedHostDevices", "Allow-list entries besides"),
        ("nodepcidevice.spec", "which namespace may use it"),
        ("pcidevice.status", "The assigned device as this namespace sees it"),
    ],
)
def test_kubectl_explain_describes_the_fields_a_new_admin_looks_up(cluster, field, says):
    assert says in explained(cluster, field)


def test_kubectl_explain_names_the_condition_types_of_each_kind(cluster):
    config = explained(cluster, "passthroughconfig.status.conditions.type")
    assert all(t in config for t in ("Valid", "Applied", "AssignedDevicesPermitted", "NodesMatchAllowList")), config
    assert "Assigned (" not in config and "Ready" not in config, config
    assert "Ready" in explained(cluster, "pcidevice.status.conditions.type")


def can_i(cluster, release, component: str, verb: str, resource: str, *flags: str) -> bool:
    account = f"system:serviceaccount:{release['namespace']}:{release['name']}-{component}"
    result = cluster.kubectl("auth", "can-i", verb, resource, f"--as={account}", *flags, check=False)
    return result.stdout.strip() == "yes"


def test_the_service_accounts_may_do_nothing_more(cluster, release):
    agent = [
        ("delete", "nodepcidevices.passthrough.io"),
        ("update", "nodepcidevices.passthrough.io"),
        *[(verb, "pcidevices.passthrough.io") for verb in ("get", "list", "watch", "create", "patch", "delete")],
        ("patch", "passthroughconfigs.passthrough.io"),
        *[(verb, "nodes") for verb in ("create", "update", "delete")],
        ("create", "events"),
        ("list", "secrets"),
        # list (who asks at Allocate) and watch (a pod's end frees its device) only
        *[(verb, "pods") for verb in ("get", "create", "patch", "delete")],
    ]
    operator = [
        *[(verb, "nodes") for verb in ("get", "patch", "delete")],
        # Only the agent creates NodePCIDevices; an apply of ours racing a deletion must not recreate one.
        ("create", "nodepcidevices.passthrough.io"),
        ("patch", "passthroughconfigs.passthrough.io"),  # the values are the admin's; we write status
        ("create", "kubevirts.kubevirt.io"),
        ("delete", "kubevirts.kubevirt.io"),
        ("patch", "virtualmachines.kubevirt.io"),
        ("list", "secrets"),
    ]
    allowed = [("agent", v, r) for v, r in agent if can_i(cluster, release, "agent", v, r, "-A")]
    allowed += [("operator", v, r) for v, r in operator if can_i(cluster, release, "operator", v, r, "-A")]
    assert allowed == []
    # What RBAC leaves the agent cluster-wide (any NodePCIDevice, any Node) the agent policies
    # narrow to its own node: tests/integration/test_tenancy.py.
    # OwnerReferencesPermissionEnforcement (not enabled in the test control plane, on in many
    # clusters) asks this of whoever sets blockOwnerDeletion on a PCIDevice.
    assert can_i(cluster, release, "operator", "update", "nodepcidevices.passthrough.io", "--subresource=finalizers")


def test_both_accounts_may_review_a_metrics_scraper_and_the_reader_role_grants_only_get_metrics(cluster, release):
    # --metrics-auth (the chart's default): each process asks the API server about a scraper's token.
    for component in ("agent", "operator"):
        assert can_i(cluster, release, component, "create", "tokenreviews.authentication.k8s.io")
        assert can_i(cluster, release, component, "create", "subjectaccessreviews.authorization.k8s.io")
    reader = [o for o in release["objects"] if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-metrics-reader")]
    assert [o["rules"] for o in reader] == [[{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]]


# -- the real agent and operator with only the chart's RBAC ------------------------------------


def command_line(objects: list[dict], kind: str, *overrides: str) -> list[str]:
    """The rendered container command, run with this venv's python, without the rendered flags that
    `overrides` name again (a repeatable flag such as --binder-socket would add up, not override)."""
    command = container(objects, kind)["command"]
    assert command[0] == "passthrough"
    named = {o.split("=", 1)[0] for o in overrides if o.startswith("--")}
    return [sys.executable, "-m", "passthrough", *(a for a in command[1:] if a.split("=", 1)[0] not in named), *overrides]


def denied_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if DENIED.search(line)]


async def denied_requests(api) -> Counter:
    """Requests the API server has answered 403 so far, by (resource[/subresource], verb).

    Counted by the API server itself: a denied write the code does not log is counted too.
    """
    response = await api.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False,
                                  _return_http_data_only=True)  # fmt: skip
    counts: Counter = Counter()
    for line in (await response.read()).decode().splitlines():
        if line.startswith("apiserver_request_total{") and 'code="403"' in line:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            resource = "/".join(filter(None, (labels.get("resource"), labels.get("subresource"))))
            counts[(resource, labels.get("verb"))] += int(float(line.rsplit(" ", 1)[1]))
    return counts


def since(before: Counter, after: Counter) -> dict:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.fixture(scope="module")
async def node(api, release):
    node = await support.ensure_node(api, f"{release['name']}-node")
    yield node
    with contextlib.suppress(client.exceptions.ApiException):
        await support.remove_node(api, node.name)


@pytest.fixture(scope="module")
async def agent(api, cluster, release, node, tmp_path_factory):
    """The agent of the rendered DaemonSet, as the agent service account, over a fixture GPU node.

    Its token is bound to a pod on its node, as the DaemonSet pod's projected token is, so the
    agent policies judge its writes by that node.
    """
    namespace, account = release["namespace"], f"{release['name']}-agent"
    identities.pod_on_node(cluster, namespace, f"{account}-pod", node.name, account)
    kubeconfig = identities.identity(cluster, namespace, account, release["folder"], bound_pod=f"{account}-pod").kubeconfig
    chart.wait_for_agent_policies(cluster, namespace, release["name"], node.name)
    root = tmp_path_factory.mktemp("agent")
    host = fakesysfs.gpu_node(root / "host")
    kernel = FakeKernel(host).start()
    # The DaemonSet's binder container: the bind sequence, through the socket the agent names.
    binder_socket = root / "binder.sock"
    binder = start_binder(binder_socket, host, stdout=subprocess.DEVNULL)
    env = dict(os.environ)
    for var in container(release["objects"], "DaemonSet")["env"]:
        if var["name"] == "SSL_CERT_FILE":  # the service account's CA: here, the local cluster's
            env[var["name"]] = str(cluster.ca_file)
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
            env[var["name"]] = node.name
    log_path = root / "agent.log"
    args = command_line(
        release["objects"], "DaemonSet",
        f"--kubeconfig={kubeconfig}", f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}",
        f"--pci-ids={PCI_IDS}", "--no-hotplug", f"--dev-root={host.root / 'dev'}",
        f"--device-plugin-dir={root / 'device-plugins'}", f"--pod-resources-socket={root / 'pod-resources.sock'}",
        f"--state-dir={root / 'state'}", f"--binder-socket={binder_socket}",
        "--metrics-port=0",  # the chart's fixed port may be taken on a shared machine (test_metrics scrapes a free one)
    )  # fmt: skip
    denied_before = await denied_requests(api)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    kind = Custom(api, "nodepcidevices")

    async def reported():
        items = (await kind.list(f"{NODE_LABEL}={node.name}"))["items"]
        return {o["status"]["attributes"]["pciAddress"]: o for o in items if o.get("status")} if len(items) == 4 else None

    try:
        await support.wait_for(reported, 30, what=f"the agent's first report; log:\n{_tail(log_path)}")
        yield {"host": host, "proc": proc, "log": log_path, "reported": reported, "denied_before": denied_before}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        binder.terminate()
        binder.wait(15)
        kernel.stop()


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else ""


async def test_the_agent_reports_its_node_with_only_its_service_account_and_the_node_policy(api, agent, node):
    devices = await agent["reported"]()
    assert sorted(a for a in devices if a in GPUS) == sorted(GPUS)
    assert (await client.CoreV1Api(api).read_node(node.name)).metadata.labels[VFIO_LABEL] == "true"
    log = agent["log"].read_text()
    assert denied_lines(log) == [] and "Traceback" not in log, log[-3000:]
    assert since(agent["denied_before"], await denied_requests(api)) == {}


async def test_the_operator_does_its_work_with_only_its_service_account(api, cluster, helm, release, agent, node, tmp_path):
    suffix = release["name"].rsplit("-", 1)[1]
    team, kubevirt_ns = f"team-{suffix}", f"kv-{suffix}"
    for ns in (team, kubevirt_ns):
        cluster.kubectl("create", "namespace", ns)
    devices = await agent["reported"]()
    name = devices[GPUS[0]]["metadata"]["name"]
    npci, pcidev = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    configs = Custom(api, "passthroughconfigs")
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    values = {**PLATFORM, "kubevirt": {**PLATFORM["kubevirt"], "namespace": kubevirt_ns}}
    config = one(template(helm, release["name"], release["namespace"], values_file(tmp_path / "values.yaml", values)),
                 "PassthroughConfig")  # fmt: skip
    args = [a for a in command_line(release["objects"], "Deployment", "--metrics-port=0")[4:] if not a.startswith(("--liveness=", "--readiness="))]
    # The webhook serves on 127.0.0.1 with a certificate made here (its flags follow, and win).
    operator = OperatorProcess(cluster, tmp_path / "operator.log", *args, f"--kubeconfig={release['kubeconfig']['operator']}",
                               webhook=WebhookServing(tmp_path / "webhook-tls"))  # fmt: skip
    denied_before = await denied_requests(api)
    operator.start()
    try:
        # Assignment, exactly as NOTES.txt tells the admin: the PCIDevice appears in the namespace.
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": team}}))
        await support.wait_for(lambda: _status(pcidev, name, team), 20, what=f"PCIDevice {team}/{name}")
        await support.wait_for(lambda: _condition(npci, name, "Assigned", "True"), 20, what="the NodePCIDevice Assigned")
        # What the tenant sees: READY says whether the device can be used now (it was Ready to be handed out).
        table = cluster.kubectl("get", "pci", name, "-n", team).stdout.splitlines()
        assert table[0].split() == ["NAME", "NODE", "ADDRESS", "READY", "ATTACHED", "AGE"]
        assert table[1].split()[:5] == [name, node.name, GPUS[0], "True", "False"]
        # Events are posted in the background and a failure is only logged at debug level: look.
        await support.wait_for(lambda: _event(api, team, name, "Assigned"), 10, what="the operator's Assigned Event")

        # The chart's PassthroughConfig, applied as the admin: the KubeVirt CR gets the values.
        await support.create_kubevirt(api, kubevirt_ns)
        cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(config))

        # replaceDefaults: the values' one entry, and the exclusive resource of the assigned device.
        wanted = ["nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION", exclusive_resource_name(name)]

        async def configured():
            kv = await kubevirts.get("kubevirt", kubevirt_ns)
            permitted = (kv["spec"]["configuration"].get("permittedHostDevices") or {}).get("pciHostDevices") or []
            return sorted(e["resourceName"] for e in permitted) == sorted(wanted)

        await support.wait_for(configured, 20, what=f"permittedHostDevices {wanted}")
        await support.wait_for(lambda: _condition(configs, "cluster", "Applied", "True"), 20, what="config status Applied")
        table = cluster.kubectl("get", "ptconfig").stdout.splitlines()
        assert table[0].split() == ["NAME", "VARIANT", "VALID", "APPLIED", "PCI-HOST-DEVICES", "AGE"]
        assert table[1].split()[:5] == ["cluster", "default", "True", "True", str(len(wanted))]

        # A VM that uses the device: finalizers on both objects; dropping the VM drops them.
        vms = client.CustomObjectsApi(api)
        await vms.create_namespaced_custom_object("kubevirt.io", "v1", team, "virtualmachines", _vm(team, name))
        await support.wait_for(lambda: _has_finalizer(npci, name), 20, what="the NodePCIDevice's finalizer")
        await support.wait_for(lambda: _condition(npci, name, "Attached", "True"), 20, what="the NodePCIDevice Attached")
        await vms.delete_namespaced_custom_object("kubevirt.io", "v1", team, "virtualmachines", "uses-gpu")
        await support.wait_for(lambda: _has_finalizer(npci, name, False), 20, what="the finalizer dropped")

        # Unassigned: the PCIDevice is deleted. Gone from the node and unassigned: so is the NodePCIDevice.
        cluster.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": ""}}))
        await support.wait_for(lambda: _absent(pcidev, name, team), 20, what="the PCIDevice deleted")
        agent["host"].remove_device(GPUS[1])
        agent["proc"].send_signal(signal.SIGHUP)
        gone = devices[GPUS[1]]["metadata"]["name"]
        await support.wait_for(lambda: _absent(npci, gone), 20, what="the vanished device's NodePCIDevice deleted")
        denied = since(denied_before, await denied_requests(api))
    finally:
        operator.stop()
        with contextlib.suppress(client.exceptions.ApiException):
            await configs.delete("cluster")  # other modules' operators must not find our values
        for ns in (team, kubevirt_ns):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    log = operator.output()
    assert denied_lines(log) == [] and "Traceback" not in log, log[-5000:]
    assert denied == {}, "the API server refused these requests (its own counters)"


async def _status(kind: Custom, name: str, namespace: str | None = None):
    obj = await kind.get(name, namespace)
    return obj if obj and obj.get("status") else None


async def _condition(kind: Custom, name: str, type_: str, status: str) -> bool:
    obj = await kind.get(name) or {}
    return any(c["type"] == type_ and c["status"] == status for c in (obj.get("status") or {}).get("conditions") or [])


async def _event(api, namespace: str, name: str, reason: str) -> bool:
    events = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return any(e.reason == reason and e.source.component == "passthrough-operator" for e in events.items)


async def _has_finalizer(kind: Custom, name: str, present: bool = True) -> bool:
    obj = await kind.get(name) or {"metadata": {}}
    return (FINALIZER in (obj["metadata"].get("finalizers") or [])) == present


async def _absent(kind: Custom, name: str, namespace: str | None = None) -> bool:
    return await kind.get(name, namespace) is None


def _vm(namespace: str, device: str) -> dict:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": "uses-gpu", "namespace": namespace},
        "spec": {
            "runStrategy": "Always",
            "template": {"spec": {"domain": {
                "devices": {"hostDevices": [{"name": "gpu", "deviceName": exclusive_resource_name(device)}]},
                "resources": {"requests": {"memory": "1Gi"}},
            }}},
        },
    }  # fmt: skip


def test_dra_mode_gives_the_agent_the_kubelets_plugin_directories_cdi_and_its_slices_and_claims(helm, tmp_path):
    assert not [o for o in template(helm, "p", "ns") if o["metadata"]["name"].endswith("-agent-dra")]  # opt-in
    objects = template(helm, "p", "ns", values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"dra": True}}}))
    daemonset = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    agent = container(objects, "DaemonSet")
    assert {"--dra", "--kubelet-dir=/var/lib/kubelet", "--cdi-dir=/var/run/cdi"} <= set(agent["command"])
    mounts = agent_mounts(daemonset, agent)
    assert {path: mounts[path] for path in ("/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi")} == {
        "/var/lib/kubelet/plugins_registry": ("/var/lib/kubelet/plugins_registry", False),
        "/var/lib/kubelet/plugins": ("/var/lib/kubelet/plugins", False),
        "/var/run/cdi": ("/var/run/cdi", False),
    }
    [role] = [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-agent-dra")]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]} == {
        (("resourceslices",), ("get", "list", "watch", "create", "patch")), (("resourceclaims",), ("get", "list", "watch")),
        (("resourceclaims/status",), ("patch",)), (("resourceclaims/driver",), ("associated-node:patch",))}


def test_where_nodes_choose_their_mode_every_agent_gets_the_dra_mounts_and_reads_its_label(helm, tmp_path):
    # agent.devicePlugin.perNode: any node may be DRA, so DRA's mounts, RBAC, webhooks and the operator's
    # --dra are rendered for all; `dra` stays the default of nodes without the label.
    for default in (False, True):
        objects = template(helm, "p", "ns", values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"dra": default, "perNode": True}}}))
        agent = container(objects, "DaemonSet")
        assert {"--per-node-mode", "--kubelet-dir=/var/lib/kubelet", "--cdi-dir=/var/run/cdi"} <= set(agent["command"])
        assert ("--dra" in agent["command"]) == default
        mounts = agent_mounts(one(objects, "DaemonSet")["spec"]["template"]["spec"], agent)
        assert {"/var/lib/kubelet/plugins_registry", "/var/lib/kubelet/plugins", "/var/run/cdi"} <= set(mounts)
        assert [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"].endswith("-agent-dra")]
        assert "--dra" in container(objects, "Deployment")["command"]
        webhooks = [w["name"] for o in objects if o["kind"] == "ValidatingWebhookConfiguration" for w in o["webhooks"]]
        assert "resourceclaims.admission.passthrough.io" in webhooks
        assert one(objects, "PassthroughConfig")["spec"]["dra"] == {"enabled": default, "perNode": True}
    assert "--per-node-mode" not in container(template(helm, "p", "ns"), "DaemonSet")["command"]  # opt-in


def test_dra_mode_sends_claims_allocations_and_admin_access_to_the_operators_webhooks(helm, tmp_path):
    from passthrough.admission import webhook
    from passthrough.dra.slice import DRIVER

    def hooks(*flags: str) -> dict[str, dict]:
        [configuration] = [o for o in template(helm, "p", "ns", "--show-only=templates/webhook.yaml", *flags)
                           if o["kind"] == "ValidatingWebhookConfiguration"]  # fmt: skip
        return {w["name"]: w for w in configuration["webhooks"]}

    assert not [name for name in hooks() if "resourceclaim" in name]  # opt-in, with DRA mode
    found = hooks(values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"dra": True}}}))
    dra = {name: w for name, w in found.items() if "resourceclaim" in name}
    assert {name: (w["clientConfig"]["service"]["path"], [r["resources"] for r in w["rules"]]) for name, w in dra.items()} == {
        "resourceclaim-allocations.admission.passthrough.io": (f"/{webhook.CLAIM_ALLOCATION}", [["resourceclaims/status"]]),
        "resourceclaims.admission.passthrough.io": (f"/{webhook.CLAIM}", [["resourceclaims"]]),
        "resourceclaimtemplates.admission.passthrough.io": (f"/{webhook.CLAIM_TEMPLATE}", [["resourceclaimtemplates"]]),
    }
    # Only a status that allocates a device of the agent's driver is sent; fail closed.
    allocation = dra["resourceclaim-allocations.admission.passthrough.io"]
    assert f"r.driver == '{DRIVER}'" in allocation["matchConditions"][0]["expression"]
    assert all(w["failurePolicy"] == "Fail" and w["matchPolicy"] == "Equivalent" for w in dra.values())


def test_dra_mode_lets_the_operator_keep_a_device_class_per_namespace(helm, tmp_path):
    def operator(*flags: str) -> tuple[list[str], set]:
        objects = template(helm, "p", "ns", *flags)
        [role] = [o for o in objects if o["kind"] == "ClusterRole" and o["metadata"]["name"] == "p-passthrough-operator"]
        rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(r["verbs"])) for r in role["rules"]}
        return container(objects, "Deployment")["command"], rules

    command, rules = operator()
    assert "--dra" not in command and not [r for r in rules if "resource.k8s.io" in r[0]]  # opt-in
    command, rules = operator(values_file(tmp_path / "v.yaml", {"agent": {"devicePlugin": {"dra": True}}}))
    assert "--dra" in command
    assert sorted(r for r in rules if "resource.k8s.io" in r[0]) == [
        (("resource.k8s.io",), ("deviceclasses",), ("list", "watch", "create", "patch", "delete")),
        (("resource.k8s.io",), ("resourceclaims",), ("list", "watch"))]  # the claims' devices: their Attached
