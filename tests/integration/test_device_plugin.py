"""A VM's pod gets its device: the agent binds to vfio-pci and serves the real kubelet.

One real kubelet (with the fake CRI runtime, in a private mount namespace) and the real
kube-scheduler; the agent runs as its own process over a fixture GPU node whose simulated
kernel (`e2e.fakekernel`) moves `driver` links and creates `/dev/vfio/<group>` as the bind
sequence is written. What the kubelet hands a container is read from the runtime's record of
CreateContainer.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.support import created, device_names, resources, wait_resources
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import Custom
from passthrough.pci.naming import exclusive_resource_name, resource_env_name

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
GPU_MODE = "passthrough.io/gpu-passthrough"
GPUS = ("0000:3b:00.0", "0000:af:00.0")
GROUPS = {"0000:3b:00.0": 20, "0000:3b:00.1": 20, "0000:af:00.0": 21, "0000:af:00.1": 21}


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory):
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-host"))
    with FakeKernel(host) as kernel:
        yield host, kernel


@pytest.fixture(scope="module")
def kubelet(module_kubelet_nodes, kube_scheduler):
    return module_kubelet_nodes()


@pytest.fixture(scope="module")
def agent(cluster, kubelet, gpu_host, tmp_path_factory, operator):
    # The operator hands devices out (Assigned=True): the agent serves an assigned device only then.
    host, _ = gpu_host
    proc = AgentProcess(cluster, tmp_path_factory.mktemp("agent") / "agent.log", kubelet.node_name, host, PCI_IDS,
                        kubelet=kubelet).start()  # fmt: skip
    yield proc
    code = proc.stop()
    output = proc.output()
    assert code == 0 and "Traceback" not in output, output[-5000:]
    # Ours removed on exit; the kubelet's own socket stays.
    assert sorted(p.name for p in kubelet.device_plugin_dir.glob("passthrough-*")) == []


@pytest.fixture
def core(api):
    return client.CoreV1Api(api)


async def label(core, node: str, value: str | None) -> None:
    await core.patch_node(node, {"metadata": {"labels": {GPU_MODE: value}}})


async def test_a_node_in_gpu_mode_binds_its_gpus_and_advertises_the_pool(api, core, kubelet, agent, gpu_host):
    host, _ = gpu_host
    await support.reported(api, kubelet.node_name, GROUPS)
    # Not in GPU mode: nothing is bound, nothing is advertised.
    assert {a: host.driver(a) for a in GPUS} == {a: "nvidia" for a in GPUS}
    await label(core, kubelet.node_name, "true")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent, field="capacity")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    # The whole IOMMU group went to vfio-pci, audio functions included, and /dev/vfio has both groups.
    assert {a: host.driver(a) for a in GROUPS} == {a: "vfio-pci" for a in GROUPS}
    assert sorted(p.name for p in (host.root / "dev" / "vfio").iterdir()) == ["20", "21", "vfio"]


async def test_an_assigned_gpu_leaves_the_pool_and_a_pod_receives_its_address(api, core, kubelet, agent, namespace):
    names = await device_names(api, kubelet.node_name)
    gpu = names["0000:af:00.0"]
    resource = exclusive_resource_name(gpu)
    await support.assign(api, gpu, namespace)
    await wait_resources(core, kubelet.node_name, {resource: "1", POOL: "1"}, agent)

    # Placed by the real scheduler (no nodeName), admitted and allocated by the real kubelet.
    await support.create_pod(api, namespace, support.launcher_pod("vm-launcher", resource))
    container = await created(core, namespace, kubelet, "vm-launcher")
    assert container["envs"][resource_env_name(resource)] == "0000:af:00.0"
    assert resource_env_name(resource) == f"PCI_RESOURCE_PASSTHROUGH_IO_{gpu.upper()}"  # the hyphen is kept
    devices = {(d["container_path"], d["host_path"], d["permissions"]) for d in container["devices"]}
    assert devices == {("/dev/vfio/vfio", "/dev/vfio/vfio", "rw"), ("/dev/vfio/21", "/dev/vfio/21", "rw")}
    placed = await core.read_namespaced_pod("vm-launcher", namespace)
    assert placed.spec.node_name == kubelet.node_name

    # A second pod asking for the same device does not fit: it has one. The scheduler says so.
    await support.create_pod(api, namespace, support.launcher_pod("second", resource))

    async def unschedulable():
        pod = await core.read_namespaced_pod("second", namespace)
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in pod.status.conditions or [])

    await support.wait_for(unschedulable, 60, 0.2, what="the second pod found unschedulable")
    assert not any(c["envs"].get("MARK") == "second" for c in kubelet.created_containers())
    await support.delete_pod(api, namespace, "second")
    await support.delete_pod(api, namespace, "vm-launcher")
    await support.assign(api, gpu, "")
    await wait_resources(core, kubelet.node_name, {resource: "0", POOL: "2"}, agent)


async def test_a_pool_pod_gets_one_gpu_and_its_group_devices(api, core, kubelet, agent, namespace):
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    await support.create_pod(api, namespace, support.launcher_pod("pool-user", POOL))
    container = await created(core, namespace, kubelet, "pool-user")
    [address] = container["envs"][resource_env_name(POOL)].split(",")
    assert address in GPUS  # never the audio function: KubeVirt hands addresses out by position
    group = GROUPS[address]
    assert {d["host_path"] for d in container["devices"]} == {"/dev/vfio/vfio", f"/dev/vfio/{group}"}
    await support.delete_pod(api, namespace, "pool-user")


async def test_a_device_whose_vfio_node_vanishes_leaves_allocatable(core, kubelet, agent, gpu_host):
    host, _ = gpu_host
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    node = host.root / "dev" / "vfio" / "20"
    node.unlink()
    try:
        await wait_resources(core, kubelet.node_name, {POOL: "1"}, agent)
        assert (await resources(core, kubelet.node_name, "capacity"))[POOL] == "2"
    finally:
        node.write_text("")
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)


async def test_a_restarted_kubelet_gets_every_resource_back_without_restarting_the_agent(
    api, core, kubelet, agent, namespace
):
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    # At start the kubelet deletes every socket in its device-plugin directory.
    await asyncio.to_thread(kubelet.restart_kubelet)
    assert agent.alive()
    # Registered again: a new pod is allocated through the re-created socket.
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent, timeout=60)
    await support.create_pod(api, namespace, support.launcher_pod("after-restart", POOL))
    container = await created(core, namespace, kubelet, "after-restart", timeout=60)
    assert container["envs"][resource_env_name(POOL)] in GPUS
    await support.delete_pod(api, namespace, "after-restart")


async def test_leaving_gpu_mode_gives_back_what_no_pod_holds_and_the_rest_when_its_pod_ends(
    api, core, kubelet, agent, gpu_host, namespace
):
    host, _ = gpu_host
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    await support.create_pod(api, namespace, support.launcher_pod("holder", POOL))
    held = (await created(core, namespace, kubelet, "holder"))["envs"][resource_env_name(POOL)]
    free = next(a for a in GPUS if a != held)
    await label(core, kubelet.node_name, None)

    async def given_back(*addresses):
        return all(host.driver(a) == "nvidia" for a in addresses)

    await support.wait_for(lambda: given_back(free), 30, what=lambda: f"{free} given back; log:\n{agent.output()[-3000:]}")
    assert host.driver(held) == "vfio-pci"  # a pod holds it: never pulled from under its VM
    assert {host.driver(a) for a in GROUPS if GROUPS[a] == GROUPS[free]} == {"nvidia", "snd_hda_intel"}
    await support.delete_pod(api, namespace, "holder")
    group = [a for a in GROUPS if GROUPS[a] == GROUPS[held]]

    async def group_back():  # the GPU, then its audio function, then the group's /dev/vfio node
        return {host.driver(a) for a in group} == {"nvidia", "snd_hda_intel"} and not host.vfio_node(GROUPS[held]).exists()

    await support.wait_for(group_back, 60, what=f"{held} and its group given back after its pod ended")
    names = await device_names(api, kubelet.node_name)

    async def told():  # Events are posted after the scan's reports
        events = await core.list_namespaced_event("default", field_selector="reason=GivenBack")
        return {names[held], names[free]} <= {e.involved_object.name for e in events.items}

    await support.wait_for(told, 10, what="a GivenBack Event on both devices")
