"""The admission webhooks, called for real by the API server, with real tenants.

The operator runs as its own process with its webhook server on 127.0.0.1 (a CA and serving
certificate made here); the chart's own ValidatingWebhookConfiguration, rendered by helm, is
registered with its clientConfig pointed there, so the API server decides by the chart's
matchConditions what it sends. Tenants of team-a and team-b are service accounts with a Role
in their namespace, acting through kubectl as a user would: refusals and warnings are what
they would read.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import chart, support
from e2e.identities import user_kubeconfig
from e2e.processes import OperatorProcess, WebhookServing, running
from passthrough.admission import webhook
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster
CHART = Path(__file__).resolve().parents[2] / "charts/passthrough-operator"
HOOK = {kind: f"{kind}.admission.passthrough.io" for kind in ("pods", "virtualmachines", "virtualmachineinstances")}
_REQUESTS = re.compile(r'^apiserver_admission_webhook_request_total\{([^}]*)\} (\S+)$')
_EXCLUDED = re.compile(r'^apiserver_admission_match_condition_exclusions_total\{([^}]*)\} (\S+)$')


# -- the operator with its webhooks, registered from the chart ---------------------------------


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    return WebhookServing(tmp_path_factory.mktemp("webhook-tls"))


@pytest.fixture(scope="module")
def operator(cluster, serving, tmp_path_factory):
    with running(OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", webhook=serving)) as proc:
        yield proc


@pytest.fixture(scope="module")
def webhooks(cluster, helm, serving, operator):
    """The chart's ValidatingWebhookConfiguration, calling the operator on 127.0.0.1."""
    configuration = chart.webhook_configuration(helm, serving)
    assert {w["name"] for w in configuration["webhooks"]} == set(HOOK.values())
    with chart.webhooks_registered(cluster, configuration):
        yield configuration


# -- tenants and their devices ------------------------------------------------------------------


class Tenant:
    """A service account of one namespace, with a Role to run VMs, VMIs and pods there; acts through kubectl."""

    def __init__(self, cluster, namespace: str, kubeconfig: Path) -> None:
        self.cluster, self.namespace, self.kubeconfig = cluster, namespace, kubeconfig

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.cluster.binary("kubectl"), f"--kubeconfig={self.kubeconfig}", f"--namespace={self.namespace}", *args],
            input=input, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def create(self, obj: dict) -> subprocess.CompletedProcess:
        return self.kubectl("create", "-f", "-", input=json.dumps(obj))

    def admitted(self, obj: dict) -> subprocess.CompletedProcess:
        result = self.create(obj)
        assert result.returncode == 0, result.stderr
        return result

    def refused(self, obj: dict) -> str:
        """The message the tenant reads (kubectl's 'Error from server ...' line) of a refused create."""
        result = self.create(obj)
        assert result.returncode != 0, f"{obj['kind']} {obj['metadata']['name']} was admitted"
        return result.stderr.strip()


ROLE = {
    "apiVersion": "rbac.authorization.k8s.io/v1",
    "kind": "Role",
    "metadata": {"name": "runs-vms"},
    "rules": [
        {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines", "virtualmachineinstances"],
         "verbs": ["get", "list", "create", "update", "patch", "delete"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "create", "delete"]},
    ],
}  # fmt: skip


def tenant(cluster, namespace: str, folder: Path) -> Tenant:
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(ROLE))
    kubeconfig = user_kubeconfig(cluster, namespace, "tenant", folder / f"{namespace}.kubeconfig")
    cluster.kubectl("create", "rolebinding", "tenant-runs-vms", "-n", namespace, "--role=runs-vms",
                    f"--serviceaccount={namespace}:tenant")  # fmt: skip
    # A pod needs the namespace's `default` ServiceAccount, which its controller makes a moment later.
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {namespace}"
        time.sleep(0.1)
    return Tenant(cluster, namespace, kubeconfig)


@dataclasses.dataclass
class Setup:
    a: Tenant
    b: Tenant
    d: list[str]  # team-a's devices on node 1
    other_node: str  # team-a's device on node 2
    node1: object
    node2: object


