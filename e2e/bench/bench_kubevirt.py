"""Benchmark of the operator keeping the KubeVirt CR in line with the PassthroughConfig.

    .venv/bin/python e2e/bench/bench_kubevirt.py [--changes 50] [--noops 10] [--entries 2000] [--big-runs 3]

The operator runs as its own process against a real control plane, with a KubeVirt CR in
namespace `kubevirt` and the `cluster` PassthroughConfig naming it. What each figure means:
- writes per config change: --changes edits of the config (alternately a new
  extraFeatureGates value and one more pciHostDevices entry), each waited for until the CR and
  the config's status show it; the API server's write counters over all of them, divided by
  the number of changes, with the benchmark's own config writes taken out. Separately:
  the KubeVirt CR, the config's status, anything else the operator writes to the config, and
  Events.
- writes per no-op event: --noops annotations touched on the config, then --noops labels
  on the CR, 0.5 s apart (longer than the operator's 0.2 s debounce, so each is handled on
  its own); the operator's writes per event, those patches themselves taken out.
- latency: from just before the config write to the arrival (on a watch) of the CR that
  shows it, p50 / p99 over the changes; each write comes 0.5 s after the last one landed,
  so it waits out the whole debounce as an admin's edit would.
- a large config: the config rewritten with --entries user pciHostDevices entries (all new
  each run); the time until the CR shows all of them, and the operator's writes.
- the CR's ceiling: the operator's apply body for --ceiling assigned devices (10,000; one
  exclusive entry each, after the default table) applied under the operator's field manager
  to a KubeVirt CR of its own (which the apply makes: without an install's other fields), and read back: the CR's size as stored (compact JSON, which is
  what etcd holds for a custom resource), bytes per assigned device, whether the render warns
  (the config's status.warnings), and then --ceiling-step more devices at a time until the
  API server refuses the write, which is where etcd's request limit (1.5 MiB) stops it.
Render-only timings are bench_render.py's.

Nothing is asserted: the figures are printed, with the API server's breakdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from e2e import cluster, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.processes import OperatorProcess  # noqa: E402
from passthrough.kube.cache import Mirror  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.custom import Custom  # noqa: E402

NAMESPACE = "kubevirt"
MERGE = "application/merge-patch+json"
TOUCHED = ("kubevirts", "passthroughconfigs", "events")
# Longer than the operator's 0.2 s debounce: each write finds it idle, none rides on a pending sync.
IDLE = 0.5
CONFIG_WRITE = ("passthroughconfigs", "", "APPLY")  # the benchmark's own, as counted by the API server
# Each figure as the performance page labels it, with its goal (None: none set); the page's
# section shares its table with bench_render.py.
GOALS: dict[str, str | None] = {
    "config write to the KubeVirt CR showing it": None,
    "writes per config change": "3",
    "writes per no-op event": "0",
    "user entries written to the CR showing them all": None,
    "KubeVirt CR ceiling": "warned from 1 MiB",
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.page(table.table(table.figure_rows(measured, GOALS)), **lead)


class WatchedKubeVirt:
    """The KubeVirt CR as a watch delivers it, so a change is timed when it arrives, not when polled."""

    def __init__(self, api: client.ApiClient) -> None:
        self.mirror = Mirror(Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1"))

    @property
    def latest(self) -> dict | None:
        return self.mirror.objects.get("kubevirt")

    async def shows(self, check: Callable[[dict], bool], timeout: float = 120) -> float:
        """Wait until the CR passes `check`; returns the monotonic time that version arrived."""

        async def arrival() -> float:
            while True:
                self.mirror.changed.clear()
                if self.latest and check(self.latest):
                    return time.monotonic()
                await self.mirror.changed.wait()

        async with asyncio.timeout(timeout):
            return await arrival()


def pci_list(kv: dict) -> list[dict]:
    return ((kv["spec"]["configuration"].get("permittedHostDevices") or {}).get("pciHostDevices")) or []


def feature_gates(kv: dict) -> list[str]:
    return kv["spec"]["configuration"].get("developerConfiguration", {}).get("featureGates") or []


def entry(i: int, prefix: str = "bench") -> dict:
    # Vendor 1af4 keeps clear of the default table's 10de selectors.
    return {"pciVendorSelector": f"1AF4:{i:04X}", "resourceName": f"example.com/{prefix}-{i}", "externalResourceProvider": True}


class Bench:
    """The `cluster` PassthroughConfig as the benchmark edits it, and the three measurements over it."""

    def __init__(self, api: client.ApiClient, kubevirt: WatchedKubeVirt) -> None:
        self.api, self.kubevirt = api, kubevirt
        self.configs = Custom(api, "passthroughconfigs")
        self.spec: dict = {"kubevirt": {"name": "kubevirt", "namespace": NAMESPACE}}

    async def write_config(self) -> int:
        """Apply `self.spec` as the admin would; returns the generation to wait for."""
        body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                "spec": self.spec}  # fmt: skip
        return (await self.configs.apply(body, "admin"))["metadata"]["generation"]

    async def change(self, check: Callable[[dict], bool]) -> float:
        """Write the config; wait until the CR and the config's status show it. Returns the latency."""
        await asyncio.sleep(IDLE)
        started = time.monotonic()
        generation = await self.write_config()
        arrived = await self.kubevirt.shows(check)

        async def observed() -> bool:
            status = (await self.configs.get("cluster")).get("status") or {}
            return status.get("observedGeneration") == generation

        await support.wait_for(observed, 60, 0.05, what=f"status of generation {generation}")
        return arrived - started

    async def counted(self) -> Counter:
        await support.quiet(self.api, TOUCHED, settle=1.5)
        return await support.write_counts_by_subresource(self.api)

    async def changes(self, count: int) -> None:
        before = await self.counted()
        latencies = []
        user: list[dict] = []
        for i in range(count):
            if i % 2 == 0:
                gate = f"Bench{i}"
                self.spec["kubevirt"]["extraFeatureGates"] = [gate]
                latencies.append(await self.change(lambda kv, gate=gate: gate in feature_gates(kv)))
            else:
                user.append(entry(i))
                self.spec["gpu"] = {"permittedHostDevices": {"pciHostDevices": list(user)}}
                latencies.append(await self.change(lambda kv, want=user[-1]: want in pci_list(kv)))
        writes = operator_writes(before, await self.counted(), own={CONFIG_WRITE: count})
        p50, p99 = support.p50_p99([s * 1000 for s in latencies])
        print(f"writes per config change: {sum(writes.values()) / count:g} ({describe(writes, count)}; "
              f"{count} changes, the benchmark's own config writes left out)")
        print(f"config write to CR:       p50 {p50:.0f} ms, p99 {p99:.0f} ms over {count} changes (watch arrival)")
        MEASURED["config write to the KubeVirt CR showing it"] = f"p50 {p50:.0f} ms, p99 {p99:.0f} ms over {count} changes"
        MEASURED["writes per config change"] = f"{sum(writes.values()) / count:g} ({describe(writes, count)})"

    async def noops(self, count: int) -> None:
        objects = client.CustomObjectsApi(self.api)

        async def annotate_config(i: int) -> None:
            body = {"metadata": {"annotations": {"bench/touched": str(i)}}}
            await objects.patch_cluster_custom_object("passthrough.io", "v1alpha1", "passthroughconfigs", "cluster", body,
                                                      _content_type=MERGE)  # fmt: skip

        async def label_kubevirt(i: int) -> None:
            body = {"metadata": {"labels": {"bench/touched": str(i)}}}
            await objects.patch_namespaced_custom_object("kubevirt.io", "v1", NAMESPACE, "kubevirts", "kubevirt", body,
                                                         _content_type=MERGE)  # fmt: skip

        per_event = {}
        for what, patch, resource in (("config annotation", annotate_config, "passthroughconfigs"),
                                      ("CR label", label_kubevirt, "kubevirts")):  # fmt: skip
            before = await self.counted()
            for i in range(count):
                await patch(i)
                await asyncio.sleep(IDLE)
            writes = operator_writes(before, await self.counted(), own={(resource, "", "PATCH"): count})
            print(f"writes per no-op event:   {sum(writes.values()) / count:g} per {what} "
                  f"({describe(writes, count)}; {count} events, the patches themselves left out)")
            per_event[what] = sum(writes.values()) / count
        MEASURED["writes per no-op event"] = (f"{max(per_event.values()):g} ("
                                              + ", ".join(f"{n:g} per {what}" for what, n in per_event.items()) + ")")

    async def large(self, entries: int, runs: int) -> None:
        times, writes = [], Counter()
        for n in range(runs):
            big = [entry(i, f"big{n}") for i in range(entries)]
            self.spec["gpu"] = {"permittedHostDevices": {"pciHostDevices": big}}
            before = await self.counted()
            times.append(await self.change(lambda kv, last=big[-1]: last in pci_list(kv)))
            writes += operator_writes(before, await self.counted(), own={CONFIG_WRITE: 1})
        shown = self.kubevirt.latest
        print(f"large config:             {', '.join(f'{t:.2f} s' for t in times)} from writing {entries} user entries "
              f"to the CR showing all {len(pci_list(shown))}")
        print(f"                          ({runs} runs, all entries new each run; CR {len(json.dumps(shown)) / 1024:.0f} KiB)")
        print(f"large config writes:      {sum(writes.values()) / runs:g} per run ({describe(writes, runs)})")
        MEASURED["user entries written to the CR showing them all"] = (
            f"{entries:,} entries, all {len(pci_list(shown)):,} shown in {min(times):.2f} to {max(times):.2f} s "
            f"(CR {len(json.dumps(shown)) / 1024:.0f} KiB)"
        )


