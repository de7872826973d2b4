"""Benchmark of the operator's device lifecycle against the real control plane.

    python e2e/bench/bench_operator.py [--devices 2000] [--sequential 200] [--burst 500] [--idle 120]

With N NodePCIDevices reported (as node agents write them) and the operator running as its
own process, it prints:

- assignment latency, from the admin's spec write returning to the PCIDevice being visible
  through a watch: p50/p99 for assignments made one at a time, and for a burst made at once;
- the burst's total time beside a floor measured in the same run: the same creates and
  status writes (PCIDevice apply, PCIDevice status, NodePCIDevice status) done by a plain
  kubernetes-asyncio client at full concurrency, with no operator in the way;
- API writes per assignment (from the API server's own counters, the admin's spec write
  excluded), Events counted apart;
- writes during an idle period (must be 0), writes at operator start-up, and the
  operator's peak RSS (VmHWM).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from e2e import cluster as local  # noqa: E402
from e2e import support  # noqa: E402
from e2e.processes import OperatorProcess  # noqa: E402
from passthrough.api.models import API_VERSION  # noqa: E402
from passthrough.k8s import Custom, connect  # noqa: E402

OURS = ("pcidevices", "nodepcidevices")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(cluster: local.LocalCluster, operator: OperatorProcess) -> dict[str, float]:
    """CPU time (user + system) so far of the operator and the control-plane processes."""
    pids = {"operator": operator.proc.pid, **{p.name: p.pid for p in cluster.processes}}
    times = {name: psutil.Process(pid).cpu_times() for name, pid in pids.items()}
    return {name: t.user + t.system for name, t in times.items()}


class Seen:
    """Watches PCIDevices and records when each name first appears."""

    def __init__(self, api) -> None:
        self.kind = Custom(api, "pcidevices", namespaced=True)
        self.first: dict[str, float] = {}
        self.waiters: dict[str, asyncio.Event] = {}

    async def run(self) -> None:
        rv = ""
        while True:
            try:
                if not rv:
                    listing = await self.kind.list()
                    rv = listing["metadata"]["resourceVersion"]
                    for obj in listing["items"]:
                        self._saw(obj["metadata"]["name"])
                async for kind, obj in self.kind.watch(resource_version=rv, timeout=600):
                    rv = obj["metadata"].get("resourceVersion", rv)
                    if kind == "ADDED":
                        self._saw(obj["metadata"]["name"])
            except client.exceptions.ApiException as exc:  # 410 too old, 429 storage initializing
                if exc.status == 410:
                    rv = ""
                await asyncio.sleep(0.2)

    def _saw(self, name: str) -> None:
        self.first.setdefault(name, time.monotonic())
        if name in self.waiters:
            self.waiters[name].set()

    async def wait(self, name: str, timeout: float = 60) -> float:
        if name not in self.first:
            event = self.waiters.setdefault(name, asyncio.Event())
            await asyncio.wait_for(event.wait(), timeout)
        return self.first[name]


async def assign(api, name: str, namespace: str) -> float:
    await support.assign(api, name, namespace)
    return time.monotonic()


async def floor(api, names: list[str], namespace: str, node_devices: dict[str, dict]) -> float:
    """The operator's three writes per assignment, by a plain client at full concurrency."""
    devices, npci = Custom(api, "pcidevices", namespaced=True), Custom(api, "nodepcidevices")

    async def one(name: str) -> None:
        owner = node_devices[name]
        meta = {"name": f"floor-{name}", "namespace": namespace}
        await devices.apply({"apiVersion": API_VERSION, "kind": "PCIDevice", "metadata": {
            **meta, "labels": {"passthrough.io/node": owner["status"]["attributes"]["nodeName"]},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": "NodePCIDevice", "name": name,
                                 "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]}},
            "bench-floor")
        await devices.apply({"apiVersion": API_VERSION, "kind": "PCIDevice", "metadata": meta,
                             "status": {"attributes": owner["status"]["attributes"], "resourceName": f"passthrough.io/{name}"}},
                            "bench-floor", status=True)
        await npci.apply({"apiVersion": API_VERSION, "kind": "NodePCIDevice", "metadata": {"name": name}, "status": {
            "conditions": [{"type": "BenchFloor", "status": "True", "reason": "Floor", "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}, "bench-floor", status=True)

    started = time.monotonic()
    await asyncio.gather(*(one(n) for n in names))
    return time.monotonic() - started


async def run(args, cluster: local.LocalCluster, workdir: Path) -> None:
    api = await connect(str(cluster.kubeconfig))
    npci = Custom(api, "nodepcidevices")
    namespaces = [f"bench-{i}" for i in range(10)] + ["bench-floor"]
    for ns in namespaces:
        await support.create_namespace(api, ns)

    per_node = 100
    limit = asyncio.Semaphore(32)
    nodes = [await support.ensure_node(api, f"bench-node-{i}") for i in range((args.devices + per_node - 1) // per_node)]

    async def report(i: int) -> str:
        node = nodes[i // per_node]
        j = i % per_node
        async with limit:
            return await support.report_device(api, node, support.gpu(f"0000:{j // 8 + 1:02x}:{j % 8:02x}.0"))

    started = time.monotonic()
    names = await asyncio.gather(*(report(i) for i in range(args.devices)))
    print(f"setup: {args.devices} NodePCIDevices written as agents would in {time.monotonic() - started:.1f}s")

    before = await support.write_counts(api)
    operator = OperatorProcess(cluster, workdir / "operator.log", *args.operator_args)
    started = time.monotonic()
    operator.start()

    async def all_conditioned() -> bool:
        items = (await npci.list())["items"]
        return all(any(c["type"] == "Assigned" for c in (d.get("status") or {}).get("conditions", [])) for d in items)

    await support.wait_for(all_conditioned, 600, interval=0.5, what="initial conditions on every device")
    await support.quiet(api, OURS + ("events",), settle=3, timeout=600)
    after = await support.write_counts(api)
    print(f"operator start-up: initial conditions of {args.devices} devices written within {time.monotonic() - started - 3:.1f}s, "
          f"{support.writes_between(before, after, *OURS)} writes")

    seen = Seen(api)
    watcher = asyncio.create_task(seen.run())
    await asyncio.sleep(1)
    try:
        # One at a time.
        sequential = names[: args.sequential]
        before = await support.write_counts(api)
        latencies = []
        for i, name in enumerate(sequential):
            written = await assign(api, name, namespaces[i % 10])
            latencies.append(await seen.wait(name) - written)
        await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
        after = await support.write_counts(api)
        writes = support.writes_between(before, after, *OURS) - len(sequential)  # the admin's own spec writes
        events = support.writes_between(before, after, "events")
        print(f"sequential: {len(sequential)} assignments one at a time: latency p50 {support.p50_p99(latencies)[0] * 1000:.0f} ms, "
              f"p99 {support.p50_p99(latencies)[1] * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms")
        print(f"writes per assignment: {writes / len(sequential):.2f} "
              f"(PCIDevice create + status, NodePCIDevice status), plus {events / len(sequential):.2f} Events")

        # A burst.
        burst = names[args.sequential: args.sequential + args.burst]
        before = await support.write_counts(api)
        cpu_before = cpu_seconds(cluster, operator)
        burst_started = time.monotonic()
        written_at = await asyncio.gather(*(assign(api, name, namespaces[i % 10]) for i, name in enumerate(burst)))
        seen_at = await asyncio.gather(*(seen.wait(name, 300) for name in burst))
        total = max(seen_at) - burst_started
        cpu = {k: v - cpu_before[k] for k, v in cpu_seconds(cluster, operator).items()}
        burst_latencies = [s - w for s, w in zip(seen_at, written_at, strict=True)]
        await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
        after = await support.write_counts(api)
        burst_writes = support.writes_between(before, after, *OURS) - len(burst)
        print(f"burst: {len(burst)} assignments at once: latency p50 {support.p50_p99(burst_latencies)[0] * 1000:.0f} ms, "
              f"p99 {support.p50_p99(burst_latencies)[1] * 1000:.0f} ms; all visible {total:.2f}s after the first write; "
              f"{burst_writes / len(burst):.2f} writes per assignment")
        print(f"burst CPU until all visible ({total:.1f}s wall, 2 cores): "
              + ", ".join(f"{k} {v:.1f}s" for k, v in cpu.items()))

        # The floor: the same writes, no operator logic, full concurrency.
        node_devices = {d["metadata"]["name"]: d for d in (await npci.list())["items"]}
        floor_names = names[args.sequential + args.burst: args.sequential + 2 * args.burst]
        if len(floor_names) < len(burst):
            floor_names = burst
        floor_time = await floor(api, floor_names, "bench-floor", node_devices)
        print(f"floor: the same {3 * len(floor_names)} writes by a plain client at full concurrency: {floor_time:.2f}s "
              f"(burst/floor {total / floor_time:.1f}x)")

        # Idle.
        await support.quiet(api, OURS + ("events",), settle=3, timeout=300)
        before = await support.write_counts(api)
        await asyncio.sleep(args.idle)
        after = await support.write_counts(api)
        print(f"idle: writes during {args.idle:.0f}s with nothing to do: "
              f"{support.writes_between(before, after, *OURS, 'events', 'passthroughconfigs', 'kubevirts')}")
        print(f"operator peak RSS: {peak_rss_mib(operator.proc.pid):.0f} MiB (VmHWM) with {args.devices} NodePCIDevices, "
              f"{len(seen.first)} PCIDevices")
    finally:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        operator.stop()
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=2000)
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--idle", type=float, default=120, help="seconds of idleness to count writes over")
    parser.add_argument("--operator-args", nargs="*", default=[], help="extra arguments for passthrough operator")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = local.start(Path(tmp))
        try:
            asyncio.run(run(args, cluster, Path(tmp)))
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