@pytest.fixture(scope="module")
async def setup(api, cluster, webhooks, tmp_path_factory):
    """team-a holds 11 devices of node 1 and one of node 2; team-b one of node 2."""
    suffix = os.urandom(3).hex()
    folder = tmp_path_factory.mktemp("tenants")
    a, b = tenant(cluster, f"team-a-{suffix}", folder), tenant(cluster, f"team-b-{suffix}", folder)
    node1, node2 = await support.ensure_node(api, f"adm-1-{suffix}"), await support.ensure_node(api, f"adm-2-{suffix}")
    d = [await support.report_device(api, node1, support.gpu(f"0000:{0x10 + i:02x}:00.0")) for i in range(11)]
    other, theirs = [await support.report_device(api, node2, support.gpu(f"0000:{0x40 + i:02x}:00.0")) for i in range(2)]
    pcidevices = Custom(api, "pcidevices", namespaced=True)
    held = [(name, a.namespace) for name in [*d, other]] + [(theirs, b.namespace)]
    for name, namespace in held:
        await support.assign(api, name, namespace)
    for name, namespace in held:
        await support.wait_for(lambda: ready(pcidevices, name, namespace), 30, what=f"PCIDevice {namespace}/{name} Ready")
    yield Setup(a, b, d, other, node1, node2)
    for name, _ in held:
        await support.assign(api, name, "")
    core = client.CoreV1Api(api)
    for namespace in (a.namespace, b.namespace):
        await core.delete_namespace(namespace)
    for node in (node1, node2):
        await support.remove_node(api, node.name)


async def ready(pcidevices: Custom, name: str, namespace: str) -> bool:
    device = await pcidevices.get(name, namespace)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in ((device or {}).get("status") or {}).get("conditions") or [])


# -- objects as a tenant writes them --------------------------------------------------------------


def vm(name: str, *devices: str, gpus: tuple[str, ...] = ()) -> dict:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"runStrategy": "Always", "template": {"spec": {"domain": domain(devices, gpus)}}},
    }


def vmi(name: str, *devices: str, owner: dict | None = None) -> dict:
    meta = {"name": name}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]  # fmt: skip
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": meta, "spec": {"domain": domain(devices)}}


def domain(devices, gpus=()) -> dict:
    listed = {"hostDevices": [{"name": f"dev{i}", "deviceName": resource(d)} for i, d in enumerate(devices)]}
    if gpus:
        listed["gpus"] = [{"name": f"gpu{i}", "deviceName": resource(d)} for i, d in enumerate(gpus)]
    return {"devices": listed, "resources": {"requests": {"memory": "1Gi"}}}


def resource(device: str) -> str:
    return device if "/" in device else f"passthrough.io/{device}"


def pod(name: str, *resources: str, init: bool = False) -> dict:
    """A pod with limits on `resources`, in its container or (`init`) an init container.
    No service-account token: the local control plane runs no root-CA publisher."""
    compute = {"name": "compute", "image": "virt-launcher:test"}
    spec = {"automountServiceAccountToken": False, "containers": [compute]}
    if resources:
        limits = {"resources": {"limits": {resource(r): "1" for r in resources}}}
        if init:
            spec["initContainers"] = [{"name": "prepare", "image": "virt-launcher:test", **limits}]
        else:
            compute.update(limits)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def denied(kind: str, message: str) -> str:
    return f'admission webhook "{HOOK[kind]}" denied the request: {message}'


