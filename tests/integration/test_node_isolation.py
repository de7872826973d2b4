"""No device reaches another tenant through the node (the kubelet knows resource names, not
namespaces): pods are holders, a device is served only once handed out, the IOMMU group is the
unit, and a device another plugin serves is not ours.

One real kubelet (fake CRI runtime, private mount namespace), the real kube-scheduler, the
operator (it hands devices out) and the agent as its own process over a fixture GPU node with
its simulated kernel. Pods are placed by the scheduler and admitted by the kubelet for real.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import grpc
import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from e2e.support import created, wait_resources
from passthrough.api.labels import NODE_LABEL
from passthrough.deviceplugin.allocation import PluginDevice
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as dp
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as dp_grpc
from passthrough.deviceplugin.server import API_VERSION, DevicePlugin
from passthrough.kube.custom import Custom
from passthrough.pci.naming import exclusive_resource_name, resource_env_name
from tests.integration.test_operator_lifecycle import wait_condition

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
FIRST, SECOND = "0000:3b:00.0", "0000:af:00.0"  # the GPUs of IOMMU groups 20 and 21
SECOND_AUDIO = "0000:af:00.1"


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-host"))
    with FakeKernel(host):
        yield host


@pytest.fixture(scope="module")
def kubelet(module_kubelet_nodes, kube_scheduler):
    return module_kubelet_nodes(labels={"passthrough.io/gpu-passthrough": "true"})


@pytest.fixture(scope="module")
def agent(cluster, kubelet, gpu_host, tmp_path_factory, operator):
    proc = AgentProcess(cluster, tmp_path_factory.mktemp("agent") / "agent.log", kubelet.node_name, gpu_host, PCI_IDS,
                        kubelet=kubelet).start()  # fmt: skip
    yield proc
    code = proc.stop()
    assert code == 0 and "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


@pytest.fixture
async def names(api, kubelet, agent, core):
    found = await support.reported(api, kubelet.node_name, (FIRST, "0000:3b:00.1", SECOND, SECOND_AUDIO))
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    return found


@pytest.fixture
async def tenants(api):
    """Two namespaces of two tenants, deleted after the test (their pods with them)."""
    made = []

    async def make(name: str) -> str:
        made.append(await support.create_namespace(api, name))
        return name

    yield make
    for name in made:
        with contextlib.suppress(client.exceptions.ApiException):
            await client.CoreV1Api(api).delete_namespace(name)


async def ready(api, node: str, address: str) -> dict:
    items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]
    device = next(o for o in items if (o.get("status") or {}).get("attributes", {}).get("pciAddress") == address)
    return next(c for c in device["status"]["conditions"] if c["type"] == "Ready")


async def wait_ready(api, node: str, address: str, reason: str, agent, timeout: float = 30, says: str = "") -> dict:
    async def reached():
        cond = await ready(api, node, address)
        return cond if cond["reason"] == reason and says in cond["message"] else None

    return await support.wait_for(reached, timeout, 0.2, what=lambda: f"{address} Ready/{reason} ({says}); log:\n{agent.output()[-3000:]}")


async def handed_out(api, name: str, namespace: str) -> None:
    """Assign, and wait for the operator's hand-out (what the node acts on)."""
    await support.assign(api, name, namespace)

    async def done():
        status = (await Custom(api, "nodepcidevices").get(name)).get("status") or {}
        assigned = next((c for c in status.get("conditions", []) if c["type"] == "Assigned"), {})
        return assigned.get("status") == "True" and (status.get("assignedNamespaceRef") or {}).get("name") == namespace

    await support.wait_for(done, 30, 0.2, what=f"{name} handed out to {namespace}")


async def run_pod(api, core, kubelet, namespace: str, name: str, resource: str) -> str:
    """A launcher-like pod, placed and admitted for real; returns the address it received. Pod
    names are unique across the module: the runtime's records are found by pod name."""
    await support.create_pod(api, namespace, support.launcher_pod(name, resource))
    container = await created(core, namespace, kubelet, name)
    return container["envs"][resource_env_name(resource)]


