"""Benchmark of one node agent: discovery, one agent process's memory and idle CPU, and hotplug latency.

    .venv/bin/python e2e/bench/bench_agent.py [--gpus 8] [--idle 310] [--hotplugs 40] [--discovery-devices 512]

A fleet of agents (1,000 nodes) is `bench_fleet.py`. What each figure means:
- discovery: `discover()` over a fixture tree of --discovery-devices PCI functions (GPUs, NICs,
  NVMe drives, root ports), p50 / p99 over --runs; pci.ids load: `PciIds.load` of the edition.
- one agent: `passthrough agent` as its own process over a fixture tree of --gpus GPUs (on
  vfio-pci), with its default flags (rescan every 5 minutes), against a real control plane:
  the time from exec to its NodePCIDevices listed with their status; its RSS 5 s later (and
  at the end); its CPU seconds over --idle seconds in which nothing changes (310 s by default:
  one periodic rescan and one restart of each 5-minute watch fall inside), extrapolated to an
  hour. Two side by side: reporting only (--no-device-plugin), and with its device plugins
  serving the GPU pool (no kubelet here, so they retry registration with backoff, as on a
  node whose kubelet is down).
- hotplug to visible: an Agent in this process with the hotplug listener on one end of a
  socket pair; each trial adds a GPU and its audio function to the tree and writes their
  `add` uevents, in the kernel's framing, to the other end (never the host's netlink socket
  or /sys); the time until a watch sees the GPU's NodePCIDevice with its status. The listener
  waits for 50 ms without another pci event (150 ms at most from the first) before it wakes a
  scan (a card's functions and their driver binds arrive as a burst), so that much of each
  figure is by design.

Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402

from e2e import cluster, fakesysfs, processes, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from passthrough.agent import uevent  # noqa: E402
from passthrough.agent.loop import Agent  # noqa: E402
from passthrough.api.labels import NODE_LABEL  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402
from passthrough.pci.discovery import discover  # noqa: E402
from passthrough.pci.naming import node_pci_device_name  # noqa: E402
from passthrough.pci.pciids import PciIds  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WATCHED = ("nodepcidevices", "nodes")


# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "pci.ids load": None,
    "discovery": None,
    "agent reporting only": None,
    "agent with device plugins": "RSS 50 MiB",
    "hotplug to visible (uevent to a watch seeing the NodePCIDevice with its status)": "p50 0.2 s",
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


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
    MEASURED["pci.ids load"] = f"{min(loads) * 1000:.0f} ms (best of 5)"
    MEASURED["discovery"] = (f"p50 {p50:.1f} ms, p99 {p99:.1f} ms over {runs} runs "
                             f"({len(found.devices)} functions, {reported} reported)")


class AgentRun:
    """`passthrough agent` as its own process (as a DaemonSet pod runs it, default rescan interval) over a tree of GPUs."""

    def __init__(self, local: cluster.LocalCluster, root: Path, name: str, gpus: int, pci_ids: Path, *args: str) -> None:
        self.name, self.gpus = name, gpus
        self.host = gpu_host(root / name, gpus)
        self.process = processes.AgentProcess(local, root / f"{name}.log", name, self.host, pci_ids, *args)

    async def start(self, api) -> float:
        """Seconds from exec to its NodePCIDevices listed with their status."""
        await support.ensure_node(api, self.name)
        kind = Custom(api, "nodepcidevices")
        started = time.monotonic()
        self.process.start()

        async def reported() -> bool:
            if not self.process.alive():
                raise AssertionError(f"agent exited:\n{self.process.output()[-3000:]}")
            items = (await kind.list(f"{NODE_LABEL}={self.name}"))["items"]
            return sum(bool((o.get("status") or {}).get("attributes")) for o in items) >= self.gpus

        await support.wait_for(reported, timeout=120, interval=0.05, what=f"the first report of {self.name}")
        self.psutil = psutil.Process(self.process.proc.pid)
        return time.monotonic() - started

    def rss(self) -> float:
        return self.psutil.memory_info().rss / 2**20

    def cpu(self) -> float:
        return sum(self.psutil.cpu_times()[:2])


async def bench_single(local: cluster.LocalCluster, root: Path, gpus: int, idle: float, pci_ids: Path) -> None:
    """Both agents run side by side (each its own process and node), so one idle window serves both."""
    api = await connect(str(local.kubeconfig))
    # Each serves its metrics, as the chart runs it (metrics.enabled, metrics.authentication), on
    # a port of its own here.
    ports = cluster.free_ports(2)
    runs = {
        "reporting only": AgentRun(local, root, "single-report", gpus, pci_ids, "--no-device-plugin",
                                   f"--metrics-port={ports[0]}", "--metrics-addr=127.0.0.1", "--metrics-auth"),
        "with device plugins": AgentRun(local, root, "single-plugins", gpus, pci_ids, f"--metrics-port={ports[1]}",
                                        "--metrics-addr=127.0.0.1", "--metrics-auth"),
    }  # fmt: skip
    try:
        firsts = {what: await run.start(api) for what, run in runs.items()}
        await asyncio.sleep(5)  # the handover's first rounds, the watches' first bookmarks
        rss = {what: run.rss() for what, run in runs.items()}
        before = {what: run.cpu() for what, run in runs.items()}
        await asyncio.sleep(idle)
        for what, run in runs.items():
            cpu = run.cpu() - before[what]
            rss[what] = max(rss[what], run.rss())
            spent = f"{cpu:.2f} s" if cpu >= 0.01 else "under 0.01 s (one clock tick)"
            print(f"one agent, {what + ':':<20} first report {firsts[what]:.1f} s after exec, RSS {rss[what]:.1f} MiB, "
                  f"CPU {spent} over {idle:.0f} s idle = {max(cpu, 0.01) * 3600 / idle:.1f} s per idle hour (extrapolated)")
            MEASURED[f"agent {what}"] = (f"first report {firsts[what]:.1f} s after exec; RSS {rss[what]:.1f} MiB; "
                                         f"{max(cpu, 0.01) * 3600 / idle:.1f} s CPU per idle hour")
    finally:
        for run in runs.values():
            run.process.stop()
        await api.close()


def kernel_uevent(action: str, address: str) -> bytes:
    """A pci uevent as the kernel frames it on the kobject-uevent netlink socket."""
    devpath = f"/devices/pci0000:00/{address}"
    return (f"{action}@{devpath}\0ACTION={action}\0DEVPATH={devpath}\0SUBSYSTEM=pci\0"
            f"PCI_SLOT_NAME={address}\0SEQNUM=1\0").encode()  # fmt: skip


async def bench_hotplug(local: cluster.LocalCluster, root: Path, gpus: int, trials: int, pci_ids: PciIds) -> None:
    """A GPU and its audio function appear (sysfs, then their uevents on a socket this process owns): the time
    until a watch sees the GPU's NodePCIDevice with its status."""
    api = await connect(str(local.kubeconfig))
    name = "hotplug-node"
    node = await support.ensure_node(api, name)
    host = gpu_host(root / name, gpus)
    agent = Agent(api, name, host.sysfs, host.proc, pci_ids, rescan_interval=3600)
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    seen: dict[str, float] = {}
    kind = Custom(api, "nodepcidevices")

    async def watch() -> None:
        async for _, obj in kind.watch(f"{NODE_LABEL}={name}", timeout=600):
            if (obj.get("status") or {}).get("attributes"):
                seen.setdefault(obj["metadata"]["name"], time.monotonic())

    tasks = [asyncio.create_task(agent.run()), asyncio.create_task(uevent.listen(agent.trigger, sock=ours)),
             asyncio.create_task(watch())]  # fmt: skip
    try:
        await support.wait_for(lambda: asyncio.sleep(0, len(seen) >= gpus), timeout=60, what="the first report")
        await support.quiet(api, WATCHED, settle=1)
        latencies = []
        for k in range(trials):
            bus, group = f"{0x80 + k:02x}", 1000 + k
            address = f"0000:{bus}:00.0"
            host.add_root_port(f"0000:00:{0x10 + k // 8:02x}.{k % 8}", bus, iommu_group=group + 500)
            host.add_device(address, "10de", "2236", "030200", driver="nvidia", iommu_group=group, subsystem=("10de", "1482"))
            host.add_device(f"0000:{bus}:00.1", "10de", "1aef", "040300", driver="snd_hda_intel", iommu_group=group,
                            subsystem=("10de", "1482"))  # fmt: skip
            device = node_pci_device_name(address, "10de", "2236", node.name)
            started = time.monotonic()
            kernel.send(kernel_uevent("add", address))
            kernel.send(kernel_uevent("add", f"0000:{bus}:00.1"))
            await support.wait_for(lambda: asyncio.sleep(0, device in seen), timeout=30, interval=0.002,
                                   what=f"{device} reported")  # fmt: skip
            latencies.append(seen[device] - started)
            await support.quiet(api, WATCHED, settle=0.5)
        p50, p99 = support.p50_p99([s * 1000 for s in latencies])
        print(f"hotplug to visible:       p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {max(latencies) * 1000:.0f} ms over "
              f"{trials} GPUs added (uevents to a watch seeing the NodePCIDevice with its status)")
        MEASURED[list(GOALS)[-1]] = (f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {max(latencies) * 1000:.0f} ms "
                                     f"over {trials} GPUs added")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        kernel.close()
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="GPUs on each simulated node (at most 239)")
    parser.add_argument("--discovery-devices", type=int, default=512, help="PCI functions in the discovery tree")
    parser.add_argument("--runs", type=int, default=50, help="discovery runs")
    parser.add_argument("--idle", type=float, default=310,
                        help="seconds of idle over which an agent's CPU is measured (310: one rescan and one restart of each watch)")
    parser.add_argument("--hotplugs", type=int, default=40, help="GPUs hot-added one after the other")
    parser.add_argument("--pci-ids", type=Path, default=REPO / "e2e/data/pci.ids.2025-07-11")
    args = parser.parse_args()

    print(f"machine:                  {len(os.sched_getaffinity(0))} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        root = Path(tmp)
        bench_discovery(root / "discovery", args.discovery_devices, args.runs, args.pci_ids)
        local = cluster.start(root / "controlplane")
        try:
            asyncio.run(bench_single(local, root / "single", args.gpus, args.idle, args.pci_ids))
            asyncio.run(bench_hotplug(local, root / "hotplug", args.gpus, args.hotplugs, PciIds.load(args.pci_ids)))
        finally:
            local.stop()
    print()
    print(page_table(MEASURED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