def get(t: Tenant, kind: str, name: str) -> dict:
    result = t.kubectl("get", kind, name, "-o", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def cleanup(t: Tenant, *objects: str) -> None:
    for obj in objects:
        t.kubectl("delete", obj, "--ignore-not-found", "--wait=false", "--grace-period=0")


async def attached_to(api, device: str, namespace: str, vm_name: str) -> None:
    """Wait until the operator shows that it saw the VM list the device (its indexes have it)."""
    pcidevices = Custom(api, "pcidevices", namespaced=True)

    async def check():
        return ((await pcidevices.get(device, namespace)) or {}).get("status", {}).get("attachedTo") == vm_name

    await support.wait_for(check, 20, what=f"{namespace}/{device} attached to {vm_name}")


# -- the API server's own count of webhook calls ------------------------------------------------


async def webhook_counts(api) -> tuple[Counter, Counter]:
    """Calls the API server made to each of our webhooks, and requests it kept from them by matchConditions."""
    text = await support._raw(api, "/metrics")
    calls, excluded = Counter(), Counter()
    for line in text.splitlines():
        for pattern, counts in ((_REQUESTS, calls), (_EXCLUDED, excluded)):
            match = pattern.match(line)
            if match:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
                counts[labels.get("name", "")] += int(float(match.group(2)))
    return calls, excluded


# -- team-a and team-b ------------------------------------------------------------------------------


async def test_team_a_runs_a_vm_a_vmi_and_a_pod_with_its_own_devices(setup):
    a, d = setup.a, setup.d
    try:
        a.admitted(vm("vm-own", d[0]))
        a.admitted(vmi("vmi-own", d[1]))
        a.admitted(pod("launcher-own", d[2]))
        a.admitted(pod("launcher-init", d[3], init=True))
    finally:
        cleanup(a, "vm/vm-own", "vmi/vmi-own", "pod/launcher-own", "pod/launcher-init")


async def test_team_b_cannot_use_team_as_device_in_a_vm_a_vmi_or_a_pod(setup):
    b, device = setup.b, setup.d[0]
    wrong = (f"passthrough.io/{device} is not a PCIDevice of namespace {b.namespace}; ask an admin to assign the device to "
             f"{b.namespace}, or use one that `kubectl get pcidevices -n {b.namespace}` lists.")  # fmt: skip
    assert denied("virtualmachines", f"VirtualMachine {b.namespace}/vm-steal: {wrong}") in b.refused(vm("vm-steal", device))
    assert denied("virtualmachineinstances", f"VirtualMachineInstance {b.namespace}/vmi-steal: {wrong}") in b.refused(
        vmi("vmi-steal", device))
    # The pod rule is the one that keeps a bare pod away from team-a's /dev/vfio: limits, requests, init containers.
    assert denied("pods", f"Pod {b.namespace}/pod-steal: {wrong}") in b.refused(pod("pod-steal", device))
    assert denied("pods", f"Pod {b.namespace}/pod-steal: {wrong}") in b.refused(pod("pod-steal", device, init=True))
    requests = pod("pod-steal", device)
    requests["spec"]["containers"][0]["resources"] = {"requests": {resource(device): "1"}, "limits": {resource(device): "1"}}
    assert "is not a PCIDevice of namespace" in b.refused(requests)
    # Nor as a display device.
    assert "is not a PCIDevice of namespace" in b.refused(vm("vm-steal", gpus=(device,)))


# -- the VM rules, one test each -------------------------------------------------------------------


async def test_a_device_the_namespace_does_not_hold_is_refused(setup):
    a = setup.a
    message = a.refused(vm("vm-missing", "pci-does-not-exist"))
    assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-missing: passthrough.io/pci-does-not-exist is not a "
                  f"PCIDevice of namespace {a.namespace}; ask an admin to assign the device") in message  # fmt: skip


async def test_more_than_eight_devices_are_refused(setup):
    a = setup.a
    message = a.refused(vm("vm-nine", *setup.d[:9]))
    assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-nine: ") in message
    assert "9 passthrough devices are listed, at most 8 fit one VM; remove 1" in message


async def test_devices_on_different_nodes_are_refused(setup):
    a, d = setup.a, setup.d
    message = a.refused(vm("vm-spread", d[5], setup.other_node))
    nodes = sorted([(setup.node1.name, d[5]), (setup.node2.name, setup.other_node)])
    where = "; ".join(f"{device} on {node}" for node, device in nodes)
    assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-spread: the devices are on different nodes ({where}) "
                  "and a VM runs on one; list devices of one node only.") in message  # fmt: skip


async def test_the_same_device_twice_is_refused(setup):
    a, device = setup.a, setup.d[3]
    message = a.refused(vm("vm-twice", device, gpus=(device,)))
    assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-twice: passthrough.io/{device} is listed 2 times; "
                  "list each device once.") in message  # fmt: skip


async def test_a_device_another_vm_of_the_namespace_lists_is_refused_but_that_vms_own_vmi_is_admitted(api, setup):
    a, device = setup.a, setup.d[4]
    try:
        a.admitted(vm("vm-first", device))
        await attached_to(api, device, a.namespace, "vm-first")
        message = a.refused(vm("vm-second", device))
        assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-second: PCIDevice {device} is already used by "
                      f"VirtualMachine {a.namespace}/vm-first; remove it from that VM first, or use another device.") in message  # fmt: skip
        # The instance KubeVirt makes from vm-first (owned by it) lists the same device: admitted.
        a.admitted(vmi("vm-first", device, owner=get(a, "vm", "vm-first")))
        # A stray VMI with that device is another user.
        assert "is already used by VirtualMachine" in a.refused(vmi("vmi-stray", device))
    finally:
        cleanup(a, "vmi/vm-first", "vm/vm-first")