async def test_an_unassigned_gpu_its_pod_still_holds_goes_back_to_the_pool_only_when_that_pod_ends(
    api, core, kubelet, agent, names, tenants
):
    team_a, team_b = await tenants("iso-a"), await tenants("iso-b")
    resource = exclusive_resource_name(names[SECOND])
    await handed_out(api, names[SECOND], team_a)
    await wait_resources(core, kubelet.node_name, {POOL: "1", resource: "1"}, agent)
    assert await run_pod(api, core, kubelet, team_a, "vm-a1", resource) == SECOND
    await support.assign(api, names[SECOND], "")
    # It says who holds it, and is in no pool meanwhile: a pool pod of team-b gets the other GPU.
    cond = await wait_ready(api, kubelet.node_name, SECOND, "HeldByPod", agent, says=f"pod {team_a}/vm-a1")
    assert cond["status"] == "False"
    await wait_resources(core, kubelet.node_name, {POOL: "1", resource: "0"}, agent)
    assert await run_pod(api, core, kubelet, team_b, "pool-b1", POOL) == FIRST
    await support.create_pod(api, team_b, support.launcher_pod("pool-b1x", POOL))  # waits: no GPU is free
    await support.delete_pod(api, team_a, "vm-a1")
    # Back in the pool once its pod ended, and only then: the waiting pool pod gets it now.
    assert (await created(core, team_b, kubelet, "pool-b1x"))["envs"][resource_env_name(POOL)] == SECOND
    await wait_ready(api, kubelet.node_name, SECOND, "Ready", agent)
    for pod in ("pool-b1", "pool-b1x"):
        await support.delete_pod(api, team_b, pod)


async def test_a_pool_gpu_assigned_while_a_pool_pod_holds_it_waits_for_that_pod(api, core, kubelet, agent, names, tenants):
    team_a, team_b = await tenants("iso-c"), await tenants("iso-d")
    held = await run_pod(api, core, kubelet, team_b, "pool-user2", POOL)
    name = names[held]
    resource = exclusive_resource_name(name)
    await handed_out(api, name, team_a)
    await wait_ready(api, kubelet.node_name, held, "HeldByPod", agent, says=f"pod {team_b}/pool-user2")
    await wait_resources(core, kubelet.node_name, {resource: "0", POOL: "1"}, agent)  # under neither name
    await support.create_pod(api, team_a, support.launcher_pod("vm-a2", resource))
    await support.delete_pod(api, team_b, "pool-user2")
    assert (await created(core, team_a, kubelet, "vm-a2"))["envs"][resource_env_name(resource)] == held
    await support.delete_pod(api, team_a, "vm-a2")
    await support.assign(api, name, "")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)


async def holders_of(api, name: str, namespace: str | None = None) -> list[dict]:
    """status.holders of the NodePCIDevice, or of the namespace's PCIDevice."""
    obj = await (Custom(api, "pcidevices", namespaced=True).get(name, namespace) if namespace
                 else Custom(api, "nodepcidevices").get(name))  # fmt: skip
    return ((obj or {}).get("status") or {}).get("holders") or []


async def wait_holders(api, name: str, wanted: list[dict], agent, namespace: str | None = None, timeout: float = 30) -> None:
    async def shown():
        return await holders_of(api, name, namespace) == wanted

    where = f"PCIDevice {namespace}/{name}" if namespace else f"NodePCIDevice {name}"
    await support.wait_for(shown, timeout, 0.1, what=lambda: f"{where} holders {wanted}; log:\n{agent.output()[-3000:]}")


