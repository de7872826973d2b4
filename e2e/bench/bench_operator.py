"""Benchmark of the operator against the real control plane: start-up, memory, restart, assignments.

    python e2e/bench/bench_operator.py [--sizes 2000,5000,10000] [--assigned 5000]
                                       [--sequential 200] [--burst 500] [--idle 30]

NodePCIDevices are written as node agents write them (100 per simulated node) and the
operator runs as its own process. In one run, with the machine's core count, it prints:

- start-up at each size: a fresh operator over N devices none of which has its conditions
  yet, the time from launching it until every device's initial conditions are written, its
  writes (expected: one each), CPU seconds and peak RSS (VmHWM); beside it the API server's
  floor for the same N writes (the bodies `lifecycle.decide` makes, turned aside so that the
  operator leaves them alone) by a plain kubernetes-asyncio client at full concurrency;
- at the largest size: assignment latency one at a time (admin's spec write returning to
  the PCIDevice visible through a watch, p50/p99); bursts of assignments at once (three by
  default), each from the first admin write to the last Assigned=True and to everything
  quiet (the last write of our objects or Event a watch sees), beside its floor: the
  operator's own writes and Events for as many assignments (PCIDevice create + status,
  NodePCIDevice status, two Events) by a plain client at full concurrency, with the operator
  stopped so that nothing reacts to them (on devices whose conditions are the floor's in place
  of the operator's, so that its writes change objects of the same size; each floor's
  conditions are taken back after it, as a live cluster has none); the median ratio and its
  spread, the CPU every process spent in each, writes per assignment; and, the operator still
  stopped, the least a burst can take on these cores: the admin's spec writes for as many
  other devices and the floor's writes for as many more, at once, by a plain client (the
  burst against it is what the operator adds over a client that knows every write in
  advance); then enough assignments for `--assigned` PCIDevices and the operator's peak RSS
  with all of them, and the writes during an idle period (must be 0);
- a restart over all of it, every condition already holding: its writes (must be 0) and the
  time from launch until its work queue first runs empty (its "start-up done" log line).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import os
import sys
import tempfile
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import psutil  # noqa: E402
from kubernetes_asyncio import client  # noqa: E402

from e2e import cluster as local  # noqa: E402
from e2e import support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.processes import OperatorProcess  # noqa: E402
from passthrough.agent import report  # noqa: E402
from passthrough.api import views  # noqa: E402
from passthrough.api.models import API_VERSION, GROUP, VERSION  # noqa: E402
from passthrough.controller import lifecycle  # noqa: E402
from passthrough.controller.world import ApplyDeviceStatus, ApplyNodeDeviceStatus, World  # noqa: E402
from passthrough.kube.cache import Informer  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.kube.client import session_of  # noqa: E402
from passthrough.kube.custom import AGENT_MANAGER, OPERATOR_MANAGER, Custom  # noqa: E402
from passthrough.kube.events import EventRecorder  # noqa: E402
from passthrough.kube.watch import watch_events  # noqa: E402

OURS = ("pcidevices", "nodepcidevices")
FLOOR = "bench-floor"  # the floor's field manager, Event source and namespace
PER_NODE = 100


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}x to {max(ratios):.2f}x"


# Each figure as the performance page labels it, with its goal (None: none set). The burst
# against the plain client at the same moment is the figure; its floor ratio is context.
GOALS: dict[str, str | None] = {
    "start-up (launch to every device's initial conditions written)": "60 s",
    "floor of the start-up (the same writes by a plain client at full concurrency)": None,
    "one assignment at a time": None,
    "**burst of assignments at once, to quiet, against a plain client making the admin's and the operator's writes "
    "at the same moment**": None,
    "the same burst against the floor (the operator's writes and Events alone, by a plain client)": "1.5x",
    "idle: writes with nothing to do": "0",
    "memory": "150 MiB",
    "restart": "0 writes",
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


class CPU:
    """CPU seconds of the operator, the control plane and this process over a stretch of time."""

    def __init__(self, cluster: local.LocalCluster, operator: OperatorProcess | None) -> None:
        self.pids = {**({"operator": operator.proc.pid} if operator else {}), **{p.name: p.pid for p in cluster.processes},
                     "benchmark": os.getpid()}  # fmt: skip
        self.before, self.started = self._now(), time.monotonic()

    def _now(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def spent(self) -> float:
        """CPU seconds of the operator and the control plane (the benchmark's own left out)."""
        return sum(v - self.before[k] for k, v in self._now().items() if k != "benchmark")

    def __str__(self) -> str:
        used = {k: v - self.before[k] for k, v in self._now().items()}
        wall = time.monotonic() - self.started
        return (f"CPU over {wall:.1f}s: " + ", ".join(f"{k} {v:.1f}s" for k, v in used.items() if v >= 0.05)
                + f" (all {sum(used.values()) / wall:.1f} of {os.cpu_count()} cores)")


@dataclass(frozen=True)
class Seen:
    """What the benchmark watches of an object: whether the operator's Assigned condition is on it."""

    name: str
    resource_version: str
    conditioned: bool
    assigned: bool = False  # Assigned=True: the operator's last write of an assignment

    @classmethod
    def of(cls, body) -> Seen:
        conditions = (body.get("status") or {}).get("conditions") or []
        return cls(body["metadata"]["name"], body["metadata"].get("resourceVersion", ""),
                   any(c.get("type") == "Assigned" for c in conditions),
                   any(c.get("type") == "Assigned" and c.get("status") == "True" for c in conditions))


class Watched:
    """NodePCIDevices with their initial conditions, and when each PCIDevice first appeared
    (the operator's own informer, used as any client's watch cache)."""

    def __init__(self, api) -> None:
        self.conditioned: set[str] = set()
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}  # when each NodePCIDevice was first seen Assigned=True
        self.last_change = 0.0  # when a watch last saw one of our objects change
        self._changed = asyncio.Event()
        self.node_devices = Informer(api, "nodepcidevices", Seen.of, {}, self._node_device)
        self.devices = Informer(api, "pcidevices", Seen.of, {}, self._device)
        self.tasks = [asyncio.create_task(self.node_devices.run()), asyncio.create_task(self.devices.run())]

    def _node_device(self, old: Seen | None, new: Seen | None) -> None:
        self.last_change = time.monotonic()
        if new is not None and new.assigned:
            self.done.setdefault(new.name, time.monotonic())
        if new is not None and new.conditioned:
            self.conditioned.add(new.name)
        elif (new or old).name in self.conditioned:
            self.conditioned.discard((new or old).name)
        self._changed.set()

    def _device(self, old: Seen | None, new: Seen | None) -> None:
        self.last_change = time.monotonic()
        if new is not None:
            self.first.setdefault(new.name, time.monotonic())
            self._changed.set()

    async def until(self, predicate, timeout: float, what: str) -> float:
        """Wait until `predicate()` holds; returns the time it first did."""
        deadline = time.monotonic() + timeout
        while not predicate():
            self._changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
            await support.wait_event(self._changed, min(remaining, 1))
        return time.monotonic()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class EventsSeen:
    """When a watch on every namespace's Events last saw one posted or counted up."""

    def __init__(self, api) -> None:
        self.session = session_of(api)
        self.last = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            listing = await self.session.request("GET", "/api/v1/events", query={"limit": 1})
            try:
                async for kind, _ in watch_events(self.session, "/api/v1/events", resourceVersion=listing["metadata"]["resourceVersion"]):
                    if kind in ("ADDED", "MODIFIED"):
                        self.last = time.monotonic()
            except Exception:  # an expired watch: start again from now
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class Fleet:
    """NodePCIDevices as node agents write them: the object, then its status."""

    def __init__(self, api) -> None:
        self.api, self.kind = api, Custom(api, "nodepcidevices")
        self.nodes: list[report.Node] = []
        self.names: list[str] = []
        self.records: dict[str, dict] = {}  # name -> the object as written (uid, attributes)

    async def grow(self, size: int) -> float:
        started = time.monotonic()
        while len(self.nodes) * PER_NODE < size:
            self.nodes.append(await support.ensure_node(self.api, f"bench-node-{len(self.nodes)}"))
        limit = asyncio.Semaphore(64)

        async def one(i: int) -> str:
            node, j = self.nodes[i // PER_NODE], i % PER_NODE
            device = support.gpu(f"0000:{j // 8 + 1:02x}:{j % 8:02x}.0")
            name = report.object_name(device, node.name)
            async with limit:
                live = await self.kind.apply(report.identity(name, node), AGENT_MANAGER)
                status = report.present_status(device, name, node.name, "")
                self.records[name] = await self.kind.apply(report.status_body(name, status, live), AGENT_MANAGER, status=True)
            return name

        self.names += await asyncio.gather(*(one(i) for i in range(len(self.names), size)))
        return time.monotonic() - started


def operator_writes(record: dict, namespace: str = "", events: bool = False) -> list:
    """The writes the operator itself decides for a device as `record` shows it (assigned to
    `namespace`), turned so that it leaves them alone: the PCIDevice named floor-..., its own
    condition types on the NodePCIDevice; with `events`, its Events too. The floor writes
    these: the same bodies, sizes and all, by a plain client."""
    body = {**record, "spec": {**(record.get("spec") or {}), "assignedNamespace": namespace}}
    world = World(name=record["metadata"]["name"], node_device=views.NodeDevice.of(body), devices=(),
                  namespaces={namespace: "Active"} if namespace else {}, referencing_vms={},
                  now=datetime.datetime.now(datetime.UTC))
    plan = lifecycle.decide(world)
    writes = []
    for write in plan.writes:
        body = copy.deepcopy(write.body)
        if isinstance(write, ApplyNodeDeviceStatus):
            body["status"].pop("assignedNamespaceRef", None)
            for condition in body["status"]["conditions"]:
                condition["type"] = f"Floor{condition['type']}"
            writes.append(("nodepcidevices", body))
        else:
            body["metadata"]["name"] = f"floor-{body['metadata']['name']}"
            writes.append(("pcidevices-status" if isinstance(write, ApplyDeviceStatus) else "pcidevices", body))
    for event in plan.events if events else ():
        involved = {"api_version": API_VERSION, "kind": event.kind, "name": f"floor-{record['metadata']['name']}",
                    "uid": record["metadata"]["uid"], **({"namespace": event.namespace} if event.kind == "PCIDevice" else {})}
        writes.append(("event", (involved, event.type, event.reason, event.message)))
    return writes


async def floor_of(api, bodies: list[list]) -> float:
    """Each list of writes in order, all lists at once, by a plain client at full concurrency
    (Events as the operator posts them, but all at once: none waits for a quiet moment)."""
    recorder = EventRecorder(api, FLOOR, concurrency=64)
    kinds = {"nodepcidevices": (Custom(api, "nodepcidevices"), True), "pcidevices": (Custom(api, "pcidevices", namespaced=True), False),
             "pcidevices-status": (Custom(api, "pcidevices", namespaced=True), True)}

    # As many chains at once as the client has connections: more would only queue for one, and a
    # request's 60 s timeout counts its wait for a connection (10,000 at once timed out on a busy machine).
    limit = asyncio.Semaphore(64)

    async def one(writes: list) -> None:
        async with limit:
            await chain(writes)

    async def chain(writes: list) -> None:
        for kind, body in writes:
            if kind == "event":
                recorder.post(*body)
                continue
            custom, status = kinds[kind]
            await custom.apply(body, FLOOR, status=status)

    started = time.monotonic()
    await asyncio.gather(*(one(w) for w in bodies))
    await recorder.drain()
    return time.monotonic() - started


async def clear_conditions(api, names: list[str], manager: str = OPERATOR_MANAGER) -> None:
    """Take back the NodePCIDevice status fields `manager` wrote (an earlier operator's
    conditions, or the floor's), so that the objects look as they would without them."""
    kind = Custom(api, "nodepcidevices")
    limit = asyncio.Semaphore(64)

    async def one(name: str) -> None:
        async with limit:
            await kind.apply({"apiVersion": API_VERSION, "kind": "NodePCIDevice", "metadata": {"name": name}, "status": {}},
                             manager, status=True)

    await asyncio.gather(*(one(n) for n in names))


async def as_floor_devices(api, fleet: Fleet, names: list[str]) -> None:
    """The floor's NodePCIDevices as the operator leaves an unassigned device, with the floor's
    condition types in place of its own (the operator stopped): the floor's writes then change
    objects of the same size as the operator's writes in a burst do."""
    await clear_conditions(api, names)
    await floor_of(api, [[w for w in operator_writes(fleet.records[n]) if w[0] == "nodepcidevices"] for n in names])


async def start_operator(cluster, workdir: Path, label: str, extra: list[str]) -> tuple[OperatorProcess, float]:
    operator = OperatorProcess(cluster, workdir / f"operator-{label}.log", *extra)
    launched = time.monotonic()
    # In this thread: the operator dies with the thread that started it (PR_SET_PDEATHSIG).
    operator.start(60)
    return operator, launched


async def until_started_up(operator: OperatorProcess, timeout: float) -> float:
    """When the operator's work queue first ran empty (its "start-up done" line)."""
    deadline = time.monotonic() + timeout
    while "start-up done" not in operator.output():
        if time.monotonic() > deadline:
            raise AssertionError(f"no 'start-up done' from the operator in {timeout:.0f}s:\n{operator.output()[-3000:]}")
        await asyncio.sleep(0.1)
    return time.monotonic()


async def assign_many(api, names: list[str], namespaces: list[str], concurrency: int = 64) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, name: str) -> None:
        async with limit:
            await support.assign(api, name, namespaces[i % len(namespaces)])

    await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))


