"""DRA mode on a big node, against the real parts: more than 128 devices to offer are a pool of
several ResourceSlices (resource.k8s.io/v1 refuses more in one), and the agent's report hears of
a prepare's driver change at once, not at its periodic rescan.

The agent runs `--dra` with the default 5-minute rescan interval over a fixture node of 130 H100s
already on vfio-pci (each in its own group) and one A10 with its audio function on their own
drivers, beside the real kubelet and kube-scheduler.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from e2e.support import created
from passthrough.dra.slice import MAX_DEVICES, slice_name
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.custom import Custom
from tests.integration.test_dra import (
    RESOURCE, cdi_dir, claim, claim_pod, create_claim, create_namespace_class, delete_claim,
)  # fmt: skip

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
H100S = 130
A10, A10_AUDIO, A10_GROUP = "0000:f0:00.0", "0000:f0:00.1", 400
GPU_MODE = "passthrough.io/gpu-passthrough"


def big_node(root: Path) -> fakesysfs.FakeHost:
    host = fakesysfs.FakeHost(root)
    for i in range(H100S):
        bus = f"{0x10 + i:02x}"
        host.add_root_port(f"0000:00:{1 + i // 8:02x}.{i % 8}", bus, iommu_group=2 * i)
        host.add_device(f"0000:{bus}:00.0", "10de", "2330", "030200", driver="vfio-pci", iommu_group=2 * i + 1)
    host.add_root_port("0000:00:1f.0", "f0", iommu_group=A10_GROUP - 1)
    host.add_device(A10, "10de", "2236", "030200", driver="nvidia", iommu_group=A10_GROUP, subsystem=("10de", "1482"))
    host.add_device(A10_AUDIO, "10de", "1aef", "040300", driver="snd_hda_intel", iommu_group=A10_GROUP,
                    subsystem=("10de", "1482"))  # fmt: skip
    return host


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    found = big_node(tmp_path_factory.mktemp("big-host"))
    with FakeKernel(found):
        yield found


@pytest.fixture(scope="module")
def kubelet(module_kubelet_nodes, kube_scheduler):
    return module_kubelet_nodes()


@pytest.fixture(scope="module")
def agent(cluster, kubelet, host, tmp_path_factory, operator):
    proc = AgentProcess(cluster, tmp_path_factory.mktemp("agent") / "agent.log", kubelet.node_name, host, PCI_IDS,
                        "--dra", f"--kubelet-dir={kubelet.root_dir}", f"--cdi-dir={cdi_dir(kubelet)}",
                        kubelet=kubelet).start()  # fmt: skip
    yield proc
    code = proc.stop()
    output = proc.output()
    assert code == 0 and "Traceback" not in output, output[-5000:]


async def pool_of(api, node: str, count: int) -> list[dict | None]:
    found = []
    for index in range(count):
        try:
            found.append(await session_of(api).request("GET", f"{RESOURCE}/resourceslices/{slice_name(node, index)}"))
        except ApiError:
            found.append(None)
    return found


async def test_more_than_128_devices_are_a_pool_of_slices_of_one_generation(api, kubelet, agent):
    core = client.CoreV1Api(api)
    node = kubelet.node_name
    await support.reported(api, node, (A10, A10_AUDIO))
    await core.patch_node(node, {"metadata": {"labels": {GPU_MODE: "true"}}})
    try:
        async def two_slices():
            pool = await pool_of(api, node, 2)
            sizes = [len((s or {}).get("spec", {}).get("devices") or []) for s in pool]
            return pool if sizes == [MAX_DEVICES, H100S + 1 - MAX_DEVICES] else None

        pool = await support.wait_for(two_slices, 60, 0.5, what=lambda: f"two slices of 128 and 3; log:\n{agent.output()[-3000:]}")
        assert [s["spec"]["pool"]["resourceSliceCount"] for s in pool] == [2, 2]
        assert len({s["spec"]["pool"]["generation"] for s in pool}) == 1
        names = [d["name"] for s in pool for d in s["spec"]["devices"]]
        assert len(set(names)) == H100S + 1 and names == sorted(names)
    finally:
        await core.patch_node(node, {"metadata": {"labels": {GPU_MODE: None}}})

    # The pool gone, the node keeps two slices (the agent may not delete one), both empty, both newer.
    async def emptied():
        now = await pool_of(api, node, 2)
        done = all(s and not s["spec"].get("devices") for s in now)
        return now if done else None

    now = await support.wait_for(emptied, 60, 0.5, what="both slices emptied")
    assert {s["spec"]["pool"]["generation"] for s in now} == {pool[0]["spec"]["pool"]["generation"] + 1}


async def test_a_prepared_claims_driver_change_reaches_the_nodepcidevice_before_the_next_rescan(
    api, kubelet, agent, host, namespace, unique
):
    core = client.CoreV1Api(api)
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (A10, A10_AUDIO))
    await support.assign(api, names[A10], namespace)
    device_class = f"passthrough-big-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("big-launcher", "vm-gpu"))
        await created(core, namespace, kubelet, "big-launcher", timeout=90)
        assert host.driver(A10) == "vfio-pci"

        # The agent rescans every 5 minutes; the prepare's move wakes its report.
        async def reported_on_vfio():
            obj = await Custom(api, "nodepcidevices").get(names[A10])
            return ((obj or {}).get("status") or {}).get("attributes", {}).get("driver") == "vfio-pci"

        await support.wait_for(reported_on_vfio, 20, 0.2, what=lambda: f"the NodePCIDevice saying vfio-pci; log:\n{agent.output()[-3000:]}")
        await support.delete_pod(api, namespace, "big-launcher")
    finally:
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[A10], "")

    # Given back once it is not handed out: that too is on the object without a rescan.
    async def reported_back():
        obj = await Custom(api, "nodepcidevices").get(names[A10])
        return ((obj or {}).get("status") or {}).get("attributes", {}).get("driver") == "nvidia"

    await support.wait_for(reported_back, 30, 0.2, what=lambda: f"the NodePCIDevice saying nvidia again; log:\n{agent.output()[-3000:]}")