async def test_a_device_that_is_not_ready_is_admitted_with_a_warning_kubectl_prints(api, setup):
    a, device = setup.a, setup.d[9]
    # Handed out while Ready; then its node says a network interface under it came up.
    down = dataclasses.replace(support.gpu("0000:19:00.0"), eligible=False, reason="network interface eth0 is up; bring it down")
    await support.report_device(api, setup.node1, down)
    pcidevices = Custom(api, "pcidevices", namespaced=True)

    async def not_ready():
        return not await ready(pcidevices, device, a.namespace)

    await support.wait_for(not_ready, 20, what="PCIDevice Ready=False")
    try:
        result = a.admitted(vm("vm-waits", device))
        assert f"Warning: PCIDevice {device} is not Ready (NotReady: " in result.stderr
        assert "network interface eth0 is up" in result.stderr and "the VM will not start on it until it is" in result.stderr
    finally:
        cleanup(a, "vm/vm-waits")


async def test_a_device_being_removed_is_refused_while_the_vm_holding_it_stays_editable(api, cluster, setup):
    a, device = setup.a, setup.d[10]
    a.admitted(vm("vm-holds", device))
    await attached_to(api, device, a.namespace, "vm-holds")
    await support.assign(api, device, "")  # the admin takes it back; the VM keeps it (Terminating, in-use finalizer)
    pcidevices = Custom(api, "pcidevices", namespaced=True)

    async def terminating():
        return ((await pcidevices.get(device, a.namespace)) or {}).get("metadata", {}).get("deletionTimestamp")

    await support.wait_for(terminating, 20, what="the PCIDevice Terminating")
    try:
        removed = f"PCIDevice {device} is being removed from namespace {a.namespace} (unassigned or reassigned)"
        message = a.refused(vm("vm-late", device))
        assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-late: {removed}; use another device of the namespace.") in message
        assert denied("pods", f"Pod {a.namespace}/pod-late: {removed}; no new pod may use it.") in a.refused(pod("pod-late", device))
        # The VM that holds it stays editable: an update that adds no device is not judged.
        edit = a.kubectl("patch", "vm", "vm-holds", "--type=merge", "-p", json.dumps({"spec": {"runStrategy": "Halted"}}))
        assert edit.returncode == 0, edit.stderr
    finally:
        cleanup(a, "vm/vm-holds")
    await support.wait_for(lambda: _gone(pcidevices, device, a.namespace), 20, what="the PCIDevice gone with the VM's reference")


async def _gone(kind: Custom, name: str, namespace: str) -> bool:
    return await kind.get(name, namespace) is None


async def test_an_update_is_judged_only_for_the_devices_it_adds(api, setup):
    a, device = setup.a, setup.d[6]
    try:
        a.admitted(vm("vm-grows", device))
        added = vm("vm-grows", device, "pci-does-not-exist")["spec"]
        message = a.kubectl("patch", "vm", "vm-grows", "--type=merge", "-p", json.dumps({"spec": added})).stderr
        assert denied("virtualmachines", f"VirtualMachine {a.namespace}/vm-grows: passthrough.io/pci-does-not-exist is not a "
                      "PCIDevice of namespace") in message  # fmt: skip
        assert f"passthrough.io/{device} " not in message
        calls, _ = await webhook_counts(api)
        edit = a.kubectl("patch", "vm", "vm-grows", "--type=merge", "-p", json.dumps({"metadata": {"labels": {"tier": "gold"}}}))
        assert edit.returncode == 0, edit.stderr
        after, _ = await webhook_counts(api)
        assert after[HOOK["virtualmachines"]] == calls[HOOK["virtualmachines"]]  # not even sent
    finally:
        cleanup(a, "vm/vm-grows")


# -- only what the operator handed out, however it is asked for --------------------------------------


def asking_in_limits(obj: dict, *devices: str) -> dict:
    """`obj` (a VM or VMI) asking for `devices` in domain.resources.limits, as KubeVirt copies them into the launcher pod."""
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "VirtualMachine" else obj["spec"]
    spec["domain"]["resources"]["limits"] = {resource(d): "1" for d in devices}
    return obj


