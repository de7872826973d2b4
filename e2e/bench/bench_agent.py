"""Benchmark of the node agent: discovery, and a fleet of agents against a real control plane.

    .venv/bin/python e2e/bench/bench_agent.py [--nodes 100] [--devices-per-node 8] [--discovery-devices 512]

What each figure means:
- discovery: `discover()` over a fixture tree of --discovery-devices PCI functions (GPUs, NICs,
  NVMe drives, root ports), p50 / p99 over --runs; pci.ids load: `PciIds.load` of the edition.
- first report: --nodes agents (one Agent, one API client and one fixture tree of
  --devices-per-node GPUs per node, all in this process and event loop) start together; the
  time until listing NodePCIDevices through the API shows every device with its status, and
  the writes the API server counted for it (nodepcidevices and nodes).
- no-op rescan: every agent rescans unchanged hardware (SIGHUP's path, `trigger()`); the
  writes the API server counted per round across all nodes (0 when the diff works) and the
  time from the trigger to the last agent's scan done, p50 / p99 over --rounds.
- restart: all agents stopped and replaced by new Agent objects (empty caches, as after a
  pod restart) running until their first scan is done; writes (0 when the agent reads what
  is there before writing) and time.
- CPU: seconds spent by this process (every agent), the API server and etcd over each of
  the three; with all agents in one Python process the agents' side is the bottleneck on a
  small machine, so the times are an upper bound on what separate agent pods would see.
- peak RSS of this process, which holds every agent.

Nothing is asserted: a write where 0 is expected is printed, with the API server's breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402

from e2e import cluster, fakesysfs, support  # noqa: E402
from passthrough.agent.loop import Agent, ScanResult  # noqa: E402
from passthrough.k8s import NODE_LABEL, Custom, connect  # noqa: E402
from passthrough.pci.discovery import discover  # noqa: E402
from passthrough.pci.pciids import PciIds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WATCHED = ("nodepcidevices", "nodes")


def gpu_host(root: Path, gpus: int) -> fakesysfs.FakeHost:
    """A GPU server: `gpus` H100s bound to vfio-pci, each behind its own root port and in its own group."""
    host = fakesysfs.FakeHost(root)
    for i in range(gpus):
        bus = f"{0x10 + i:02x}"
        host.add_root_port(f"0000:00:{1 + i // 8:02x}.{i % 8}", bus, iommu_group=2 * i)
        host.add_device(f"0000:{bus}:00.0", "10de", "2330", "030200", driver="vfio-pci", iommu_group=2 * i + 1,
                        numa_node=i % 2)  # fmt: skip
    return host


def bench_discovery(root: Path, devices: int, runs: int, pci_ids_path: Path) -> None:
    host = fakesysfs.synthetic_host(root, devices)
    loads = []
    for _ in range(5):
        started = time.perf_counter()
        pci_ids = PciIds.load(pci_ids_path)
        loads.append(time.perf_counter() - started)
    samples = []
    for _ in range(runs + 1):
        started = time.perf_counter()
        found = discover(host.sysfs, host.proc, pci_ids)
        samples.append(time.perf_counter() - started)
    p50, p99 = support.p50_p99([s * 1000 for s in samples[1:]])  # the first run warms the dentry cache
    reported = sum(d.reported for d in found.devices)
    print(f"pci.ids load:             {min(loads) * 1000:.0f} ms (best of 5, {pci_ids_path.name})")
    print(f"discovery:                p50 {p50:.1f} ms, p99 {p99:.1f} ms over {runs} runs "
          f"({len(found.devices)} functions, {reported} reported)")


def record_scans(agent: Agent) -> list[ScanResult]:
    """The results of the scans the agent's own loop finishes (`Agent.scans` counts scans begun)."""
    results: list[ScanResult] = []
    scan = agent.scan

    async def recorded() -> ScanResult:
        result = await scan()
        results.append(result)
        return result

    agent.scan = recorded
    return results


class Fleet:
    """One running Agent per node, each with its own API client, as separate agent pods would have."""

    def __init__(self, kubeconfig: Path, hosts: dict[str, fakesysfs.FakeHost], pci_ids: PciIds) -> None:
        self.kubeconfig, self.hosts, self.pci_ids = kubeconfig, hosts, pci_ids
        self.clients: list = []
        self.agents: list[Agent] = []
        self.tasks: list[asyncio.Task] = []
        self.scans: list[list[ScanResult]] = []

    async def start(self) -> None:
        self.clients = [await connect(str(self.kubeconfig)) for _ in self.hosts]
        self.agents = [Agent(api, name, host.sysfs, host.proc, self.pci_ids, rescan_interval=3600)
                       for api, (name, host) in zip(self.clients, self.hosts.items(), strict=True)]  # fmt: skip
        self.scans = [record_scans(agent) for agent in self.agents]
        self.tasks = [asyncio.create_task(agent.run()) for agent in self.agents]

    async def scanned(self, count: int) -> None:
        """Wait until every agent has finished `count` scans."""
        async def done() -> bool:
            for task in self.tasks:
                if task.done():
                    task.result()  # an agent that died: its exception, not a timeout
            return all(len(s) >= count for s in self.scans)

        await support.wait_for(done, timeout=600, interval=0.005, what=f"scan {count} of every agent")

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