async def ceiling(api: client.ApiClient, count: int, step: int) -> None:
    """The KubeVirt CR at `count` assigned devices, then `step` more at a time until refused."""
    import hashlib

    from passthrough.kube.client import ApiError
    from passthrough.kube.custom import OPERATOR_MANAGER
    from passthrough.kubevirt.allowlist import AssignedDevice
    from passthrough.kubevirt.render import render
    from passthrough.kubevirt.values import parse_values

    kind = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    values = parse_values({"kubevirt": {"namespace": NAMESPACE, "name": "ceiling"}})
    devices = count
    while True:
        # Names as the agents make them (pci- + 40 hex digits), one A10 model for all.
        assigned = [AssignedDevice(f"pci-{hashlib.sha1(str(i).encode()).hexdigest()}", "10de", "2236") for i in range(devices)]
        rendered = render(values, assigned)
        try:
            stored = await kind.apply(rendered.patch, OPERATOR_MANAGER)
        except ApiError as exc:
            print(f"                          {devices} assigned devices: refused ({exc.status} {exc.message[:120]})")
            refused = f"{devices:,} refused by the API server ({exc.status})"
            MEASURED["KubeVirt CR ceiling"] = "; ".join(filter(None, [MEASURED.get("KubeVirt CR ceiling"), refused]))
            return
        size = len(json.dumps(stored, separators=(",", ":")).encode())
        warned = [w for w in rendered.warnings if "etcd" in w]
        if devices == count:
            print(f"KubeVirt CR ceiling:      {size / 2**20:.2f} MiB stored at {devices} assigned devices "
                  f"({len(rendered.pci_host_devices)} pciHostDevices entries; our apply body {rendered.size / 2**20:.2f} MiB, "
                  f"{(rendered.size - render(values, []).size) / devices:.0f} bytes per assigned device); the config "
                  f"{'warns: ' + warned[0][:160] + '...' if warned else 'does not warn'}")
            head = (f"{size / 2**20:.2f} MiB at {devices:,} assigned devices "
                    f"({(rendered.size - render(values, []).size) / devices:.0f} bytes each); "
                    + ("warned" if warned else "not warned"))
            MEASURED["KubeVirt CR ceiling"] = head
        else:
            print(f"                          {devices} assigned devices: {size / 2**20:.2f} MiB stored")
            MEASURED["KubeVirt CR ceiling"] = f"{head}; {devices:,} fit"
        if step <= 0:
            return
        devices += step


