"""What an agent's start costs the API server, against the real control plane: its watches begin
after its first report, on the connections that report opened, and miss nothing meanwhile."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from passthrough.agent.loop import CONNECTIONS, Agent
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.connect import session
from passthrough.kube.custom import Custom
from passthrough.pci.pciids import PciIds

pytestmark = pytest.mark.cluster
PCI_IDS = Path(__file__).resolve().parents[2] / "e2e/data/pci.ids.2025-07-11"
GPU = "0000:3b:00.0"


@pytest.fixture(scope="module")
def pci_ids():
    return PciIds.load(PCI_IDS)


def watching(node: str) -> set[str]:
    """The names of this loop's tasks that watch the node's NodePCIDevices or its Node."""
    return {t.get_name() for t in asyncio.all_tasks()} & {f"mirror-{node}", f"node-{node}"}


def after_first_scan(agent: Agent, then) -> list[set[str]]:
    """Runs `then()` once the agent's first scan is done, before its loop goes on; returns, per
    scan, the watch tasks running when it began."""
    seen: list[set[str]] = []
    scan = agent.scan

    async def recorded():
        seen.append(watching(agent.node_name))
        result = await scan()
        if len(seen) == 1:
            await then()
        return result

    agent.scan = recorded
    return seen


async def first_report(kind: Custom, node: str, count: int = 4) -> bool:
    items = (await kind.list(f"{NODE_LABEL}={node}"))["items"]
    return len([d for d in items if d.get("status")]) == count


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_the_watches_start_after_the_first_report_and_an_assignment_meanwhile_is_not_missed(api, node, tmp_path, pci_ids):
    # A thousand agents watching while a thousand first reports are written cost the API server a
    # label match per write per watcher; the watch starts at the first scan's own listing, so an
    # admin's change between that listing and the watch's start still reaches the agent.
    kind = Custom(api, "nodepcidevices")
    host = fakesysfs.gpu_node(tmp_path)
    agent = Agent(api, node.name, host.sysfs, host.proc, pci_ids, rescan_interval=3600)
    names: dict[str, str] = {}

    async def assign_one():
        items = (await kind.list(f"{NODE_LABEL}={node.name}"))["items"]
        names.update({d["status"]["attributes"]["pciAddress"]: d["metadata"]["name"] for d in items})
        await support.assign(api, names[GPU], "team-x")

    seen = after_first_scan(agent, assign_one)
    task = asyncio.create_task(agent.run())
    try:
        await support.wait_for(lambda: first_report(kind, node.name), what="first report")

        async def exclusive():
            status = (await kind.get(names[GPU]))["status"]
            return status["mode"] == "Exclusive"

        await support.wait_for(exclusive, 15, what="the assignment made before the watch began, seen by the agent")
        assert seen[0] == set(), "a watch ran during the first scan"
        assert watching(node.name) == {f"mirror-{node.name}", f"node-{node.name}"}
    finally:
        await stop(task)


async def test_an_extended_resource_added_before_the_node_watch_began_is_not_missed(api, node, tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    kind = Custom(api, "nodepcidevices")
    agent = Agent(api, node.name, host.sysfs, host.proc, pci_ids, rescan_interval=3600)
    changes: list[str] = []
    agent.on_node_change = lambda: changes.append("node")

    async def another_plugin():
        body = {"status": {"capacity": {"example.com/fpga": "1"}, "allocatable": {"example.com/fpga": "1"}}}
        await client.CoreV1Api(api).patch_node_status(node.name, body)

    after_first_scan(agent, another_plugin)
    task = asyncio.create_task(agent.run())
    try:
        await support.wait_for(lambda: first_report(kind, node.name), what="first report")

        async def told():
            return changes

        await support.wait_for(told, 15, what="the new extended resource, told")
    finally:
        await stop(task)


async def test_an_agent_opens_two_connections_for_its_first_report_and_its_watches(api, node, tmp_path, pci_ids, cluster):
    # Each connection is a TLS handshake on both sides, and a thousand agents starting together
    # pay for them together: two writes at once, and the watches take the scan's connections.
    own = await session(str(cluster.kubeconfig), connections=CONNECTIONS)  # as `passthrough agent` makes it
    opened: list[int] = []
    trace = aiohttp.TraceConfig()

    async def connection_made(*_):
        opened.append(1)

    trace.on_connection_create_end.append(connection_made)
    trace.freeze()
    own.http._trace_configs.append(trace)  # noqa: SLF001 (aiohttp takes them only at construction)
    host = fakesysfs.gpu_node(tmp_path)
    agent = Agent(own, node.name, host.sysfs, host.proc, pci_ids, rescan_interval=3600)
    task = asyncio.create_task(agent.run())
    try:
        await support.wait_for(lambda: first_report(Custom(api, "nodepcidevices"), node.name), what="first report")

        async def both_watching():
            return len(watching(node.name)) == 2

        await support.wait_for(both_watching, what="both watches")
        await asyncio.sleep(0.5)  # the watches' requests are out
        assert len(opened) == 2, f"{len(opened)} connections for 8 writes and 2 watches"
    finally:
        await stop(task)
        await own.close()
