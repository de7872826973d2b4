"""A bind that fails is said on the device, with an Event, and done at a later scan once fixed.

The agent runs as its own process over a fixture GPU node with its simulated kernel; no
kubelet is needed (its device plugins wait for one, quietly).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from e2e.fakekernel import FakeKernel
from e2e.processes import AgentProcess
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"


@pytest.fixture
async def gpu_mode_node(api, unique):
    node = await support.ensure_node(api, f"bind-{unique}")
    await client.CoreV1Api(api).patch_node(node.name, {"metadata": {"labels": {"passthrough.io/gpu-passthrough": "true"}}})
    yield node
    with contextlib.suppress(client.exceptions.ApiException):
        await support.remove_node(api, node.name)


async def ready_of(api, node: str) -> dict[str, dict]:
    items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]
    return {
        o["status"]["attributes"]["pciAddress"]: {**next(c for c in o["status"]["conditions"] if c["type"] == "Ready"),
                                                  "object": o["metadata"]["name"]}
        for o in items if o.get("status")
    }  # fmt: skip


async def wait_ready(api, node: str, address: str, reason: str, agent: AgentProcess, timeout: float = 30) -> dict:
    async def reached():
        cond = (await ready_of(api, node)).get(address)
        return cond if cond and cond["reason"] == reason else None

    return await support.wait_for(reached, timeout, interval=0.2, what=lambda: f"{address} Ready/{reason}; agent log:\n{agent.output()[-3000:]}")


async def events_for(api, name: str, reason: str) -> list:
    events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=f"involvedObject.name={name}")
    return [e for e in events.items if e.reason == reason]


@pytest.fixture
def run_agent(cluster, tmp_path):
    started = []

    def start(node: str, host, *args: str) -> AgentProcess:
        agent = AgentProcess(cluster, tmp_path / "agent.log", node, host, PCI_IDS, *args).start()
        started.append(agent)
        return agent

    yield start
    for agent in started:
        assert agent.stop() == 0 and "Traceback" not in agent.output(), agent.output()[-5000:]


async def test_vfio_pci_not_loaded_is_said_on_the_device_and_the_bind_happens_once_it_is(api, gpu_mode_node, tmp_path, run_agent):
    host = fakesysfs.gpu_node(tmp_path / "host", vfio=False)
    with FakeKernel(host):
        agent = run_agent(gpu_mode_node.name, host)
        cond = await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "VfioNotLoaded", agent)
        assert cond["status"] == "False" and "modprobe vfio-pci" in cond["message"], cond
        # Nothing was written: the GPUs stay with their driver.
        assert host.driver("0000:3b:00.0") == "nvidia"
        await support.wait_for(lambda: events_for(api, cond["object"], "VfioNotLoaded"), 10, what="a Warning Event")
        [event] = await events_for(api, cond["object"], "VfioNotLoaded")
        assert event.type == "Warning"

        host.load_vfio()  # the admin runs modprobe vfio-pci; the agent's retry finds it
        await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "Ready", agent)
        assert {host.driver(a) for a in ("0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0", "0000:af:00.1")} == {"vfio-pci"}


async def test_an_unbind_that_blocks_leaves_the_agent_reporting_and_stoppable(api, gpu_mode_node, tmp_path, cluster):
    # Linux blocks the unbind of a held device until the holder lets go. The agent must neither
    # hang with it nor unbind anything else of the group behind its back.
    host = fakesysfs.gpu_node(tmp_path / "host")
    host.hold("0000:3b:00.1")  # something holds the first GPU's audio function
    # The simulated kernel serializes writes to one control file (FUSE's inode lock; Linux does
    # not): the other group's functions start without a driver, so they need no `unbind` behind
    # the blocked one.
    for address in ("0000:af:00.0", "0000:af:00.1"):
        host.bind(address, None)
    with FakeKernel(host):
        agent = AgentProcess(cluster, tmp_path / "agent.log", gpu_mode_node.name, host, PCI_IDS,
                             "--write-deadline=2s").start()  # fmt: skip
        try:
            cond = await wait_ready(api, gpu_mode_node.name, "0000:3b:00.1", "WriteBlocked", agent)
            assert cond["status"] == "False" and "has not returned after 2 s" in cond["message"], cond
            assert "IOMMU group 20" in cond["message"] and "leaves the group alone" in cond["message"]
            # The other group is not held back by it, and the scans go on.
            await wait_ready(api, gpu_mode_node.name, "0000:af:00.0", "Ready", agent)
            assert host.driver("0000:af:00.0") == "vfio-pci"
        finally:
            started = time.monotonic()
            code = agent.stop()  # SIGTERM while the write is still blocked
            stopped_in = time.monotonic() - started
            host.release("0000:3b:00.1")  # the blocked child finishes its write, then dies
    assert code == 0 and stopped_in < 10, agent.output()[-3000:]
    assert "Traceback" not in agent.output()


async def test_an_overdue_write_that_returns_lets_the_group_go_on(api, gpu_mode_node, tmp_path, run_agent):
    host = fakesysfs.gpu_node(tmp_path / "host")
    host.hold("0000:3b:00.1")
    with FakeKernel(host):
        agent = run_agent(gpu_mode_node.name, host, "--write-deadline=2s")
        await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "WriteBlocked", agent)
        host.release("0000:3b:00.1")  # the holder lets go: the write returns, the agent scans again
        await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "Ready", agent, timeout=40)
        assert host.driver("0000:3b:00.0") == host.driver("0000:3b:00.1") == "vfio-pci"


async def test_a_gpu_whose_nvidia_driver_has_users_stays_and_says_how_to_prepare_the_node(api, gpu_mode_node, tmp_path, run_agent):
    host = fakesysfs.gpu_node(tmp_path / "host")
    module = host.sysfs / "module" / "nvidia"
    (module / "holders" / "nvidia_uvm").mkdir(parents=True)
    (module / "refcnt").write_text("2\n")  # nvidia_uvm, and nvidia-persistenced
    with FakeKernel(host):
        agent = run_agent(gpu_mode_node.name, host)
        cond = await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "VendorDriverInUse", agent)
        assert cond["status"] == "False" and "vfio-pci.ids=10de:2236" in cond["message"], cond
        assert "driverctl set-override 0000:3b:00.0 vfio-pci" in cond["message"]
        assert (host.driver("0000:3b:00.0"), host.driver("0000:3b:00.1")) == ("nvidia", "snd_hda_intel")
        [event] = await support.wait_for(lambda: events_for(api, cond["object"], "VendorDriverInUse"), 10, what="an Event")
        assert event.type == "Warning"
        (module / "refcnt").write_text("1\n")  # nvidia-persistenced stopped: the agent's retry moves it
        await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "Ready", agent, timeout=40)
        assert host.driver("0000:3b:00.0") == "vfio-pci"
