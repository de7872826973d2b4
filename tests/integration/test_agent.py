"""The node agent against the real control plane, over fixture sysfs trees."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from passthrough.agent import report
from passthrough.agent.loop import Agent
from passthrough.api.labels import NODE_LABEL, VFIO_LABEL
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.pci.naming import node_pci_device_name
from passthrough.pci.pciids import PciIds

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
GPUS = ("0000:3b:00.0", "0000:af:00.0")
AUDIO = ("0000:3b:00.1", "0000:af:00.1")


@pytest.fixture(scope="module")
def pci_ids():
    return PciIds.load(PCI_IDS)


@pytest.fixture
def kind(api):
    return Custom(api, "nodepcidevices")


def agent_for(api, node, host, pci_ids, **kwargs) -> Agent:
    return Agent(api, node.name, host.sysfs, host.proc, pci_ids, rescan_interval=kwargs.pop("rescan_interval", 3600), **kwargs)


async def on_node(kind: Custom, node) -> dict[str, dict]:
    items = (await kind.list(f"{NODE_LABEL}={node.name}"))["items"]
    return {d["status"]["attributes"]["pciAddress"]: d for d in items if d.get("status")}


def ready(obj) -> dict:
    return next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")


async def test_first_report_writes_one_node_pci_device_per_device(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    result = await agent_for(api, node, host, pci_ids).scan()
    devices = await on_node(kind, node)
    assert sorted(devices) == sorted(GPUS + AUDIO)  # bridges on bus 00 are left out
    assert result.devices == 4
    for address, obj in devices.items():
        attrs = obj["status"]["attributes"]
        assert obj["metadata"]["name"] == node_pci_device_name(address, attrs["vendorID"], attrs["deviceID"], node.name)
        assert not obj["metadata"].get("ownerReferences")  # not the Node's: deleting it must not take them
        assert ready(obj)["status"] == "True"
        assert attrs["nodeName"] == node.name and attrs["iommuGroup"] in (20, 21)
    gpu = devices[GPUS[0]]
    assert gpu["status"]["resourceName"] == "nvidia.com/GA102GL_A10" and gpu["status"]["mode"] == "Pool"
    assert gpu["status"]["attributes"]["name"] == "GA102GL [A10]"
    assert gpu["status"]["attributes"]["numaNode"] == 0 and devices[GPUS[1]]["status"]["attributes"]["numaNode"] == 1
    assert devices[AUDIO[0]]["status"]["resourceName"] == ""
    labels = (await client.CoreV1Api(api).read_node(node.name)).metadata.labels
    assert labels[VFIO_LABEL] == "true"


async def test_a_rescan_of_unchanged_hardware_writes_nothing(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    agent = agent_for(api, node, host, pci_ids)
    await agent.scan()
    await support.quiet(api, ("nodepcidevices", "nodes"), settle=1)  # earlier tests' nodes being collected
    before = await support.write_counts(api)
    result = await agent.scan()
    after = await support.write_counts(api)
    assert result.writes == 0
    assert support.writes_between(before, after, "nodepcidevices", "nodes", verbs=support.CHANGE_VERBS) == 0


async def test_a_restarted_agent_writes_nothing(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    await agent_for(api, node, host, pci_ids).scan()
    await support.quiet(api, ("nodepcidevices", "nodes"), settle=1)
    before = await support.write_counts(api)
    restarted = agent_for(api, node, host, pci_ids)
    task = asyncio.create_task(restarted.run())
    try:
        await support.wait_for(lambda: _scanned(restarted), what="first scan of the restarted agent")
        after = await support.write_counts(api)
        assert restarted.writes == 0
        assert support.writes_between(before, after, "nodepcidevices", "nodes", verbs=support.CHANGE_VERBS) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _scanned(agent):
    return agent.scans > 0


async def test_a_device_that_vanishes_is_not_found_and_comes_back_ready(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    agent = agent_for(api, node, host, pci_ids)
    await agent.scan()
    uid = (await on_node(kind, node))[GPUS[1]]["metadata"]["uid"]
    host.remove_device(GPUS[1])
    host.remove_device(AUDIO[1])
    result = await agent.scan()
    assert result.missing == 2
    devices = await on_node(kind, node)
    gone = ready(devices[GPUS[1]])
    assert (gone["status"], gone["reason"]) == ("False", "NotFound")
    assert GPUS[1] in gone["message"] and node.name in gone["message"]
    assert ready(devices[GPUS[0]])["status"] == "True"  # the other GPU is untouched

    # The card is back (re-seated, or its driver reloaded).
    host.add_device(GPUS[1], "10de", "2236", "030200", driver="nvidia", iommu_group=21, numa_node=1, subsystem=("10de", "1482"))
    host.add_device(AUDIO[1], "10de", "1aef", "040300", iommu_group=21, numa_node=1, subsystem=("10de", "1482"))
    await agent.scan()
    devices = await on_node(kind, node)
    assert ready(devices[GPUS[1]])["status"] == "True"
    assert devices[GPUS[1]]["metadata"]["uid"] == uid  # the same object: the name is stable


async def test_a_node_deleted_and_registered_again_keeps_its_device_objects(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    agent = agent_for(api, node, host, pci_ids)
    await agent.scan()
    before = {address: obj["metadata"]["uid"] for address, obj in (await on_node(kind, node)).items()}
    assert not any(o["metadata"].get("ownerReferences") for o in (await on_node(kind, node)).values())
    # The garbage collector had deleted them here while the Node owned them. A ConfigMap the
    # Node owns is the marker: once the collector has deleted it, it has acted on the Node's end.
    core = client.CoreV1Api(api)
    marker = client.V1ConfigMap(metadata=client.V1ObjectMeta(
        name=f"owned-by-{node.name}", owner_references=[client.V1OwnerReference(api_version="v1", kind="Node", name=node.name, uid=node.uid)]))  # fmt: skip
    await core.create_namespaced_config_map("default", marker)
    await core.delete_node(node.name)

    async def marker_gone() -> bool:
        try:
            await core.read_namespaced_config_map(marker.metadata.name, "default")
        except client.ApiException as exc:
            return exc.status == 404
        return False

    await support.wait_for(marker_gone, 60, what="the garbage collector to delete what the Node owned")
    assert {a: o["metadata"]["uid"] for a, o in (await on_node(kind, node)).items()} == before
    result = await agent.scan()  # an agent whose Node is gone reports nothing
    assert result.writes == 0
    await support.ensure_node(api, node.name)  # registers again: a new uid
    await agent.scan()
    after = await on_node(kind, node)
    assert {a: o["metadata"]["uid"] for a, o in after.items()} == before  # the same objects, the admin's spec with them
    assert all(ready(obj)["status"] == "True" for obj in after.values())


async def test_the_node_owner_an_older_agent_set_is_removed(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    name = node_pci_device_name(GPUS[0], "10de", "2236", node.name)
    old_identity = report.identity(name, node)
    old_identity["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.uid}]
    await kind.apply(old_identity, AGENT_MANAGER)
    await agent_for(api, node, host, pci_ids).scan()
    assert not (await kind.get(name))["metadata"].get("ownerReferences")


async def test_busy_devices_are_reported_with_the_reason(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.storage_node(tmp_path)
    await agent_for(api, node, host, pci_ids).scan()
    devices = await on_node(kind, node)
    nic_up, nic_free, nvme = devices["0000:18:00.0"], devices["0000:18:00.1"], devices["0000:3d:00.0"]
    assert (ready(nic_up)["status"], ready(nic_up)["reason"]) == ("False", "NotReady")
    assert "eth0" in ready(nic_up)["message"] and nic_up["status"]["eligible"] is False
    assert ready(nic_free)["status"] == "True" and ready(nvme)["status"] == "True"
    host.mount("nvme0n1p1", "/var/lib/data")
    await agent_for(api, node, host, pci_ids).scan()
    assert "mounted" in ready((await on_node(kind, node))["0000:3d:00.0"])["message"]


async def test_one_malformed_device_does_not_stop_the_others(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    host.write_attribute(GPUS[1], "numa_node", "not-a-number\n")
    host.break_link(AUDIO[0], "iommu_group")
    result = await agent_for(api, node, host, pci_ids).scan()
    assert not result.failed
    devices = await on_node(kind, node)
    assert sorted(devices) == sorted(GPUS + AUDIO)
    assert ready(devices[GPUS[1]])["status"] == "False" and "numa_node" in ready(devices[GPUS[1]])["message"]
    assert ready(devices[AUDIO[0]])["status"] == "False"


async def test_an_assignment_moves_the_device_out_of_the_pool(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    agent = agent_for(api, node, host, pci_ids)
    task = asyncio.create_task(agent.run())
    try:
        await support.wait_for(lambda: on_node(kind, node), what="first report")
        name = (await on_node(kind, node))[GPUS[0]]["metadata"]["name"]
        await support.assign(api, name, "team-x")

        async def exclusive():
            status = (await kind.get(name))["status"]
            return status["resourceName"] == f"passthrough.io/{name}" and status["mode"] == "Exclusive"

        await support.wait_for(exclusive, 15, what="exclusive resource name")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_node_without_iommu_is_labelled_and_its_devices_say_why(api, kind, node, tmp_path, pci_ids):
    host = fakesysfs.FakeHost(tmp_path, iommu=False)
    host.add_device("0000:3b:00.0", "10de", "2236", "030200", driver="nvidia")
    await agent_for(api, node, host, pci_ids).scan()
    labels = (await client.CoreV1Api(api).read_node(node.name)).metadata.labels
    assert labels[VFIO_LABEL] == "false"
    message = ready((await on_node(kind, node))["0000:3b:00.0"])["message"]
    assert "IOMMU" in message


def test_the_agent_refuses_to_start_without_a_node_name():
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME"}
    result = subprocess.run([sys.executable, "-m", "passthrough", "agent"], capture_output=True, text=True, env=env)
    assert result.returncode == 2 and "node name" in result.stderr


async def test_the_agent_refuses_to_start_without_the_crds(tmp_path, cluster):
    from e2e.cluster import LocalCluster

    bare = LocalCluster(workdir=tmp_path / "bare", bin_dir=cluster.bin_dir)
    bare.start()
    try:
        host = fakesysfs.gpu_node(tmp_path / "host")
        result = subprocess.run(
            [sys.executable, "-m", "passthrough", "agent", "--node-name=n1", f"--kubeconfig={bare.kubeconfig}",
             f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}"],
            capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 1
        assert "CRDs are not installed" in result.stderr and "kubectl apply -f crds/" in result.stderr
    finally:
        bare.stop()


async def test_sighup_rescans_at_once(api, kind, node, tmp_path, cluster):
    host = fakesysfs.gpu_node(tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "passthrough", "agent", f"--node-name={node.name}", f"--kubeconfig={cluster.kubeconfig}",
         f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}", f"--pci-ids={PCI_IDS}", "--rescan-interval=1h", "--no-hotplug"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        def reported(count):
            async def check():
                return len(await on_node(kind, node)) == count

            return check

        await support.wait_for(reported(4), 30, what="first report")
        host.add_root_port("0000:00:0b.0", "d8", iommu_group=12)
        host.add_device("0000:d8:00.0", "10de", "2331", "030200", driver="vfio-pci", iommu_group=22)
        proc.send_signal(signal.SIGHUP)
        await support.wait_for(reported(5), 10, what="the hot-plugged H100 after SIGHUP")
        h100 = (await on_node(kind, node))["0000:d8:00.0"]
        assert h100["status"]["resourceName"] == "nvidia.com/GH100_H100_PCIE"
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=15)[0].decode()
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
