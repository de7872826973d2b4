"""Benchmark of a fleet of node agents against a real control plane: 1,000 nodes x 8 devices by default.

    .venv/bin/python e2e/bench/bench_fleet.py [--nodes 1000] [--devices-per-node 8] [--rounds 3]

Every node has its own Agent, API client and fixture tree of --devices-per-node GPUs (as
`bench_agent.gpu_host` builds them), all in this process and event loop. What each figure means:
- agents start all at once, as a DaemonSet's do after a cluster's restart, each with the
  agent's own start-up jitter (a random wait of up to --start-jitter, 10 s as
  `passthrough agent` in a pod, before its first request).
- first report: the time from the agents' start until a watch on NodePCIDevices (started
  before them) has seen every device with its status; the writes the API server counted,
  by resource and subresource (per device: the object, then its status, 2 when nothing is
  written twice), and the API server's CPU seconds per 1,000 devices (psutil on its pid).
- no-op rescan: every agent rescans unchanged hardware (SIGHUP's path, `trigger()`); writes
  per round across the fleet (0 when the diff works), the round's time (trigger to the last
  agent's scan done) and the API server's CPU per round.
- restart: every agent replaced by a new Agent (empty caches, as after a pod restart) running
  until its first scan is done; writes (0 when the agent reads what is there first) and time.
- CPU: with every agent in one Python process on a small machine, this process is the
  bottleneck, so the times are an upper bound on what separate agent pods would see; its
  CPU seconds divided by the node count are what one agent pod would spend.

Nothing is asserted: a write where 0 is expected is printed, with the API server's breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402

from e2e import cluster, fakesysfs, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.bench.bench_agent import gpu_host  # noqa: E402
from passthrough.agent import metrics  # noqa: E402
from passthrough.agent.loop import CONNECTIONS, START_JITTER, Agent, ScanResult  # noqa: E402
from passthrough.kube.connect import connect, session  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402
from passthrough.pci.pciids import PciIds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WATCHED = ("nodepcidevices", "nodes")


def cores() -> str:
    return f"{len(os.sched_getaffinity(0))} CPUs (os.cpu_count() {os.cpu_count()})"


def record_scans(agent: Agent, first_done: Callable[[], None]) -> list[ScanResult]:
    """The results of the scans the agent's own loop finishes (`Agent.scans` counts scans begun)."""
    results: list[ScanResult] = []
    scan = agent.scan

    async def recorded() -> ScanResult:
        result = await scan()
        results.append(result)
        if len(results) == 1:
            first_done()
        return result

    agent.scan = recorded
    return results


class Fleet:
    """One running Agent per node, each with its own API session, as separate agent pods would have."""

    def __init__(self, kubeconfig: Path, hosts: dict[str, fakesysfs.FakeHost], pci_ids: PciIds, jitter: float) -> None:
        self.kubeconfig, self.hosts, self.pci_ids, self.jitter = kubeconfig, hosts, pci_ids, jitter
        self.clients: list = []
        self.agents: list[Agent] = []
        self.tasks: list[asyncio.Task] = []
        self.scans: list[list[ScanResult]] = []

    async def connect(self) -> None:
        self.clients = [await session(str(self.kubeconfig), connections=CONNECTIONS) for _ in self.hosts]  # as `passthrough agent` does

    def start(self) -> None:
        self.agents = [Agent(api, name, host.sysfs, host.proc, self.pci_ids, rescan_interval=3600, start_jitter=self.jitter)
                       for api, (name, host) in zip(self.clients, self.hosts.items(), strict=True)]  # fmt: skip
        self.scans = [record_scans(agent, lambda: None) for agent in self.agents]
        self.tasks = [asyncio.create_task(agent.run()) for agent in self.agents]

    def check(self) -> None:
        for task in self.tasks:
            if task.done():
                task.result()  # an agent that died: its exception, not a timeout

    async def scanned(self, count: int) -> None:
        """Wait until every agent has finished `count` scans."""
        async def done() -> bool:
            self.check()
            return all(len(s) >= count for s in self.scans)

        await support.wait_for(done, timeout=900, interval=0.01, what=f"scan {count} of every agent")

    async def rescan(self) -> None:
        count = min(len(s) for s in self.scans) + 1
        for agent in self.agents:
            agent.trigger()
        await self.scanned(count)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for api in self.clients:
            await api.close()


