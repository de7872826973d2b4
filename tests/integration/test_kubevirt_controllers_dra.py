"""DRA mode through KubeVirt's own controllers: a VirtualMachine whose GPU or host device names a
ResourceClaim becomes virt-controller's launcher pod carrying that claim, the real scheduler
allocates it (the operator's allocation webhook confining it to the VM's namespace), the real
kubelet prepares it through the agent's DRA driver, and virt-launcher's own DRA reader
(`e2e/kubevirt_metadata/`) finds, in the files the driver wrote, the address the claim was given.

virt-api and virt-controller of v1.9.0 run as processes (e2e.virt); the operator runs `--dra`
with the chart's webhooks rendered for DRA mode, and the platform values have `dra.enabled`, so
the operator turns KubeVirt's HostDevicesWithDRA and GPUsWithDRA gates on. The launcher pod's
files are laid out from the CDI mounts the runtime was asked for, as a CDI runtime mounts them.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import kubevirt_metadata, support, virt
from passthrough.dra import cdi
from passthrough.dra.slice import DRIVER
from passthrough.kube.client import session_of
from passthrough.kube.custom import Custom
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node and the agent in DRA mode)
    AUDIO, GPU, agent, cdi_dir, claim, create_claim, delete_claim, gpu_host, published, read_claim,
)  # fmt: skip
from tests.integration.test_dra_tenancy import (  # noqa: F401  (fixtures: the operator with --dra and its webhooks)
    DEVICE, allocation_refused, denied, device_class, live_class, operator, serving, webhooks,
)  # fmt: skip
from tests.integration.test_kubevirt_controllers import (  # noqa: F401  (fixtures: KubeVirt's controllers, the node marked for VMs)
    compute_container, controllers, create, kubelet, launcher_pod,
)  # fmt: skip
from tests.integration.test_kubevirt_metadata import kubevirt  # noqa: F401  (fixture: virt-launcher's DRA reader, built)

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def configured(api, operator):
    """The platform values in DRA mode: the operator turns KubeVirt's DRA gates on."""
    configs = Custom(api, "passthroughconfigs")
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
            "spec": {"dra": {"enabled": True}}}  # fmt: skip
    await configs.apply(body, "admin")
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")

    async def gates_on():
        kv = await kubevirts.get("kubevirt", virt.NAMESPACE) or {}
        gates = (((kv.get("spec") or {}).get("configuration") or {}).get("developerConfiguration") or {}).get("featureGates") or []
        return {"HostDevicesWithDRA", "GPUsWithDRA"} <= set(gates)

    await support.wait_for(gates_on, 30, 0.2, what="KubeVirt's DRA gates turned on by the operator")
    yield configs
    await configs.delete("cluster")


@pytest.fixture
async def world(api, controllers, webhooks, configured, kubelet, agent):
    await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    return controllers


def dra_vm(name: str, claim_name: str, kind: str) -> dict:
    """A VirtualMachine that starts at once whose one `kind` ("gpus" or "hostDevices") is the
    request `gpu` of the ResourceClaim `claim_name`."""
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
        "spec": {"runStrategy": "Always", "template": {"spec": {
            "resourceClaims": [{"name": "passthrough", "resourceClaimName": claim_name}],
            "domain": {"devices": {kind: [{"name": "dev1", "claimName": "passthrough", "requestName": "gpu"}]},
                       "resources": {"requests": {"memory": "64Mi"}}},
            "terminationGracePeriodSeconds": 0,
        }}},
    }  # fmt: skip


def launcher_files(kubelet, container: dict, base: Path) -> Path:
    """The metadata files of the container's CDI devices laid out under `base` as the launcher
    sees them under /var/run/kubernetes.io/dra-device-attributes (a CDI runtime's mounts)."""
    for mount in cdi.resolve(cdi_dir(kubelet), container["cdi_devices"])["mounts"]:
        target = kubevirt_metadata.local_path(base, mount["containerPath"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mount["hostPath"], target)
    return base


async def _launcher_gone(core, namespace: str, vm_name: str) -> None:
    """The VM's launcher pod deleted and gone, so its claim can go: with no virt-handler to end
    the domain, the pod is deleted here, as the kubelet would see it end."""
    selector = f"kubevirt.io=virt-launcher,vm.kubevirt.io/name={vm_name}"
    for pod in (await core.list_namespaced_pod(namespace, label_selector=selector)).items:
        with contextlib.suppress(client.ApiException):
            await core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)

    async def gone():
        return not (await core.list_namespaced_pod(namespace, label_selector=selector)).items

    await support.wait_for(gone, 60, 0.2, what=f"the launcher pod of {namespace}/{vm_name} gone")