async def test_a_device_asked_for_in_domain_resources_is_judged_as_one_listed(api, setup):
    a, b, device = setup.a, setup.b, setup.d[7]
    wrong = f"passthrough.io/{device} is not a PCIDevice of namespace {b.namespace}"
    message = b.refused(asking_in_limits(vm("vm-limits-steal"), device))
    assert denied("virtualmachines", f"VirtualMachine {b.namespace}/vm-limits-steal: {wrong}") in message
    message = b.refused(asking_in_limits(vmi("vmi-limits-steal"), device))
    assert denied("virtualmachineinstances", f"VirtualMachineInstance {b.namespace}/vmi-limits-steal: {wrong}") in message
    try:
        # Its own namespace's device: admitted, and then that VM's, as if it listed it.
        a.admitted(asking_in_limits(vm("vm-limits"), device))
        await attached_to(api, device, a.namespace, "vm-limits")
        message = a.refused(vm("vm-after-limits", device))
        assert f"PCIDevice {device} is already used by VirtualMachine {a.namespace}/vm-limits" in message
        # Listed and asked for: two of a resource that has one.
        assert f"passthrough.io/{device} is listed 2 times" in a.refused(asking_in_limits(vm("vm-both", device), device))
    finally:
        cleanup(a, "vm/vm-limits")


async def test_a_vmi_with_a_hand_written_owner_reference_is_another_user_of_the_vms_device(api, setup):
    a, device = setup.a, setup.d[8]
    try:
        a.admitted(vm("vm-owner", device))
        await attached_to(api, device, a.namespace, "vm-owner")
        owner = get(a, "vm", "vm-owner")
        used = f"PCIDevice {device} is already used by VirtualMachine {a.namespace}/vm-owner"
        # Another name than its VM's: KubeVirt never makes such a VMI.
        message = a.refused(vmi("vmi-borrower", device, owner=owner))
        assert denied("virtualmachineinstances", f"VirtualMachineInstance {a.namespace}/vmi-borrower: {used}") in message
        # The VM's name and a uid it does not have (an earlier VM of that name's).
        earlier = {**owner, "metadata": {**owner["metadata"], "uid": "00000000-0000-4000-8000-000000000000"}}
        assert used in a.refused(vmi("vm-owner", device, owner=earlier))
        # The one KubeVirt makes: the VM's name, the VM's uid.
        a.admitted(vmi("vm-owner", device, owner=owner))
    finally:
        cleanup(a, "vmi/vm-owner", "vm/vm-owner")