async def one_burst(api, floor_api, cluster, operator, watched, events, fleet, namespaces: list[str], burst: list[str],
                    floor_names: list[str], once_names: list[str], admin_names: list[str], round_: int,
                    operator_args: list[str], workdir: Path) -> tuple[float, float, float, OperatorProcess]:  # fmt: skip
    """`burst` assigned at once, measured until everything is quiet (the last write of our
    objects or an Event the watches see); then, with the operator stopped, the floor: the same
    writes and Events the operator made, for `floor_names`, by a plain client at full
    concurrency (`floor_api`: its own connections, as the operator has); and the admin's spec
    writes for `admin_names` (left assigned, by `api`, as in the burst) at once with the floor's
    writes for `once_names`. Returns the ratio of burst and floor, that of their CPU,
    the ratio of burst and the writes at once, and the operator (started again)."""
    before = await support.write_counts(api)
    cpu_before = cpu_seconds(operator.proc.pid)
    cpu_burst = CPU(cluster, operator)
    started = time.monotonic()
    written_at = {}

    async def assign_one(i: int, name: str) -> None:
        await support.assign(api, name, namespaces[i % 10])
        written_at[name] = time.monotonic()

    await asyncio.gather(*(assign_one(i, n) for i, n in enumerate(burst)))
    visible = await watched.until(lambda: all(n in watched.first for n in burst), 300, "the burst's PCIDevices") - started
    done = await watched.until(lambda: all(n in watched.done for n in burst), 300, "the burst's Assigned conditions") - started
    cpu_burst_meter, cpu_burst = cpu_burst, str(cpu_burst)  # to the last Assigned=True (the Events come after)
    cpu = cpu_seconds(operator.proc.pid) - cpu_before
    p50, p99 = support.p50_p99([watched.first[n] - written_at[n] for n in burst])
    await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
    quiet = max(watched.last_change, events.last) - started
    cpu_burst_spent = cpu_burst_meter.spent()  # to quiet, Events included (and the 2 s of settling: idle, a few tenths)
    after = await support.write_counts(api)
    burst_writes = support.writes_between(before, after, *OURS) - len(burst)
    burst_events = support.writes_between(before, after, "events")

    # The floor, with the operator stopped so that nothing reacts to the floor's objects: the
    # operator's writes and Events alone (the admin's spec writes are the burst's cause, not its cost).
    operator.stop()

    def floor_bodies(names: list[str]) -> list[list]:
        return [operator_writes(fleet.records[n], FLOOR, events=True) for n in names]

    async def clear_floor(names: list[str]) -> None:
        await client.CustomObjectsApi(api).delete_collection_namespaced_custom_object(GROUP, VERSION, FLOOR, "pcidevices")
        await clear_conditions(api, names, FLOOR)  # the operator gives them its own again when it starts

    await as_floor_devices(floor_api, fleet, floor_names + once_names)
    await support.quiet(api, OURS, settle=2, timeout=300)
    bodies = floor_bodies(floor_names)
    cpu_floor = CPU(cluster, None)
    floor = await floor_of(floor_api, bodies)
    cpu_floor_spent, cpu_floor = cpu_floor.spent(), str(cpu_floor)
    await clear_floor(floor_names)
    # The admin's writes, for `admin_names`, at once with the floor's writes, for `once_names`, by
    # a plain client that knows them all in advance (the operator still stopped; it takes the
    # assignments up when it starts again): the least a burst can take on these shared cores.
    cpu_once = CPU(cluster, None)
    once_started = time.monotonic()
    await asyncio.gather(floor_of(floor_api, floor_bodies(once_names)), *(support.assign(api, n, namespaces[i % 10]) for i, n in enumerate(admin_names)))
    at_once, cpu_once_spent = time.monotonic() - once_started, cpu_once.spent()
    await clear_floor(once_names)
    operator, _ = await start_operator(cluster, workdir, f"after-floor-{round_}", operator_args)
    await until_started_up(operator, 300)
    await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
    floor_writes = sum(len(b) for b in bodies)
    print(f"burst {round_}: {len(burst)} assignments at once (the admin's writes returned within "
          f"{max(written_at.values()) - started:.2f}s), from the first write: all PCIDevices visible {visible:.2f}s, every "
          f"assignment done (Assigned=True seen) {done:.2f}s, everything quiet (the last write or Event seen) {quiet:.2f}s; "
          f"PCIDevice latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; {burst_writes / len(burst):.2f} writes and "
          f"{burst_events / len(burst):.2f} Events per assignment, operator CPU {cpu:.1f}s")
    print(f"  floor, operator stopped: the operator's {floor_writes} writes and Events for {len(floor_names)} assignments by a "
          f"plain client {floor:.2f}s; burst/floor {quiet / floor:.2f}x to quiet ({done / floor:.2f}x to the last Assigned=True); "
          f"CPU of the operator and the control plane {cpu_burst_spent:.1f}s against {cpu_floor_spent:.1f}s: "
          f"{cpu_burst_spent / cpu_floor_spent:.2f}x (less at the mercy of a shared machine than the wall clock)")
    print(f"  the admin's {len(admin_names)} spec writes and the floor's writes for {len(once_names)} more at once, by a plain "
          f"client, operator stopped: {at_once:.2f}s, control plane CPU {cpu_once_spent:.1f}s; the least a burst can take here: "
          f"{at_once / floor:.2f}x the floor; the burst took {quiet / at_once:.2f}x that")
    print(f"  burst {cpu_burst}\n  floor {cpu_floor}")
    return quiet / floor, cpu_burst_spent / cpu_floor_spent, quiet / at_once, operator


