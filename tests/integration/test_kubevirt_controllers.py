"""VirtualMachines through KubeVirt's own virt-api and virt-controller (v1.9.0, `e2e/virt.py`).

A tenant creates a VirtualMachine; virt-api admits it (its webhooks, registered as
virt-operator registers them), virt-controller reads the KubeVirt CR this operator configures
and makes the virt-launcher pod; the pod goes through this project's webhook, the real
kube-scheduler and the real kubelet, and the agent's device plugin hands it the device. What
the kubelet gives the compute container is read from the stand-in runtime's record of
CreateContainer. virt-handler and virt-launcher do not run (no libvirt): the chain stops at
the launcher's compute container, created with its device; the node carries what
virt-handler would put on it (`virt.mark_node`).
"""

from __future__ import annotations

import json

import pytest
from kubernetes_asyncio import client

from e2e import build, support, virt
from e2e.support import device_names, wait_resources
from passthrough.kube.custom import Custom
from passthrough.pci.naming import exclusive_resource_name, resource_env_name
# The operator with its webhooks registered from the chart, the fixture GPU node and its agent, as there.
from tests.integration.test_admission import HOOK, operator, serving, webhook_counts, webhooks  # noqa: F401
from tests.integration.test_device_plugin import agent, gpu_host  # noqa: F401

pytestmark = pytest.mark.cluster
POOL = "nvidia.com/GA102GL_A10"
GPU_MODE = "passthrough.io/gpu-passthrough"
GROUPS = {"0000:3b:00.0": 20, "0000:3b:00.1": 20, "0000:af:00.0": 21, "0000:af:00.1": 21}


@pytest.fixture(scope="module")
def controllers(request, cluster, tmp_path_factory):
    """virt-api and virt-controller against the shared control plane, for this module only."""
    try:
        virt.ensure_binaries()
    except build.BuildError as exc:
        support.cannot_run(request, "kubevirt-controllers", str(exc))
    cluster.kubectl("create", "namespace", virt.NAMESPACE, check=False)
    kubevirt = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt", "namespace": virt.NAMESPACE}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({**kubevirt, "spec": {}}))
    with virt.KubeVirtControllers(cluster, tmp_path_factory.mktemp("kubevirt")) as started:
        yield started
    cluster.kubectl("delete", "kubevirt", "kubevirt", "-n", virt.NAMESPACE, "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def kubelet(cluster, module_kubelet_nodes, kube_scheduler):
    node = module_kubelet_nodes()
    virt.mark_node(cluster, node.node_name)
    return node


@pytest.fixture(scope="module")
async def configured(api, operator):
    """The platform values: KubeVirt's CR in `kubevirt` gets our gates and allow-list."""
    configs = Custom(api, "passthroughconfigs")
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": {}}
    await configs.apply(body, "admin")
    yield configs
    await configs.delete("cluster")


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


@pytest.fixture
async def world(api, cluster, controllers, webhooks, configured, kubelet, agent):
    await support.reported(api, kubelet.node_name, GROUPS)
    return cluster


def vm(name: str, host_devices=(), gpus=()) -> dict:
    """A VirtualMachine that starts at once, with no disks: only its devices matter here."""
    devices: dict = {}
    if host_devices:
        devices["hostDevices"] = [{"name": f"dev{i}", "deviceName": d} for i, d in enumerate(host_devices)]
    if gpus:
        devices["gpus"] = [{"name": f"gpu{i}", "deviceName": d} for i, d in enumerate(gpus)]
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
        "spec": {"runStrategy": "Always", "template": {"spec": {
            "domain": {"devices": devices, "resources": {"requests": {"memory": "64Mi"}}},
            "terminationGracePeriodSeconds": 0,
        }}},
    }  # fmt: skip


def create(cluster, namespace: str, obj: dict):
    return cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(obj), check=False)


async def launcher_pod(core, namespace: str, vm_name: str, timeout: float = 60) -> client.V1Pod:
    """The virt-launcher pod virt-controller made for the VM's instance."""

    async def find():
        pods = await core.list_namespaced_pod(namespace, label_selector=f"kubevirt.io=virt-launcher,vm.kubevirt.io/name={vm_name}")
        return pods.items[0] if pods.items else None

    return await support.wait_for(find, timeout, 0.2, what=f"virt-controller's launcher pod for {vm_name}")