async def test_the_node_pci_device_says_which_pod_holds_it_and_the_new_namespaces_only_its_own(api, core, kubelet, agent, names,
                                                                                                tenants):  # fmt: skip
    team_a, team_b = await tenants("iso-j"), await tenants("iso-k")
    held = await run_pod(api, core, kubelet, team_b, "pool-user5", POOL)
    name = names[held]
    resource = exclusive_resource_name(name)
    by_pool_pod = [{"namespace": team_b, "pod": "pool-user5", "resource": POOL}]
    await wait_holders(api, name, by_pool_pod, agent)  # a pool GPU's holder is said too
    await handed_out(api, name, team_a)
    # The NodePCIDevice names the pod of team-b that holds it; team-a's PCIDevice says a pod of another
    # namespace does, and names none (another namespace's pods are none of team-a's business).
    await wait_ready(api, kubelet.node_name, held, "HeldByPod", agent, says=f"pod {team_b}/pool-user5")

    async def told_without_names():
        device = await Custom(api, "pcidevices", namespaced=True).get(name, team_a)
        ready_ = next((c for c in ((device or {}).get("status") or {}).get("conditions") or [] if c["type"] == "Ready"), {})
        return device if ready_.get("reason") == "HeldByPod" and "a pod of another namespace" in ready_["message"] else None

    device = await support.wait_for(told_without_names, 30, 0.1, what="team-a's PCIDevice HeldByPod")
    assert team_b not in json.dumps(device["status"]) and (device["status"].get("holders") or []) == [], device["status"]
    await support.delete_pod(api, team_b, "pool-user5")
    await wait_holders(api, name, [], agent, namespace=team_a)
    await wait_holders(api, name, [], agent)
    # team-a's own pod, under the exclusive resource.
    assert await run_pod(api, core, kubelet, team_a, "vm-a5", resource) == held
    mine = [{"namespace": team_a, "pod": "vm-a5", "resource": resource}]
    await wait_holders(api, name, mine, agent)
    await wait_holders(api, name, mine, agent, namespace=team_a)
    # Attached says so on both objects: a plain pod, no VirtualMachine.
    said = f"Held by pod {team_a}/vm-a5 (no VirtualMachine lists it)."
    await wait_condition(Custom(api, "nodepcidevices"), name, "Attached", "HeldByPod", contains=said)
    await wait_condition(Custom(api, "pcidevices", namespaced=True), name, "Attached", "HeldByPod", team_a, contains=said)
    await support.delete_pod(api, team_a, "vm-a5")
    await support.assign(api, name, "")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)


async def test_a_pending_pod_of_the_namespace_a_device_left_never_gets_it(api, core, kubelet, agent, names, tenants):
    team_a, team_b = await tenants("iso-e"), await tenants("iso-f")
    name = names[SECOND]
    resource = exclusive_resource_name(name)
    await handed_out(api, name, team_a)
    assert await run_pod(api, core, kubelet, team_a, "vm-a3", resource) == SECOND
    await support.create_pod(api, team_a, support.launcher_pod("waiting-a3", resource))  # Insufficient: pending
    await handed_out(api, name, team_b)  # reassigned while team-a's pod runs
    await wait_ready(api, kubelet.node_name, SECOND, "HeldByPod", agent, says=f"pod {team_a}/vm-a3")
    # Withdrawn, and the scheduler knows it: the pending pod is placed only once it is served again.
    await wait_resources(core, kubelet.node_name, {resource: "0"}, agent)
    await support.delete_pod(api, team_a, "vm-a3")

    async def refused():  # the scheduler places it once the device is served again; the kubelet fails it
        pod = await core.read_namespaced_pod("waiting-a3", team_a)
        return pod if pod.status.phase == "Failed" else None

    pod = await support.wait_for(refused, 60, 0.2, what=lambda: f"team-a's pending pod refused; log:\n{agent.output()[-3000:]}")
    assert f"belongs to namespace {team_b} now" in (pod.status.message or ""), pod.status
    assert not any(c["envs"].get("MARK") == "waiting-a3" for c in kubelet.created_containers())
    # team-b's own pod gets it.
    assert await run_pod(api, core, kubelet, team_b, "vm-b3", resource) == SECOND
    await support.delete_pod(api, team_b, "vm-b3")
    await support.assign(api, name, "")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)


async def test_no_member_of_a_group_with_an_assigned_member_is_pooled(api, core, kubelet, agent, names, tenants):
    team_a = await tenants("iso-g")
    audio = names[SECOND_AUDIO]
    await handed_out(api, audio, team_a)  # the second GPU's audio function: /dev/vfio/21 is team-a's now
    await wait_resources(core, kubelet.node_name, {POOL: "1", exclusive_resource_name(audio): "1"}, agent)
    team_b = await tenants("iso-h")
    assert await run_pod(api, core, kubelet, team_b, "pool-b4", POOL) == FIRST  # never SECOND: its group is team-a's
    await support.delete_pod(api, team_b, "pool-b4")
    await support.assign(api, audio, "")
    await wait_resources(core, kubelet.node_name, {POOL: "2", exclusive_resource_name(audio): "0"}, agent)