def operator_writes(before: Counter, after: Counter, own: dict) -> Counter:
    """The writes between two counts to the resources we watch, less the benchmark's own (`own`)."""
    writes = Counter({k: v for k, v in support.diff(before, after).items() if k[0] in TOUCHED})
    writes.subtract(own)
    return +writes


def describe(writes: Counter, per: int) -> str:
    names = {"kubevirts": "KubeVirt CR", "passthroughconfigs": "config"}
    parts = [f"{names.get(resource, resource)}{'/' + sub if sub else ''} {verb} {n / per:g}"
             for (resource, sub, verb), n in sorted(writes.items())]  # fmt: skip
    return ", ".join(parts) or "none"


async def bench(local: cluster.LocalCluster, log: Path, args: argparse.Namespace) -> None:
    operator = OperatorProcess(local, log)
    api = await connect(str(local.kubeconfig))
    kubevirt = WatchedKubeVirt(api)
    watching = None
    try:
        await support.create_namespace(api, NAMESPACE)
        await support.create_kubevirt(api, NAMESPACE)
        operator.start()
        watching = asyncio.create_task(kubevirt.mirror.run())
        run = Bench(api, kubevirt)
        await run.change(lambda kv: "HostDevices" in feature_gates(kv) and bool(pci_list(kv)))
        print(f"KubeVirt CR:              {len(pci_list(kubevirt.latest))} pciHostDevices from the default table at the start")
        await run.changes(args.changes)
        await run.noops(args.noops)
        await run.large(args.entries, args.big_runs)
        await ceiling(api, args.ceiling, args.ceiling_step)
        print(f"operator RSS:             {psutil.Process(operator.proc.pid).memory_info().rss / 2**20:.0f} MiB at the end")
    finally:
        operator.stop()
        if watching:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        await api.close()
    problems = [line for line in operator.output().splitlines() if " WARNING " in line or " ERROR " in line or "Traceback" in line]
    print(f"operator log:             {len(problems)} warnings or errors" + "".join(f"\n    {p}" for p in problems[:10]))
    print()
    print(page_table(MEASURED))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=50, help="config changes to time and count")
    parser.add_argument("--noops", type=int, default=10, help="no-op events of each kind")
    parser.add_argument("--entries", type=int, default=2000, help="user pciHostDevices entries in the large config")
    parser.add_argument("--big-runs", type=int, default=3, help="writes of the large config")
    parser.add_argument("--ceiling", type=int, default=10000, help="assigned devices at which to measure the KubeVirt CR")
    parser.add_argument("--ceiling-step", type=int, default=500, help="more devices at a time until the CR is refused (0: none)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-kubevirt-") as tmp:
        local = cluster.start(Path(tmp) / "controlplane")
        try:
            asyncio.run(bench(local, Path(tmp) / "operator.log", args))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