async def compute_container(core, kubelet, pod: client.V1Pod, timeout: float = 60) -> dict:
    """The runtime's record of the launcher's compute container, once the kubelet created it."""
    name, namespace = pod.metadata.name, pod.metadata.namespace

    async def find():
        return next((c for c in kubelet.created_containers()
                     if c["pod"] == name and c["namespace"] == namespace and c["container"] == "compute"), None)  # fmt: skip

    try:
        return await support.wait_for(find, timeout, 0.2, what=f"the compute container of {name}")
    except AssertionError as exc:
        live = await core.read_namespaced_pod(name, namespace)
        labels = (await core.read_node(kubelet.node_name)).metadata.labels
        status = f"{live.status}\nselector {live.spec.node_selector} affinity {live.spec.affinity}\nnode labels {labels}"
        events = "\n".join(f"{e.reason}: {e.message}" for e in (await core.list_namespaced_event(namespace)).items)
        log = kubelet.kubelet_log.read_text()[-3000:]
        raise AssertionError(f"{exc}\npod status: {status}\nevents:\n{events}\nkubelet log:\n{log}") from None


async def test_a_vm_naming_its_namespaces_device_gets_a_launcher_pod_holding_exactly_that_device(
    api, core, world, kubelet, agent, namespace
):
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:af:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    await wait_resources(core, kubelet.node_name, {resource: "1"}, agent)

    before, _ = await webhook_counts(api)
    result = create(world, namespace, vm("with-device", host_devices=[resource]))
    assert result.returncode == 0, result.stderr
    pod = await launcher_pod(core, namespace, "with-device")
    # The pod virt-controller made went through this project's pod webhook (and the VM through its VM webhook).
    after, _ = await webhook_counts(api)
    assert after[HOOK["pods"]] > before[HOOK["pods"]] and after[HOOK["virtualmachines"]] > before[HOOK["virtualmachines"]]
    owner = pod.metadata.owner_references[0]
    assert (owner.kind, owner.name) == ("VirtualMachineInstance", "with-device")
    [compute] = [c for c in pod.spec.containers if c.name == "compute"]
    assert compute.resources.limits[resource] == "1"

    container = await compute_container(core, kubelet, pod)
    assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"
    assert {d["host_path"] for d in container["devices"]} >= {"/dev/vfio/vfio", "/dev/vfio/21"}
    assert "/dev/vfio/20" not in {d["host_path"] for d in container["devices"]}
    placed = await core.read_namespaced_pod(pod.metadata.name, namespace)
    assert placed.spec.node_name == kubelet.node_name

    world.kubectl("delete", "vm", "with-device", "-n", namespace, "--wait=false")
    await support.assign(api, gpu, "")


async def test_another_namespaces_vm_naming_the_device_is_refused_before_any_pod(api, core, world, kubelet, agent, namespace, unique):
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:3b:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    other = f"other-{unique}"
    world.kubectl("create", "namespace", other)
    try:
        result = create(world, other, vm("not-yours", host_devices=[resource]))
        assert result.returncode != 0
        assert f'admission webhook "{HOOK["virtualmachines"]}" denied the request' in result.stderr, result.stderr
        assert json.loads(world.kubectl("get", "vmi,pods", "-n", other, "-o", "json").stdout)["items"] == []
    finally:
        world.kubectl("delete", "namespace", other, "--wait=false")
        await support.assign(api, gpu, "")