async def vmi_of(api, namespace: str, name: str) -> dict:
    vmis = Custom(api, "virtualmachineinstances", namespaced=True, group="kubevirt.io", version="v1")
    return await vmis.get(name, namespace)


@pytest.mark.parametrize("kind,alias", [("gpus", "dra-gpu-dev1"), ("hostDevices", "dra-hostdevice-dev1")])
async def test_a_vm_naming_a_claim_gets_a_launcher_pod_with_the_claim_and_kubevirt_reads_the_assigned_address(
    api, kubelet, agent, world, namespace, kubevirt, tmp_path, kind, alias
):
    core = client.CoreV1Api(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    own = f"passthrough-{namespace}"
    await support.assign(api, names[GPU], namespace)
    vm_name = f"dra-{kind.lower()}"
    try:
        await published(api, kubelet, agent, {DEVICE: namespace})
        await support.wait_for(lambda: live_class(api, own), 30, 0.2, what=f"DeviceClass {own}")
        await create_claim(api, namespace, claim("vm-gpu", own))
        result = create(world.cluster, namespace, dra_vm(vm_name, "vm-gpu", kind))
        assert result.returncode == 0, result.stderr

        pod = await launcher_pod(core, namespace, vm_name)
        assert [(c.name, c.resource_claim_name) for c in pod.spec.resource_claims or []] == [("passthrough", "vm-gpu")]
        [compute] = [c for c in pod.spec.containers if c.name == "compute"]
        assert [c.name for c in compute.resources.claims or []] == ["passthrough"]

        container = await compute_container(core, kubelet, pod, timeout=90)
        allocated = await read_claim(api, namespace, "vm-gpu")
        [given] = allocated["status"]["allocation"]["devices"]["results"]
        assert (given["driver"], given["pool"], given["device"]) == (DRIVER, kubelet.node_name, DEVICE)
        uid = allocated["metadata"]["uid"]
        assert sorted(container["cdi_devices"]) == sorted([f"passthrough.io/vfio={uid}-{DEVICE}", f"{DRIVER}/metadata={uid}_gpu"])

        # virt-launcher's own code, on the files the driver wrote and the VMI virt-controller made.
        base = launcher_files(kubelet, container, tmp_path / "launcher")
        found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, await vmi_of(api, namespace, vm_name))
        assert "error" not in found[kind], found[kind]
        assert {d["alias"]: d["address"] for d in found[kind]["hostDevices"]} == {alias: GPU}
        other = "hostDevices" if kind == "gpus" else "gpus"
        assert found[other]["hostDevices"] == []
    finally:
        world.cluster.kubectl("delete", "vm", vm_name, "-n", namespace, "--wait=false", check=False)
        await _launcher_gone(core, namespace, vm_name)
        await delete_claim(session_of(api), namespace, "vm-gpu")
        await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def test_another_namespaces_vm_claiming_the_device_gets_a_pod_that_never_has_it(
    api, kubelet, agent, world, operator, namespace, unique, device_class
):
    """Its claim uses a class matching every device of the driver: the scheduler picks the
    device of the VM's namespace's neighbour, the operator's webhook refuses that allocation,
    and the launcher pod stays unscheduled with no container."""
    core = client.CoreV1Api(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    other = await support.create_namespace(api, f"other-{unique}")
    await support.assign(api, names[GPU], namespace)
    try:
        await published(api, kubelet, agent, {DEVICE: namespace})
        before = await denied(operator)
        await create_claim(api, other, claim("stolen", device_class))
        result = create(world.cluster, other, dra_vm("not-yours", "stolen", "gpus"))
        assert result.returncode == 0, result.stderr
        pod = await launcher_pod(core, other, "not-yours")
        await allocation_refused(api, operator, other, "stolen", before)
        assert not (await core.read_namespaced_pod(pod.metadata.name, other)).spec.node_name
        assert not any(c["pod"] == pod.metadata.name for c in kubelet.created_containers())
    finally:
        world.cluster.kubectl("delete", "vm", "not-yours", "-n", other, "--wait=false", check=False)
        await _launcher_gone(core, other, "not-yours")
        await delete_claim(session_of(api), other, "stolen")
        world.cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
        await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})
