"""A bind that fails is said on the device, with an Event, and done at a later scan once fixed.

The agent runs as its own process over a fixture GPU node with its simulated kernel; no
kubelet is needed (its device plugins wait for one, quietly).
"""

from __future__ import annotations

import contextlib
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

    return await support.wait_for(reached, timeout, interval=0.2, what=f"{address} Ready/{reason}; agent log:\n{agent.output()[-3000:]}")


async def events_for(api, name: str, reason: str) -> list:
    events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=f"involvedObject.name={name}")
    return [e for e in events.items if e.reason == reason]


@pytest.fixture
def run_agent(cluster, tmp_path):
    started = []

    def start(node: str, host) -> AgentProcess:
        agent = AgentProcess(cluster, tmp_path / "agent.log", node, host, PCI_IDS).start()
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


async def test_a_driver_that_will_not_let_go_leaves_its_group_as_it_was_and_the_rest_goes_on(api, gpu_mode_node, tmp_path, run_agent):
    host = fakesysfs.gpu_node(tmp_path / "host")
    host.set_busy("0000:3b:00.0")  # nvidia-persistenced holds the first GPU
    with FakeKernel(host):
        agent = run_agent(gpu_mode_node.name, host)
        cond = await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "UnbindRefused", agent)
        assert "nvidia" in cond["message"] and cond["status"] == "False", cond
        # Whole or nothing: the audio function of the same group was rolled back to its driver.
        assert (host.driver("0000:3b:00.0"), host.driver("0000:3b:00.1")) == ("nvidia", "snd_hda_intel")
        audio = (await ready_of(api, gpu_mode_node.name))["0000:3b:00.1"]
        assert audio["reason"] == "UnbindRefused"
        # The other group is not held back by it.
        await wait_ready(api, gpu_mode_node.name, "0000:af:00.0", "Ready", agent)
        assert host.driver("0000:af:00.0") == "vfio-pci"

        host.set_busy("0000:3b:00.0", False)  # the admin stops what held it
        await wait_ready(api, gpu_mode_node.name, "0000:3b:00.0", "Ready", agent, timeout=40)
        assert host.driver("0000:3b:00.0") == "vfio-pci"