class Reported:
    """A watch on every NodePCIDevice: the names that have a status, and when the count reached a goal."""

    def __init__(self, api) -> None:
        self.kind = Custom(api, "nodepcidevices")
        self.names: set[str] = set()
        self.goal, self.reached = 0, asyncio.Event()

    async def run(self) -> None:
        listing = await self.kind.list()
        self.names = {o["metadata"]["name"] for o in listing["items"] if (o.get("status") or {}).get("attributes")}
        rv = listing["metadata"]["resourceVersion"]
        while True:
            async for kind, obj in self.kind.watch(resource_version=rv, timeout=3600):
                rv = obj["metadata"].get("resourceVersion", rv)
                name = obj["metadata"].get("name")
                if kind == "DELETED":
                    self.names.discard(name)
                elif kind != "BOOKMARK" and (obj.get("status") or {}).get("attributes"):
                    self.names.add(name)
                if self.goal and len(self.names) >= self.goal:
                    self.reached.set()

    async def until(self, goal: int, fleet: Fleet, timeout: float = 1200) -> None:
        self.goal = goal
        if len(self.names) >= goal:
            self.reached.set()
        deadline = time.monotonic() + timeout
        while not self.reached.is_set():
            fleet.check()
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(self.names)} of {goal} NodePCIDevices reported after {timeout:.0f} s")
            await support.wait_event(self.reached, 1)


class Meter:
    """Over a span: the writes the API server counted, and the CPU time of this process and the control plane."""

    def __init__(self, api, local: cluster.LocalCluster) -> None:
        self.api = api
        self.processes = {"this process": psutil.Process(),
                          **{p.name: psutil.Process(p.pid) for p in local.processes if p.name != "kube-controller-manager"}}  # fmt: skip

    def _cpu(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}

    async def start(self) -> None:
        self.counts, self.cpu_before = await support.write_counts_by_subresource(self.api), self._cpu()

    async def stop(self) -> Meter:
        counts, cpu = await support.write_counts_by_subresource(self.api), self._cpu()
        self.writes = Counter({k: n for k, n in support.diff(self.counts, counts).items() if k[0] in WATCHED})
        self.spent = {name: cpu[name] - self.cpu_before[name] for name in cpu}
        return self

    def breakdown(self, per: int = 1) -> str:
        parts = [f"{res}{'/' + sub if sub else ''} {verb} {n / per:g}" for (res, sub, verb), n in sorted(self.writes.items())]
        return ", ".join(parts) or "none"

    def total(self, per: int = 1) -> float:
        return sum(self.writes.values()) / per

    def cpu(self, per: float = 1) -> str:
        return ", ".join(f"{name} {seconds / per:.2f} s" for name, seconds in self.spent.items())


def failed_scans() -> float:
    """Scans of every agent in this process that failed as a whole so far (the agents' own counter)."""
    return metrics.AGENT.get_sample_value("passthrough_agent_scan_failures_total") or 0


async def create_nodes(api, names: list[str]) -> None:
    limit = asyncio.Semaphore(32)

    async def one(name: str) -> None:
        async with limit:
            await support.ensure_node(api, name)

    await asyncio.gather(*(one(name) for name in names))


# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "first report (agent start to a watch seeing every device with its status)": "60 s",
    "writes for the first report": "2 per device",
    "API server CPU on the first report": None,
    "failed scans": "0",
    "no-op rescan": "0 writes",
    "restart of all agents": "0 writes",
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


