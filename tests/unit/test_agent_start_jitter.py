"""A DaemonSet's agents start together: each waits a random moment, bounded, before its first request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from passthrough.agent import loop
from passthrough.agent.loop import Agent
from passthrough.pci.pciids import PciIds

PCI_IDS = Path(__file__).resolve().parents[2] / "e2e/data/pci.ids.2025-07-11"


class Refusing:
    """Shaped as a Session; records when the first request came, then refuses."""

    def __init__(self) -> None:
        self.first: float | None = None

    async def request(self, *_a, **_k):
        self.first = self.first or time.monotonic()
        raise RuntimeError("stop here")


@pytest.mark.parametrize("drawn", [0.0, 0.4])
async def test_the_first_request_waits_for_the_agents_own_random_draw_within_the_bound(monkeypatch, drawn):
    bounds = []
    monkeypatch.setattr(loop.random, "uniform", lambda low, high: bounds.append((low, high)) or drawn)
    session = Refusing()
    agent = Agent(session, "n", pci_ids=PciIds.load(str(PCI_IDS)), start_jitter=0.5)
    started = time.monotonic()
    with pytest.raises(Exception, match="stop here"):
        await agent.run()
    assert bounds == [(0, 0.5)]
    assert drawn <= session.first - started < drawn + 0.3


def test_the_default_is_ten_seconds_in_a_pod_and_none_elsewhere(monkeypatch):
    seen = {}

    async def main(args, rescan, deadline, jitter=0.0):
        seen["jitter"] = jitter
        return 0

    from passthrough import cli
    from passthrough.agent import main as agent_main

    monkeypatch.setattr(agent_main, "_main", main)
    parser = cli.build_parser()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert agent_main.run(parser.parse_args(["agent", "--node-name=n"])) == 0 and seen["jitter"] == 0
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert agent_main.run(parser.parse_args(["agent", "--node-name=n"])) == 0 and seen["jitter"] == 10
    assert agent_main.run(parser.parse_args(["agent", "--node-name=n", "--start-jitter=0"])) == 0 and seen["jitter"] == 0
    assert agent_main.run(parser.parse_args(["agent", "--node-name=n", "--start-jitter=3s"])) == 0 and seen["jitter"] == 3
    assert agent_main.run(parser.parse_args(["agent", "--node-name=n", "--start-jitter=soon"])) == 2


def test_failed_scans_are_retried_ever_later_and_apart_up_to_a_ceiling(monkeypatch):
    # A thousand agents whose first scans fail together must not all come back in step, and not
    # every 5 s (that fed an overloaded API server's lag in bench_fleet).
    draws = []
    monkeypatch.setattr("passthrough.kube.cache.random.random", lambda: draws.append(1) or 0.0)
    lows = [loop.retry_delay(n) for n in range(1, 12)]
    assert lows[:4] == [loop.RETRY_FIRST, 2 * loop.RETRY_FIRST, 4 * loop.RETRY_FIRST, 8 * loop.RETRY_FIRST]
    assert lows == sorted(lows) and lows[-1] == loop.RETRY_MAX and len(draws) == 11
    monkeypatch.setattr("passthrough.kube.cache.random.random", lambda: 0.999)
    assert loop.RETRY_MAX < loop.retry_delay(50) < 2 * loop.RETRY_MAX  # drawn: each agent its own moment