async def test_a_pcidevice_the_operator_did_not_make_gives_a_namespace_nothing(api, cluster, setup):
    # Written by someone the API lets write PCIDevices (here the cluster admin), under the name
    # a node's device will get: no NodePCIDevice has it yet, so the operator leaves it alone.
    b, name = setup.b, "pci-" + os.urandom(20).hex()
    forged = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PCIDevice", "metadata": {"name": name, "namespace": b.namespace}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(forged))
    status = {**forged, "status": {"nodeName": setup.node2.name, "resourceName": f"passthrough.io/{name}", "conditions": [
        {"type": "Ready", "status": "True", "reason": "Ready", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
    await Custom(api, "pcidevices", namespaced=True).apply(status, "forger", status=True)
    try:
        handed = (f"PCIDevice {name} in namespace {b.namespace} is not one the passthrough operator handed to "
                  f"{b.namespace}, so it gives the namespace no device")  # fmt: skip
        assert denied("virtualmachines", f"VirtualMachine {b.namespace}/vm-forged: {handed}") in b.refused(vm("vm-forged", name))
        assert denied("pods", f"Pod {b.namespace}/pod-forged: {handed}") in b.refused(pod("pod-forged", name))
    finally:
        cluster.kubectl("delete", "pcidevice", name, "-n", b.namespace, "--ignore-not-found", check=False)


# -- scope: nothing else depends on the operator ----------------------------------------------------


async def test_objects_without_passthrough_devices_are_never_sent_to_the_webhook(api, setup):
    a = setup.a
    calls, excluded = await webhook_counts(api)
    try:
        a.admitted(vm("vm-plain"))
        a.admitted(vm("vm-pool", "nvidia.com/GA102GL_A10"))
        a.admitted(vmi("vmi-plain"))
        a.admitted(pod("pod-plain"))
        a.admitted(pod("pod-pool", "nvidia.com/GA102GL_A10"))
        after, excluded_after = await webhook_counts(api)
        assert {h: after[h] - calls[h] for h in HOOK.values()} == {h: 0 for h in HOOK.values()}
        # The API server's own word that the matchConditions kept them: 2 VMs, 1 VMI, 2 pods.
        assert [excluded_after[HOOK[k]] - excluded[HOOK[k]] for k in ("virtualmachines", "virtualmachineinstances", "pods")] == [2, 1, 2]
        # And one that is sent is counted, so the counters do see the webhook.
        a.refused(pod("pod-sent", "pci-does-not-exist"))
        assert (await webhook_counts(api))[0][HOOK["pods"]] == after[HOOK["pods"]] + 1
    finally:
        cleanup(a, "vm/vm-plain", "vm/vm-pool", "vmi/vmi-plain", "pod/pod-plain", "pod/pod-pool")


async def test_with_the_operator_stopped_unrelated_objects_are_admitted_and_device_users_refused(setup, operator):
    a = setup.a
    operator.stop()
    try:
        a.admitted(pod("pod-while-down"))
        a.admitted(vm("vm-while-down"))
        message = a.refused(pod("pod-device-while-down", setup.d[2]))
        assert f'failed calling webhook "{HOOK["pods"]}"' in message  # failurePolicy Fail: never let through
        assert "failed calling webhook" in a.refused(vm("vm-device-while-down", setup.d[2]))
    finally:
        cleanup(a, "pod/pod-while-down", "vm/vm-while-down")
        operator.start()


# -- the chart's certificate, either way -----------------------------------------------------------


def render(helm, *flags: str) -> list[dict]:
    return chart.template(helm, "passthrough", "passthrough-system", *flags)


def the(objects: list[dict], kind: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def operator_pod(objects: list[dict]) -> tuple[dict, dict]:
    pod = the(objects, "Deployment")["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_chart_generates_a_serving_certificate_that_its_ca_bundle_trusts(helm):
    from cryptography import x509

    objects = render(helm)
    secret = the(objects, "Secret")
    assert (secret["metadata"]["name"], secret["type"]) == ("passthrough-webhook-tls", "kubernetes.io/tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    serving = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    serving.verify_directly_issued_by(ca)
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "passthrough-webhook.passthrough-system.svc" in names
    configuration = the(objects, "ValidatingWebhookConfiguration")
    assert {w["clientConfig"]["caBundle"] for w in configuration["webhooks"]} == {secret["data"]["ca.crt"]}
    # Each webhook calls its own handler (the path is the Kopf handler id), through the Service.
    assert {w["name"]: w["clientConfig"]["service"]["path"] for w in configuration["webhooks"]} == {
        HOOK["pods"]: f"/{webhook.POD}", HOOK["virtualmachines"]: f"/{webhook.VM}", HOOK["virtualmachineinstances"]: f"/{webhook.VMI}"}
    assert {w["failurePolicy"] for w in configuration["webhooks"]} == {"Fail"}
    assert {w["sideEffects"] for w in configuration["webhooks"]} == {"None"}
    service = the([o for o in objects if o["metadata"]["name"] == "passthrough-webhook"], "Service")  # not the metrics ones
    assert service["spec"]["ports"] == [{"name": "webhook", "port": 443, "targetPort": "webhook", "protocol": "TCP"}]
    assert {w["clientConfig"]["service"]["name"] for w in configuration["webhooks"]} == {service["metadata"]["name"]}
    # The operator serves it from the mounted Secret.
    pod, container = operator_pod(objects)
    assert {"--webhook-port=9443", "--webhook-cert-dir=/etc/passthrough/webhook"} <= set(container["command"])
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]
    assert container["volumeMounts"] == [{"name": "webhook-tls", "mountPath": "/etc/passthrough/webhook", "readOnly": True}]
    assert pod["volumes"] == [{"name": "webhook-tls", "secret": {"secretName": "passthrough-webhook-tls"}}]


def test_without_the_webhook_nothing_of_it_is_rendered(helm):
    objects = render(helm, "--set=webhook.enabled=false")
    assert not {"Secret", "ValidatingWebhookConfiguration"} & {o["kind"] for o in objects}
    assert not [o for o in objects if "webhook" in o["metadata"]["name"]]  # its Service (the metrics' stay)
    pod, container = operator_pod(objects)
    assert not [a for a in container["command"] if a.startswith("--webhook")] and "volumes" not in pod