async def test_a_name_the_values_do_not_permit_gets_no_pod_and_the_status_said_so_first(
    api, core, world, controllers, configured, kubelet, agent, namespace
):
    # The GPU pool is advertised, but the values' allow-list has another model only.
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    other = {"pciVendorSelector": "1AF4:1000", "resourceName": "example.com/virtio"}
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
            "spec": {"gpu": {"replaceDefaults": True, "permittedHostDevices": {"pciHostDevices": [other]}}}}  # fmt: skip
    await configured.apply(body, "admin")
    try:
        await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)

        async def said():
            status = ((await configured.get("cluster")) or {}).get("status") or {}
            return any(m.get("resourceName") == POOL for m in status.get("notPermitted") or [])

        await support.wait_for(said, 30, what=f"{POOL} reported as not permitted")
        result = create(world, namespace, vm("unpermitted", gpus=[POOL]))
        assert result.returncode == 0, result.stderr

        # virt-controller's decision, in its own words. v1.9.0 writes it nowhere a tenant reads: no
        # Event, no VMI condition (the VMI stays Pending); the PassthroughConfig status said it first.
        refusal = f"failed to render launch manifest: GPU {POOL} is not permitted in permittedHostDevices configuration"

        async def refused():
            lines = controllers.output("virt-controller").splitlines()
            return any(refusal in line and f"{namespace}/unpermitted" in line for line in lines)

        await support.wait_for(refused, 60, 0.2, what="virt-controller's refusal to render the launcher pod")
        vmis = Custom(api, "virtualmachineinstances", namespaced=True, group="kubevirt.io", version="v1")
        assert (await vmis.get("unpermitted", namespace))["status"]["phase"] == "Pending"
        pods = await core.list_namespaced_pod(namespace, label_selector="kubevirt.io=virt-launcher")
        assert pods.items == []
        world.kubectl("delete", "vm", "unpermitted", "-n", namespace, "--wait=false")
    finally:
        await configured.apply({**body, "spec": {}}, "admin")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})


async def test_a_gate_the_cr_disables_is_reported_and_never_written_past_kubevirts_validator(api, world, configured):
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    disabled = {"spec": {"configuration": {"developerConfiguration": {"disabledFeatureGates": ["Snapshot"]}}}}
    world.kubectl("patch", "kubevirt", "kubevirt", "-n", virt.NAMESPACE, "--type=merge", "-p", json.dumps(disabled))
    try:
        # KubeVirt's own update validator is live: a CR naming the gate in both lists is refused.
        add = [{"op": "add", "path": "/spec/configuration/developerConfiguration/featureGates/-", "value": "Snapshot"}]
        both = world.kubectl("patch", "kubevirt", "kubevirt", "-n", virt.NAMESPACE, "--type=json", "-p", json.dumps(add), check=False)
        assert both.returncode != 0 and 'exists on both "FeatureGates" and "DisabledFeatureGates"' in both.stderr, both.stderr

        body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                "spec": {"kubevirt": {"extraFeatureGates": ["Snapshot", "VMExport"]}}}  # fmt: skip
        await configured.apply(body, "admin")

        async def reported():
            status = ((await configured.get("cluster")) or {}).get("status") or {}
            warned = any("Snapshot" in w and "disables it" in w for w in status.get("warnings") or [])
            return status if warned and "VMExport" in (status.get("featureGates") or []) else None

        status = await support.wait_for(reported, 30, what="the disabled gate reported in the PassthroughConfig status")
        assert "Snapshot" not in status["featureGates"]
        applied = next(c for c in status["conditions"] if c["type"] == "Applied")
        assert applied["status"] == "True", applied
        kv = await kubevirts.get("kubevirt", virt.NAMESPACE)
        gates = kv["spec"]["configuration"]["developerConfiguration"]["featureGates"]
        assert "VMExport" in gates and "Snapshot" not in gates
    finally:
        await configured.apply({"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig",
                                "metadata": {"name": "cluster"}, "spec": {}}, "admin")  # fmt: skip
        world.kubectl("patch", "kubevirt", "kubevirt", "-n", virt.NAMESPACE, "--type=json", "-p",
                      json.dumps([{"op": "remove", "path": "/spec/configuration/developerConfiguration/disabledFeatureGates"}]),
                      check=False)  # fmt: skip