async def reported(api, count: int) -> bool:
    items = (await Custom(api, "nodepcidevices").list(NODE_LABEL))["items"]
    return sum(bool((o.get("status") or {}).get("attributes")) for o in items) >= count


class Meter:
    """Over a span: the writes the API server counted, and the CPU time of this process and the control plane."""

    def __init__(self, api, local: cluster.LocalCluster) -> None:
        self.api = api
        self.processes = {"this process": psutil.Process(),
                          **{p.name: psutil.Process(p.pid) for p in local.processes if p.name != "kube-controller-manager"}}  # fmt: skip

    def _cpu(self) -> dict[str, float]:
        return {name: sum(p.cpu_times()[:2]) for name, p in self.processes.items()}

    async def start(self) -> None:
        self.counts, self.cpu = await support.write_counts(self.api), self._cpu()

    async def stop(self, per: int = 1) -> tuple[float, str, str]:
        """Writes, their breakdown and the CPU seconds spent, each divided by `per`."""
        counts, cpu = await support.write_counts(self.api), self._cpu()
        changes = {k: n for k, n in support.diff(self.counts, counts).items() if k[0] in WATCHED}
        breakdown = ", ".join(f"{resource} {verb} {n / per:g}" for (resource, verb), n in sorted(changes.items()))
        spent = ", ".join(f"{name} {(cpu[name] - self.cpu[name]) / per:.2f} s" for name in cpu)
        return sum(changes.values()) / per, breakdown or "none", spent


async def bench_fleet(local: cluster.LocalCluster, root: Path, nodes: int, per_node: int, rounds: int, pci_ids: PciIds) -> None:
    api = await connect(str(local.kubeconfig))
    meter = Meter(api, local)
    try:
        names = [f"bench-node-{i:03d}" for i in range(nodes)]
        for name in names:
            await support.ensure_node(api, name)
        hosts = {name: gpu_host(root / name, per_node) for name in names}
        total = nodes * per_node
        print(f"fleet:                    {nodes} nodes x {per_node} devices = {total} NodePCIDevices, "
              f"one agent and API client per node in one event loop")

        await support.quiet(api, WATCHED, settle=1)
        fleet = Fleet(local.kubeconfig, hosts, pci_ids)
        await meter.start()
        started = time.monotonic()
        await fleet.start()
        await support.wait_for(lambda: reported(api, total), timeout=600, interval=0.2, what=f"{total} NodePCIDevices")
        first = time.monotonic() - started
        await fleet.scanned(1)
        await support.quiet(api, WATCHED, settle=2)
        writes, breakdown, cpu = await meter.stop()
        print(f"first report:             {first:.1f} s from agent start to {total} NodePCIDevices listed "
              f"(polled every 0.2 s)")
        print(f"first report writes:      {writes:g} ({writes / total:.2f} per device: {breakdown})")
        print(f"first report CPU:         {cpu}")

        times = []
        await meter.start()
        for _ in range(rounds):
            started = time.monotonic()
            await fleet.rescan()
            times.append(time.monotonic() - started)
        await asyncio.sleep(1)  # a write the watch echoes back would land here
        writes, breakdown, cpu = await meter.stop(per=rounds)
        p50, p99 = support.p50_p99(times)
        print(f"no-op rescan writes:      {writes:g} per round across {nodes} nodes ({rounds} rounds: {breakdown})")
        print(f"no-op rescan round:       p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms "
              f"(trigger to the last of {nodes} scans done)")
        print(f"no-op rescan CPU:         {cpu} per round")
        await fleet.stop()

        await support.quiet(api, WATCHED, settle=1)
        restarted = Fleet(local.kubeconfig, hosts, pci_ids)
        await meter.start()
        started = time.monotonic()
        await restarted.start()
        await restarted.scanned(1)
        elapsed = time.monotonic() - started
        await asyncio.sleep(1)
        writes, breakdown, cpu = await meter.stop()
        print(f"restart of all agents:    {elapsed:.1f} s to every first scan done, {writes:g} writes ({breakdown})")
        print(f"restart CPU:              {cpu}")
        await restarted.stop()
    finally:
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--devices-per-node", type=int, default=8, help="GPUs per node (at most 239)")
    parser.add_argument("--discovery-devices", type=int, default=512, help="PCI functions in the discovery tree")
    parser.add_argument("--runs", type=int, default=50, help="discovery runs")
    parser.add_argument("--rounds", type=int, default=5, help="no-op rescan rounds")
    parser.add_argument("--pci-ids", type=Path, default=REPO / "e2e/data/pci.ids.2025-07-11")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        root = Path(tmp)
        bench_discovery(root / "discovery", args.discovery_devices, args.runs, args.pci_ids)
        local = cluster.start(root / "controlplane")
        try:
            asyncio.run(bench_fleet(local, root / "nodes", args.nodes, args.devices_per_node, args.rounds,
                                    PciIds.load(args.pci_ids)))  # fmt: skip
        finally:
            local.stop()
    print(f"peak RSS:                 {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          f"(this process: every agent, its client and the shared pci.ids)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