async def bench_fleet(local: cluster.LocalCluster, hosts: dict[str, fakesysfs.FakeHost], per_node: int, rounds: int,
                      pci_ids: PciIds, jitter: float) -> None:  # fmt: skip
    api = await connect(str(local.kubeconfig))
    meter = Meter(api, local)
    watcher = Reported(api)
    watching = asyncio.create_task(watcher.run())
    nodes, total = len(hosts), len(hosts) * per_node
    try:
        started = time.monotonic()
        await create_nodes(api, list(hosts))
        print(f"nodes created:            {nodes} in {time.monotonic() - started:.1f} s")
        print(f"fleet:                    {nodes} nodes x {per_node} devices = {total} NodePCIDevices, "
              f"one agent and API client per node in one event loop, all started at once, each waiting up to "
              f"{jitter:g} s at random before its first request (the agent's start-up jitter)")

        await support.quiet(api, WATCHED, settle=1)
        fleet = Fleet(local.kubeconfig, hosts, pci_ids, jitter)
        started = time.monotonic()
        await fleet.connect()
        print(f"API clients:              {nodes} made in {time.monotonic() - started:.1f} s (kubeconfig read, "
              f"TLS context; before the agents start, outside the figures below)")
        await meter.start()
        started = time.monotonic()
        fleet.start()
        await watcher.until(total, fleet)
        first = time.monotonic() - started
        await fleet.scanned(1)
        await support.quiet(api, WATCHED, settle=2)
        await meter.stop()
        print(f"first report:             {first:.1f} s from agent start until a watch saw all {total} "
              f"NodePCIDevices with their status")
        devices = meter.writes[("nodepcidevices", "", "APPLY")] + meter.writes[("nodepcidevices", "status", "APPLY")]
        print(f"first report writes:      {meter.total():g} ({devices / total:.2f} per device; {meter.breakdown()})")
        apiserver = meter.spent["kube-apiserver"]
        print(f"first report CPU:         {meter.cpu()}")
        print(f"failed scans:             {failed_scans():g} (timed out or refused: each retried with backoff, 2.5 s doubling to 60 s, jittered; "
              f"and a write it made may be made again)")
        print(f"API server CPU:           {apiserver / total * 1000:.2f} s per 1,000 devices on first report; "
              f"this process {meter.spent['this process'] / nodes * 1000:.0f} ms per agent")
        labels = list(GOALS)
        MEASURED[labels[0]] = f"{first:.1f} s ({total:,} devices)"
        MEASURED[labels[1]] = f"{meter.total():,.0f}: {devices / total:.2f} per device ({meter.breakdown()})"
        MEASURED[labels[2]] = (f"{apiserver / total * 1000:.2f} s per 1,000 devices; "
                               f"this process {meter.spent['this process'] / nodes * 1000:.0f} ms per agent")

        times = []
        await meter.start()
        for _ in range(rounds):
            started = time.monotonic()
            await fleet.rescan()
            times.append(time.monotonic() - started)
        await asyncio.sleep(1)  # a write the watch echoes back would land here
        await meter.stop()
        p50, p99 = support.p50_p99(times)
        print(f"no-op rescan writes:      {meter.total(rounds):g} per round across {nodes} nodes "
              f"({rounds} rounds: {meter.breakdown(rounds)})")
        print(f"no-op rescan round:       p50 {p50:.1f} s, p99 {p99:.1f} s (trigger to the last of {nodes} scans done)")
        MEASURED[labels[4]] = (f"{meter.total(rounds):g} writes per round across {nodes:,} nodes ({rounds} rounds); "
                               f"p50 {p50:.1f} s, p99 {p99:.1f} s from trigger to the last scan done")
        print(f"no-op rescan CPU:         {meter.cpu(rounds)} per round; API server "
              f"{meter.spent['kube-apiserver'] / rounds / total * 1000:.2f} s per 1,000 devices")
        await fleet.stop()

        await support.quiet(api, WATCHED, settle=1)
        restarted = Fleet(local.kubeconfig, hosts, pci_ids, jitter)
        await restarted.connect()
        await meter.start()
        started = time.monotonic()
        restarted.start()
        await restarted.scanned(1)
        elapsed = time.monotonic() - started
        await asyncio.sleep(1)
        await meter.stop()
        print(f"restart of all agents:    {elapsed:.1f} s to every first scan done, {meter.total():g} writes "
              f"({meter.breakdown()})")
        print(f"restart CPU:              {meter.cpu()}")
        print(f"failed scans:             {failed_scans():g} in all")
        MEASURED[labels[5]] = f"{elapsed:.1f} s to every first scan done, {meter.total():g} writes"
        MEASURED[labels[3]] = f"{failed_scans():g}"
        await restarted.stop()
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node (at most 239)")
    parser.add_argument("--rounds", type=int, default=3, help="no-op rescan rounds")
    parser.add_argument("--start-jitter", type=float, default=START_JITTER,
                        help=f"each agent's start-up jitter, seconds at most (default {START_JITTER:g}, as in a pod)")
    parser.add_argument("--pci-ids", type=Path, default=REPO / "e2e/data/pci.ids.2025-07-11")
    args = parser.parse_args()

    # Every agent holds a few connections (its watches, its writes): more than the usual 1,024 descriptors.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(f"machine:                  {cores()}")
    # The trees in memory where the machine has a tmpfs, as sysfs is: on disk, 1,000 of them take minutes to build.
    shm = Path("/dev/shm")
    trees = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, \
            tempfile.TemporaryDirectory(prefix="bench-fleet-trees-", dir=trees) as tree_root:  # fmt: skip
        root = Path(tmp)
        started = time.monotonic()
        hosts = {f"fleet-node-{i:04d}": gpu_host(Path(tree_root) / f"{i:04d}", args.devices_per_node)
                 for i in range(args.nodes)}  # fmt: skip
        print(f"fixture trees:            {args.nodes} built in {time.monotonic() - started:.1f} s under {tree_root}")
        local = cluster.start(root / "controlplane")
        try:
            asyncio.run(bench_fleet(local, hosts, args.devices_per_node, args.rounds, PciIds.load(args.pci_ids), args.start_jitter))
        finally:
            local.stop()
    print(f"peak RSS:                 {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          f"(this process: every agent, its client and the shared pci.ids)")
    print()
    print(page_table(MEASURED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