async def test_a_gpu_pool_vm_gets_one_gpu_never_its_audio_function(api, core, world, kubelet, agent, namespace):
    """Each GPU shares its IOMMU group with an audio function; KubeVirt takes the addresses in
    PCI_RESOURCE_<pool> by position, so only the GPU's may be there."""
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    try:
        await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
        result = create(world, namespace, vm("pool-user", gpus=[POOL]))
        assert result.returncode == 0, result.stderr
        pod = await launcher_pod(core, namespace, "pool-user")
        container = await compute_container(core, kubelet, pod)
        [address] = container["envs"][resource_env_name(POOL)].split(",")
        assert address in ("0000:3b:00.0", "0000:af:00.0")
        assert {d["host_path"] for d in container["devices"]} >= {"/dev/vfio/vfio", f"/dev/vfio/{GROUPS[address]}"}
        world.kubectl("delete", "vm", "pool-user", "-n", namespace, "--wait=false")
    finally:
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})


async def test_two_vms_for_one_device_one_runs_and_the_other_is_told_which_holds_it(api, core, world, kubelet, agent, namespace):
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:af:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    await wait_resources(core, kubelet.node_name, {resource: "1"}, agent)
    first, second = (create(world, namespace, vm(name, host_devices=[resource])) for name in ("first", "second"))
    assert first.returncode == 0, first.stderr
    # The second is refused before virt-controller makes anything, naming the VM that holds the device.
    assert second.returncode != 0
    assert f"is already used by VirtualMachine {namespace}/first; remove it from that VM first" in second.stderr, second.stderr
    pod = await launcher_pod(core, namespace, "first")
    container = await compute_container(core, kubelet, pod)
    assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"
    pods = await core.list_namespaced_pod(namespace, label_selector="kubevirt.io=virt-launcher")
    assert [p.metadata.name for p in pods.items] == [pod.metadata.name]
    world.kubectl("delete", "vm", "first", "-n", namespace, "--wait=false")
    await support.assign(api, gpu, "")


