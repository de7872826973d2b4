"""The agent keeps running through an API server that hangs up mid-request, and says so."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from e2e import fakesysfs, support
from e2e.processes import AgentProcess
from e2e.proxy import FlakyProxy
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"


@pytest.fixture
async def proxy(cluster, tmp_path):
    started = await FlakyProxy(cluster, tmp_path / "proxy").start()
    yield started
    await started.stop()


async def readiness(api, node: str) -> dict[str, str]:
    items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]
    return {o["status"]["attributes"]["pciAddress"]: next(c["reason"] for c in o["status"]["conditions"] if c["type"] == "Ready")
            for o in items if o.get("status")}  # fmt: skip


async def test_an_api_server_that_hangs_up_mid_request_does_not_stop_the_agent(api, cluster, proxy, node, tmp_path):
    host = fakesysfs.gpu_node(tmp_path / "host")
    agent = AgentProcess(
        cluster, tmp_path / "agent.log", node.name, host, PCI_IDS,
        f"--kubeconfig={proxy.kubeconfig(tmp_path / 'through-proxy')}", "--no-device-plugin", "--rescan-interval=1s",
    ).start()  # fmt: skip
    try:
        # Every device reported, the one taken out below included: under load the first scan
        # can still be writing when the first status shows.
        async def all_reported():
            return len(await readiness(api, node.name)) == 4 and "0000:af:00.1" in await readiness(api, node.name)

        await support.wait_for(all_reported, 30, what=lambda: f"first report; log:\n{agent.output()[-2000:]}")
        proxy.hang_up()
        # Scans every second, each answered by a server that goes away mid-request.
        await support.wait_for(lambda: asyncio.sleep(0, proxy.hung_up >= 5), 20, what="requests hung up on")
        # Still scanning after them: two more requests, each hung up on too.
        seen = proxy.hung_up
        await support.wait_for(lambda: asyncio.sleep(0, proxy.hung_up >= seen + 2), 20, what="requests after the hang-ups")
        assert agent.alive(), agent.output()[-3000:]
        host.remove_device("0000:af:00.1")  # something to report once the server answers again
        proxy.pass_through()

        async def reported_gone():
            return (await readiness(api, node.name)).get("0000:af:00.1") == "NotFound"

        started = time.monotonic()
        try:
            await support.wait_for(reported_gone, 150, what="the agent reporting again")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; agent log:\n{agent.output()[-3000:]}") from None
        print(f"recovered in {time.monotonic() - started:.1f}s")
        assert agent.alive()
        output = agent.output()
        assert "scan failed" in output and "retrying" in output, output[-3000:]
    finally:
        code = agent.stop()
    assert code == 0 and "Traceback" not in agent.output(), agent.output()[-5000:]