async def test_a_device_is_neither_bound_nor_served_before_it_is_handed_out(api, core, kubelet, agent, names, tenants,
                                                                            gpu_host):  # fmt: skip
    # Out of GPU mode: an assigned GPU is bound only for its namespace.
    await core.patch_node(kubelet.node_name, {"metadata": {"labels": {"passthrough.io/gpu-passthrough": None}}})
    try:
        await support.wait_for(lambda: _driver_is(gpu_host, SECOND, "nvidia"), 60, what=f"{SECOND} given back")
        team_a = await tenants("iso-i")
        await support.assign(api, names[SECOND], "iso-not-yet")  # a namespace that does not exist yet
        await handed_out(api, names[FIRST], team_a)  # handed out after it: the agent has looked at both since
        await wait_resources(core, kubelet.node_name, {exclusive_resource_name(names[FIRST]): "1"}, agent)
        assert gpu_host.driver(FIRST) == "vfio-pci" and gpu_host.driver(SECOND) == "nvidia"
        assert (await support.resources(core, kubelet.node_name)).get(exclusive_resource_name(names[SECOND]), "0") == "0"
        await tenants("iso-not-yet")  # now it exists: handed out, bound, served
        await wait_resources(core, kubelet.node_name, {exclusive_resource_name(names[SECOND]): "1"}, agent)
        assert gpu_host.driver(SECOND) == "vfio-pci"
    finally:
        for address in (FIRST, SECOND):
            await support.assign(api, names[address], "")
        await core.patch_node(kubelet.node_name, {"metadata": {"labels": {"passthrough.io/gpu-passthrough": "true"}}})
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent, timeout=60)


async def _driver_is(host, address: str, driver: str) -> bool:
    return host.driver(address) == driver


@contextlib.asynccontextmanager
async def other_plugin(kubelet, address: str, group: int, resource: str = "example.com/other-gpu"):
    """Another device plugin (as NVIDIA's sandbox plugin is) serving `address` as `resource`,
    registered with the kubelet; stopped after. Yields it: `update([])` makes it serve nothing,
    which the kubelet's GetAllocatableResources shows at once (the kubelet keeps a stopped
    plugin's devices, unhealthy, for minutes)."""
    other = DevicePlugin(resource, kubelet.device_plugin_dir, [PluginDevice(address, group)])
    other.endpoint = "other-vendor.sock"
    other.socket_path = kubelet.device_plugin_dir / other.endpoint
    await other.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{kubelet.kubelet_socket}") as channel:
            await dp_grpc.RegistrationStub(channel).Register(
                dp.RegisterRequest(version=API_VERSION, endpoint=other.endpoint, resource_name=other.resource_name))
        yield other
    finally:
        await other.stop()
        other.socket_path.unlink(missing_ok=True)


async def test_a_device_another_plugin_serves_is_neither_bound_nor_served_by_the_agent(api, core, kubelet, agent, names):
    # Another device plugin (as NVIDIA's sandbox plugin does) serves the first GPU under its own name.
    # The kubelet keeps a stopped plugin's devices (unhealthy) for minutes: this test comes last.
    async with other_plugin(kubelet, FIRST, 20):
        # The kubelet has it (its node status says so), and the agent, woken by that change, steps aside.
        await wait_resources(core, kubelet.node_name, {"example.com/other-gpu": "1"}, agent, field="capacity", timeout=60)
        cond = await wait_ready(api, kubelet.node_name, FIRST, "ServedByOtherPlugin", agent, timeout=60)
        assert "example.com/other-gpu" in cond["message"] and cond["status"] == "False"
        await wait_resources(core, kubelet.node_name, {POOL: "1", "example.com/other-gpu": "1"}, agent)