async def test_the_values_vgpu_types_reach_the_kubevirt_cr_past_kubevirts_validator_and_leave_with_them(api, controllers, configured):
    """gpu.mediatedDevicesConfiguration is written to the live CR as Cozystack's chart writes it;
    every write meets virt-operator's own update admitter, and clearing the values removes it."""
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    types = {"mediatedDeviceTypes": ["nvidia-222"], "nodeMediatedDeviceTypes": [
        {"nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}, "mediatedDeviceTypes": ["nvidia-222", "nvidia-223"]}]}  # fmt: skip
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
            "spec": {"gpu": {"mediatedDevicesConfiguration": types}}}  # fmt: skip
    validator = controllers.cluster.kubectl("get", "validatingwebhookconfiguration", "virt-operator-validator", "-o", "name", check=False)
    assert validator.returncode == 0, validator.stderr  # KubeVirt's update admitter is registered: the writes below meet it

    def carried(want):
        async def check():
            configuration = ((await kubevirts.get("kubevirt", virt.NAMESPACE)) or {}).get("spec", {}).get("configuration", {})
            return configuration.get("mediatedDevicesConfiguration") == want

        return check

    try:
        await configured.apply(body, "admin")
        await support.wait_for(carried(types), 30, 0.2, what="mediatedDevicesConfiguration on the KubeVirt CR")
        status = (await configured.get("cluster"))["status"]
        applied = next(c for c in status["conditions"] if c["type"] == "Applied")
        assert applied["status"] == "True", applied
    finally:
        await configured.apply({**body, "spec": {}}, "admin")
    await support.wait_for(carried(None), 30, 0.2, what="mediatedDevicesConfiguration gone from the KubeVirt CR")


def set_run_strategy(cluster, namespace: str, name: str, strategy: str) -> None:
    cluster.kubectl("patch", "vm", name, "-n", namespace, "--type=merge", "-p", json.dumps({"spec": {"runStrategy": strategy}}))


async def stopped(api, core, cluster, namespace: str, name: str) -> None:
    """The VM halted and its instance gone. With no virt-handler here, what it does when a domain
    ends is done in its place: the launcher pod deleted (the kubelet sees it end) and the
    deleted VMI let go of (virt-handler's finalizer)."""
    selector = f"kubevirt.io=virt-launcher,vm.kubevirt.io/name={name}"
    vmis = Custom(api, "virtualmachineinstances", namespaced=True, group="kubevirt.io", version="v1")

    async def gone():
        for pod in (await core.list_namespaced_pod(namespace, label_selector=selector)).items:
            if pod.metadata.deletion_timestamp is None:
                await core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
        pods = (await core.list_namespaced_pod(namespace, label_selector=selector)).items
        vmi = await vmis.get(name, namespace)
        if not pods and vmi is not None and vmi["metadata"].get("deletionTimestamp"):
            cluster.kubectl("patch", "vmi", name, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False)
        return not pods and vmi is None

    await support.wait_for(gone, 60, 0.5, what=f"VM {namespace}/{name} stopped: no launcher pod, no VMI")


async def start_refused(api, namespace: str, name: str) -> str:
    """The message of the VM's Failure condition once virt-controller's start was refused."""
    vms = Custom(api, "virtualmachines", namespaced=True, group="kubevirt.io", version="v1")

    async def refused():
        status = ((await vms.get(name, namespace)) or {}).get("status") or {}
        return next((c["message"] for c in status.get("conditions") or []
                     if c["type"] == "Failure" and c["status"] == "True" and c.get("reason") == "FailedCreate"), None)  # fmt: skip

    return await support.wait_for(refused, 60, 0.2, what=f"VM {namespace}/{name}'s start refused")


@pytest.mark.parametrize("move", ["reassigned", "unassigned"])
async def test_after_the_device_moves_the_vms_next_start_never_gets_it(api, core, world, kubelet, agent, namespace, unique, move):
    """A VM that had the device is stopped; the device is reassigned to another namespace (or
    unassigned); the VM started again gets no launcher pod, and says why; once it no longer
    lists the device, a VM of the new namespace gets it."""
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:af:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    pci_devices = Custom(api, "pcidevices", namespaced=True)
    await support.wait_for(lambda: pci_devices.get(gpu, namespace), 30, 0.2, what=f"PCIDevice {gpu} in {namespace}")
    await wait_resources(core, kubelet.node_name, {resource: "1"}, agent)
    other = await support.create_namespace(api, f"next-{unique}")
    selector = "kubevirt.io=virt-launcher"
    try:
        made = create(world, namespace, vm("moving", host_devices=[resource]))
        assert made.returncode == 0, made.stderr
        first = await launcher_pod(core, namespace, "moving")
        container = await compute_container(core, kubelet, first)
        assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"
        set_run_strategy(world, namespace, "moving", "Halted")
        await stopped(api, core, world, namespace, "moving")

        await support.assign(api, gpu, other if move == "reassigned" else "")
        set_run_strategy(world, namespace, "moving", "Always")
        message = await start_refused(api, namespace, "moving")
        assert f"is being removed from namespace {namespace} (unassigned or reassigned); use another device of the namespace" in message
        assert (await core.list_namespaced_pod(namespace, label_selector=selector)).items == []
        computes = [c for c in kubelet.created_containers() if c["namespace"] == namespace and c["container"] == "compute"]
        assert [c["pod"] for c in computes] == [first.metadata.name]
        if move == "unassigned":
            return

        # The old namespace's VM lets go of the device (deleted); the new namespace's VM gets it.
        world.kubectl("delete", "vm", "moving", "-n", namespace)
        made = create(world, other, vm("arrived", host_devices=[resource]))
        assert made.returncode == 0, made.stderr
        pod = await launcher_pod(core, other, "arrived", timeout=90)
        container = await compute_container(core, kubelet, pod, timeout=90)
        assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"
        set_run_strategy(world, other, "arrived", "Halted")
        await stopped(api, core, world, other, "arrived")  # its pod gone, the device is free for later tests
    finally:
        for where, name in ((namespace, "moving"), (other, "arrived")):
            world.kubectl("delete", "vm", name, "-n", where, "--wait=false", "--ignore-not-found", check=False)
        world.kubectl("delete", "namespace", other, "--wait=false", check=False)
        await support.assign(api, gpu, "")
