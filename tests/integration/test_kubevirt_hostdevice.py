"""virt-launcher's own host-device code on the environment the real kubelet gave a launcher.

A VirtualMachine goes through KubeVirt's virt-api and virt-controller (v1.9.0, `e2e/virt.py`),
this project's webhook, the real scheduler and kubelet, and the agent's device plugin, whose
`Allocate` puts the device's address in `PCI_RESOURCE_<NAME>`. The compute container's
environment, as the kubelet handed it to the runtime, and the VMI virt-api admitted are then given
to virt-launcher's address pools and its generic and GPU host-device builders
(`e2e/kubevirt_hostdevice/`, KubeVirt's code unmodified): the `<hostdev>` elements they make are
what virt-launcher would give libvirt, and their source addresses must be the allocated devices'.
libvirt and QEMU themselves do not run.
"""

from __future__ import annotations

import pytest

from e2e import gobuild, kubevirt_hostdevice, support
from e2e.support import device_names, wait_resources
from passthrough.kube.custom import Custom
from passthrough.pci.naming import exclusive_resource_name, resource_env_name
from tests.integration.test_admission import operator, serving, webhooks  # noqa: F401  (fixtures: the operator and its webhooks)
from tests.integration.test_device_plugin import agent, gpu_host  # noqa: F401  (fixtures: the fixture GPU node and its agent)
from tests.integration.test_kubevirt_controllers import (  # noqa: F401  (fixtures: KubeVirt's controllers, the node marked for VMs)
    GPU_MODE, GROUPS, POOL, compute_container, configured, controllers, core, create, kubelet, launcher_pod, set_run_strategy,
    stopped, vm, world,
)  # fmt: skip

AUDIO = {"0000:3b:00.1", "0000:af:00.1"}  # the GPUs' sibling functions, each in its GPU's IOMMU group


@pytest.fixture(scope="module")
def hostdevice(request):
    """KubeVirt's host-device code, built; a loud skip where it cannot be (a failure under CI)."""
    try:
        return kubevirt_hostdevice.ensure_binary()
    except gobuild.BuildError as exc:
        support.cannot_run(request, "KubeVirt-hostdevice", str(exc), once_key="kubevirt-hostdevice")


async def launched(api, core, kubelet, namespace: str, name: str) -> tuple[dict, dict]:
    """The compute container the kubelet created for VM `name`'s launcher, and the VMI it runs."""
    pod = await launcher_pod(core, namespace, name)
    container = await compute_container(core, kubelet, pod)
    vmis = Custom(api, "virtualmachineinstances", namespaced=True, group="kubevirt.io", version="v1")
    return container, await vmis.get(name, namespace)


def pci_hostdev(address: str) -> str:
    """The <source> address of a PCI <hostdev>, as KubeVirt marshals it for libvirt."""
    domain, bus, slot_function = address.split(":")
    slot, function = slot_function.split(".")
    return f'<address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}" function="0x{function}">'


@pytest.mark.cluster
async def test_a_vms_host_device_becomes_a_hostdev_of_the_allocated_address(
    api, core, world, kubelet, agent, hostdevice, namespace
):
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:af:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    try:
        await wait_resources(core, kubelet.node_name, {resource: "1"}, agent)
        made = create(world, namespace, vm("with-hostdev", host_devices=[resource]))
        assert made.returncode == 0, made.stderr
        container, vmi = await launched(api, core, kubelet, namespace, "with-hostdev")
        assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"

        domain = kubevirt_hostdevice.host_devices(hostdevice, container["envs"], vmi)
        assert domain["hostDevices"].keys() == {"devices"} and domain["gpus"] == {"devices": []}, domain
        [hostdev] = domain["hostDevices"]["devices"]
        assert (hostdev["alias"], hostdev["type"], hostdev["managed"], hostdev["address"]) == (
            "ua-hostdevice-dev0", "pci", "no", "0000:af:00.0")  # fmt: skip
        assert pci_hostdev("0000:af:00.0") in hostdev["xml"], hostdev["xml"]
        set_run_strategy(world, namespace, "with-hostdev", "Halted")
        await stopped(api, core, world, namespace, "with-hostdev")  # its pod gone, the device is free for the next test
    finally:
        world.kubectl("delete", "vm", "with-hostdev", "-n", namespace, "--wait=false", "--ignore-not-found", check=False)
        await support.assign(api, gpu, "")


@pytest.mark.cluster
async def test_a_two_gpu_vm_gets_each_gpu_in_the_variables_order_never_an_audio_function(
    api, core, world, kubelet, agent, hostdevice, namespace
):
    """Both pool GPUs share their IOMMU group with an audio function. KubeVirt hands the addresses
    in PCI_RESOURCE_<pool> to the VM's GPUs by position: the variable must list the two GPUs,
    and only them, for each of the VM's GPUs to become one of them."""
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: "true"}}})
    try:
        await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
        made = create(world, namespace, vm("two-gpus", gpus=[POOL, POOL]))
        assert made.returncode == 0, made.stderr
        container, vmi = await launched(api, core, kubelet, namespace, "two-gpus")
        listed = container["envs"][resource_env_name(POOL)].split(",")
        assert sorted(listed) == ["0000:3b:00.0", "0000:af:00.0"], listed
        assert {d["host_path"] for d in container["devices"]} >= {"/dev/vfio/vfio", "/dev/vfio/20", "/dev/vfio/21"}

        domain = kubevirt_hostdevice.host_devices(hostdevice, container["envs"], vmi)
        assert domain["gpus"].keys() == {"devices"} and domain["hostDevices"] == {"devices": []}, domain
        gpus = domain["gpus"]["devices"]
        assert [(g["alias"], g["address"]) for g in gpus] == [("ua-gpu-gpu0", listed[0]), ("ua-gpu-gpu1", listed[1])]
        assert not {g["address"] for g in gpus} & AUDIO
        for g in gpus:
            assert pci_hostdev(g["address"]) in g["xml"], g["xml"]
        set_run_strategy(world, namespace, "two-gpus", "Halted")
        await stopped(api, core, world, namespace, "two-gpus")
    finally:
        world.kubectl("delete", "vm", "two-gpus", "-n", namespace, "--wait=false", "--ignore-not-found", check=False)
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {GPU_MODE: None}}})


def test_kubevirts_code_gives_a_gpu_whatever_the_variable_lists_first(hostdevice):
    """Why the agent's Allocate lists exactly the requested addresses: were a sibling function
    first in the variable, KubeVirt would give the VM's GPU the audio function; were the
    variable missing, the domain would not be made."""
    vmi = vm("one-gpu", gpus=[POOL])["spec"]["template"]
    env = {resource_env_name(POOL): "0000:af:00.1,0000:af:00.0"}
    [taken] = kubevirt_hostdevice.host_devices(hostdevice, env, vmi)["gpus"]["devices"]
    assert (taken["alias"], taken["address"]) == ("ua-gpu-gpu0", "0000:af:00.1")
    missing = kubevirt_hostdevice.host_devices(hostdevice, {}, vmi)["gpus"]
    assert missing["devices"] == [] and "do not match the number of devices" in missing["error"], missing