async def run(args, cluster: local.LocalCluster, workdir: Path) -> None:
    api = await connect(str(cluster.kubeconfig))
    floor_api = await connect(str(cluster.kubeconfig))  # the floor's plain client: connections of its own, as the operator's
    namespaces = [f"bench-{i}" for i in range(10)]
    for ns in [*namespaces, FLOOR]:
        await support.create_namespace(api, ns)
    fleet = Fleet(api)
    watched = Watched(api)
    events_seen = EventsSeen(api)
    sizes = sorted(args.sizes)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    load = f"Load average {os.getloadavg()[0]:.1f} at the start."
    labels = list(GOALS)
    rows = []
    operator = None
    try:
        for size in sizes:
            grown = await fleet.grow(size)
            names = fleet.names[:size]
            print(f"setup: {size} NodePCIDevices written as agents would ({grown:.1f}s for the new ones)")
            await clear_conditions(api, sorted(watched.conditioned))
            await watched.until(lambda: not watched.conditioned, 120, "the earlier operator's conditions to be cleared")
            await support.quiet(api, OURS, settle=2, timeout=300)
            floor = await floor_of(floor_api, [operator_writes(fleet.records[n]) for n in names])
            # The floor's conditions taken back: the operator starts on the objects the floor
            # started on, and each later write changes an object no larger than on a live cluster.
            await clear_conditions(api, names, FLOOR)
            await support.quiet(api, OURS, settle=2, timeout=300)
            before = await support.write_counts(api)
            operator, launched = await start_operator(cluster, workdir, str(size), args.operator_args)
            done = await watched.until(lambda: len(watched.conditioned) >= size and watched.conditioned.issuperset(names), 900,
                                       f"initial conditions on {size} devices")
            await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
            writes = support.writes_between(before, await support.write_counts(api), *OURS)
            row = (size, done - launched, floor, writes, cpu_seconds(operator.proc.pid), peak_rss_mib(operator.proc.pid))
            rows.append(row)
            print(f"start-up over {size} devices: initial conditions written {row[1]:.1f}s after launch, {writes} writes, "
                  f"operator CPU {row[4]:.1f}s, peak RSS {row[5]:.0f} MiB; floor for {size} writes {floor:.1f}s")
            if size != sizes[-1]:
                operator.stop()
        biggest = sizes[-1]
        size, took, floor, writes, cpu, _ = rows[-1]
        MEASURED[labels[0]] = f"{took:.1f} s over {size:,} devices; {writes:,} writes; operator CPU {cpu:.1f} s"
        MEASURED[labels[1]] = f"{floor:.1f} s"

        # One at a time.
        free = iter(fleet.names)
        sequential = [next(free) for _ in range(args.sequential)]
        before = await support.write_counts(api)
        latencies = []
        for i, name in enumerate(sequential):
            await support.assign(api, name, namespaces[i % 10])
            written = time.monotonic()
            latencies.append(await watched.until(lambda: name in watched.first, 60, f"PCIDevice {name}") - written)
        await support.quiet(api, OURS + ("events",), settle=2, timeout=300)
        after = await support.write_counts(api)
        writes = support.writes_between(before, after, *OURS) - len(sequential)  # the admin's own spec writes
        events = support.writes_between(before, after, "events")
        p50, p99 = support.p50_p99(latencies)
        print(f"sequential at {biggest} devices: {len(sequential)} assignments one at a time: latency p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms; {writes / len(sequential):.2f} writes per "
              f"assignment (PCIDevice create + status, NodePCIDevice status), plus {events / len(sequential):.2f} Events")
        MEASURED[labels[2]] = (f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {max(latencies) * 1000:.0f} ms over "
                               f"{len(sequential)} at {biggest:,} devices; {writes / len(sequential):.2f} writes and "
                               f"{events / len(sequential):.2f} Events each")

        # Bursts, each beside its floor (the ratio varies from one to the next on a busy 2-core
        # machine: the median and the spread are reported).
        bursts = []
        ratios, cpu_ratios, once_ratios = [], [], []
        for round_ in range(1, args.bursts + 1):
            burst = [next(free) for _ in range(args.burst)]
            floor_names = [next(free) for _ in range(args.burst)]
            once_names = [next(free) for _ in range(args.burst)]
            admin_names = [next(free) for _ in range(args.burst)]
            ratio, cpu_ratio, once_ratio, operator = await one_burst(
                api, floor_api, cluster, operator, watched, events_seen, fleet, namespaces, burst, floor_names, once_names, admin_names, round_,
                args.operator_args, workdir)  # fmt: skip
            ratios.append(ratio)
            cpu_ratios.append(cpu_ratio)
            once_ratios.append(once_ratio)
            bursts += burst + admin_names  # both assigned now
        ratio, once_ratio = statistics.median(ratios), statistics.median(once_ratios)
        print(f"burst/floor (operator alone, to quiet) over {len(ratios)} bursts: median {ratio:.2f}x, {spread(ratios)} "
              f"({', '.join(f'{r:.2f}x' for r in ratios)})")
        print(f"burst/floor in CPU (operator and control plane) over {len(cpu_ratios)} bursts: median "
              f"{statistics.median(cpu_ratios):.2f}x, {spread(cpu_ratios)}")
        print(f"burst against the admin's and the floor's writes at once by a plain client, over {len(once_ratios)} bursts: median "
              f"{once_ratio:.2f}x, {spread(once_ratios)}")
        MEASURED[labels[3]] = (f"**median {once_ratio:.2f}x** ({', '.join(f'{r:.2f}x' for r in once_ratios)} over "
                               f"{len(once_ratios)} bursts of {args.burst})")
        MEASURED[labels[4]] = f"median {ratio:.2f}x ({spread(ratios)}); in CPU {statistics.median(cpu_ratios):.2f}x"

        # Up to `--assigned` PCIDevices, then the memory they cost.
        more = [next(free) for _ in range(max(0, args.assigned - len(sequential) - len(bursts)))]
        started = time.monotonic()
        await assign_many(api, more, namespaces)
        assigned = [*sequential, *bursts, *more]
        await watched.until(lambda: len(watched.first) >= len(assigned) and all(n in watched.first for n in assigned), 900,
                            f"{len(assigned)} PCIDevices")
        print(f"assigned: {len(more)} more in {time.monotonic() - started:.1f}s, {len(assigned)} PCIDevices in all")
        await support.quiet(api, OURS + ("events",), settle=3, timeout=300)

        # Idle.
        before = await support.write_counts(api)
        await asyncio.sleep(args.idle)
        after = await support.write_counts(api)
        idle_writes = support.writes_between(before, after, *OURS, "events", "passthroughconfigs", "kubevirts")
        print(f"idle: writes during {args.idle:.0f}s with nothing to do: {idle_writes}")
        MEASURED[labels[5]] = f"{idle_writes} in {args.idle:.0f} s"
        memory = peak_rss_mib(operator.proc.pid)
        print(f"memory: operator peak RSS {memory:.0f} MiB (VmHWM) with {biggest} NodePCIDevices and {len(assigned)} PCIDevices")
        MEASURED[labels[6]] = f"{memory:.0f} MiB peak RSS with {biggest:,} NodePCIDevices and {len(assigned):,} PCIDevices"
        operator.stop()

        # A restart over all of it.
        before = await support.write_counts(api)
        operator, launched = await start_operator(cluster, workdir, "restart", args.operator_args)
        ready = await until_started_up(operator, 300) - launched
        await support.quiet(api, OURS + ("events",), settle=3, timeout=300)
        restart_writes = support.writes_between(before, await support.write_counts(api), *OURS, "events")
        print(f"restart over {biggest} devices ({len(assigned)} assigned), conditions already holding: {restart_writes} writes, "
              f"work queue empty {ready:.1f}s after launch, peak RSS {peak_rss_mib(operator.proc.pid):.0f} MiB")
        MEASURED[labels[7]] = (f"{restart_writes} writes; work queue empty {ready:.1f} s after launch "
                               f"({biggest:,} devices, {len(assigned):,} assigned)")

        print(f"\nsummary ({os.cpu_count()} cores)")
        print(f"{'devices':>10} {'start-up':>10} {'floor':>8} {'ratio':>6} {'writes':>7} {'CPU':>7} {'peak RSS':>9}")
        for size, took, floor, writes, cpu, rss in rows:
            print(f"{size:>10} {took:>9.1f}s {floor:>7.1f}s {took / floor:>5.1f}x {writes:>7} {cpu:>6.1f}s {rss:>6.0f} MiB")
        if len(rows) > 1:
            (s0, t0, *_, r0), (s1, t1, *_, r1) = rows[0], rows[-1]
            per = 1000 / (s1 - s0)
            print(f"per 1,000 devices more: start-up +{(t1 - t0) * per:.1f}s, peak RSS +{(r1 - r0) * per:.1f} MiB")
        print(f"memory with {biggest} NodePCIDevices and {len(assigned)} PCIDevices: {memory:.0f} MiB")
        print(f"burst/floor (operator alone, to quiet): median {ratio:.2f}x ({spread(ratios)}) over {len(ratios)} bursts of "
              f"{args.burst} assignments; against the same writes and the admin's at once by a plain client: median "
              f"{once_ratio:.2f}x")
        print(f"restart: {restart_writes} writes, queue empty after {ready:.1f}s")
        print()
        print(page_table(MEASURED, note=load))
    finally:
        if operator is not None:
            operator.stop()
        await watched.close()
        await events_seen.close()
        await floor_api.close()
        await api.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[2000, 5000, 10000],
                        help="device counts to start the operator over, comma-separated (default 2000,5000,10000)")
    parser.add_argument("--assigned", type=int, default=5000, help="PCIDevices at the largest size, for the memory figure")
    parser.add_argument("--sequential", type=int, default=200)
    parser.add_argument("--burst", type=int, default=500)
    parser.add_argument("--bursts", type=int, default=3, help="bursts, each beside its floor (at least 3 for a median)")
    parser.add_argument("--idle", type=float, default=30, help="seconds of idleness to count writes over")
    parser.add_argument("--operator-args", nargs="*", default=[], help="extra arguments for passthrough operator")
    args = parser.parse_args()
    if max(args.sizes) < max(args.assigned, args.sequential + 2 * args.burst * args.bursts) + 2 * args.burst * args.bursts:
        parser.error("the largest size must hold --assigned devices and the sequential, burst, admin and both floors' ones")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = local.start(Path(tmp))
        try:
            asyncio.run(run(args, cluster, Path(tmp)))
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

