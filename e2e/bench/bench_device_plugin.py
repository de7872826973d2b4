"""Benchmark of the node agent's vfio-pci binding and kubelet device plugins, against the real kubelet.

    .venv/bin/python e2e/bench/bench_device_plugin.py [--gpus 4] [--allocates 500] [--pods 10] [--cycles 20]
        [--vanish 5] [--restarts 1] [--bind-rounds 50] [--no-kubelet]

The agent runs as its own process (`passthrough agent`, as in its DaemonSet pod) over a
fixture GPU node of --gpus NVIDIA A10s, each with its audio function in its own IOMMU group
behind a root port, answered by the simulated kernel (`e2e.fakekernel`). Its device plugins
register with Kubernetes' own kubelet (`e2e.kubelet`: the fake CRI runtime, a private mount
namespace, nothing on the host), and kube-scheduler places the pods. The harness's kubelet
posts its node status every 2 s (`nodeStatusUpdateFrequency`; 10 s is the default on a real
cluster): every "... in allocatable" figure includes up to that much of the kubelet's own
waiting. Node allocatable is timed by its arrival on a watch of the Node.

What each figure means:
- GPU mode on: one sample, from labelling the node `passthrough.io/gpu-passthrough=true` to
  the pool (`nvidia.com/GA102GL_A10`) of every GPU in allocatable: the agent's bind of each
  group to vfio-pci, its plugin's registration and the kubelet's status update.
- Allocate over gRPC: --allocates calls made straight to the pool plugin's socket as the
  kubelet makes them (one container asking for one device, the devices in turn), on one
  channel, from this process; p50 / p99 of the round trip. The first call (connecting) is
  left out.
- pod to CreateContainer: --pods pods, one after another (each deleted before the next),
  each with a limit of one pool GPU; from just before the create call to the time the fake
  runtime stamped on its CreateContainer record: scheduling, admission, the kubelet's
  GetPreferredAllocation and Allocate to our plugin, the fake sandbox. Both clocks are this
  machine's wall clock.
- assignment: --cycles times, an admin sets the device's spec.assignedNamespace, then clears
  it. Agent side: from the write returning to the exclusive plugin's socket appearing (the
  agent saw the change on its watch and serves `passthrough.io/<NodePCIDevice name>`; it
  registers at once) and to the pool plugin's ListAndWatch listing one device less (read
  on a second stream of our own, as the kubelet reads it); back: to the socket gone and the
  pool listing all again. Kubelet side: to the exclusive resource at 1 in allocatable (and
  the pool down by one), back: to the pool count at --gpus (and the exclusive at 0). Each
  write waits a random part of the 2 s status period first, else it would always start just
  after a status and wait the whole period. p50 / p99.
- /dev/vfio vanishing: --vanish times, the group node of a pool GPU is unlinked in the tree;
  the time until the pool plugin lists it Unhealthy (the agent's health poll runs every
  0.5 s) and until the pool in allocatable drops by one; the node is put back and the pool
  waited for in between, and a random phase waited as above. p50 / max.
- kubelet restart: --restarts times, `restart_kubelet()` (it deletes every plugin socket);
  the time until the pool is back in allocatable, and when it left (if it did).
- bind / give-back: `bind_group` then `release_group` of one A10 + audio group, --bind-rounds
  rounds, in this process with the simulated kernel. This measures our sysfs write-and-check
  sequence plus the simulated kernel's inotify round trip (a few ms per step), NOT a real
  driver's unbind (nvidia's takes from tens of ms to seconds on real hardware).
- agent RSS (psutil VmRSS, and the peak VmHWM from /proc) with 2 x --gpus devices and
  1 + (--gpus - 1, at most 3) plugins: the node in GPU mode with that many GPUs assigned
  (pool + exclusive ones). Read from the agent that ran all of the above, then from a fresh
  agent started over the same state, 3 s after every resource is back (the goal: under
  80 MiB). Its start to every resource back in allocatable is printed too.

Where the real kubelet cannot run (not root, no binaries), one line says why, and the
figures that need no kubelet are printed anyway: bind / give-back, Allocate over gRPC and
RSS, the agent's plugins registering with a stand-in Registration service of this script.
--no-kubelet forces that.

Everything runs on loopback over fixture trees: nothing is written to the host's /sys or
/dev. Nothing is asserted: the figures are printed, with the agent log's warnings.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime
import os
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# This process talks gRPC and then forks (the agent, the kubelet): no fork handlers, no warning;
# the agents inherit both settings.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no core INFO lines (a GOAWAY when the kubelet restarts)

import grpc  # noqa: E402
import psutil  # noqa: E402
from kubernetes_asyncio import client, watch  # noqa: E402
from kubernetes_asyncio.client.exceptions import ApiException  # noqa: E402

from e2e import cluster, fakesysfs, kubelet, support  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.fakekernel import FakeKernel  # noqa: E402
from e2e.processes import AgentProcess, OperatorProcess  # noqa: E402
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2 as api_pb  # noqa: E402
from passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1 import api_pb2_grpc as api_grpc  # noqa: E402
from passthrough.deviceplugin.server import live_socket  # noqa: E402
from passthrough.kube.connect import connect  # noqa: E402
from passthrough.pci import vfio  # noqa: E402
from passthrough.pci.naming import exclusive_resource_name  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
GPU_MODE = "passthrough.io/gpu-passthrough"
NAMESPACE = "bench-vms"
MERGE = "application/merge-patch+json"
# The harness's kubelet posts its node status this often (nodeStatusUpdateFrequency).
STATUS_PERIOD = 2.0
SETTLE = 3.0  # seconds after the last resource showed before reading RSS
TIMEOUT = 60.0


# --- The fixture host ------------------------------------------------------------------


def gpu_host(root: Path, gpus: int) -> tuple[fakesysfs.FakeHost, dict[str, int]]:
    """`gpus` A10s on nvidia, each with its audio function (snd_hda_intel) in its own IOMMU
    group behind its own root port, as `fakesysfs.gpu_node` lays out two. Returns the host
    and {GPU address: group}."""
    host = fakesysfs.FakeHost(root)
    host.add_device("0000:00:00.0", *fakesysfs.HOST_BRIDGE, iommu_group=0)
    groups = {}
    for n in range(gpus):
        bus, group = f"{0x3b + n:02x}", 20 + n
        host.add_root_port(f"0000:00:{3 + n:02x}.0", bus, iommu_group=10 + n)
        for fn, (device, klass, driver) in enumerate((("2236", "030200", "nvidia"), ("1aef", "040300", "snd_hda_intel"))):
            host.add_device(f"0000:{bus}:00.{fn}", "10de", device, klass, driver=driver, iommu_group=group,
                            numa_node=n % 2, subsystem=("10de", "1482"))  # fmt: skip
        groups[f"0000:{bus}:00.0"] = group
    return host, groups

# Each figure as the performance page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "bind to vfio-pci (A10 + audio)": None,
    "give back": None,
    "GPU mode on: label to the pool in allocatable": None,
    "`Allocate` over gRPC": None,
    "pod to CreateContainer (scheduler, kubelet, `Allocate`)": None,
    "assign, agent side (spec write to the exclusive plugin's socket up)": None,
    "assign to allocatable": None,
    "unassign, agent side (spec write to the socket gone)": None,
    "unassign to allocatable (the pool back at its size)": None,
    "`/dev/vfio/<group>` removed to the device Unhealthy in ListAndWatch": None,
    "kubelet restart": None,
    "agent restart to all its resources in allocatable": None,
    "agent RSS": "under 80 MiB",
}
# The figures of this run under the page's labels, printed last as its table.
MEASURED: dict[str, str] = {}


def page_table(measured: dict[str, str], **lead) -> str:
    """The figures in the performance page's form."""
    return table.figures_page(measured, GOALS, **lead)


# --- Figure: bind and give back -------------------------------------------------------------


def bench_bind(root: Path, rounds: int) -> None:
    host = fakesysfs.gpu_node(root)
    group, members = 20, ["0000:3b:00.0", "0000:3b:00.1"]
    binds, releases, writes = [], [], [0, 0]
    with FakeKernel(host) as kernel:
        for _ in range(rounds):
            started = time.perf_counter()
            writes[0] += vfio.bind_group(host.sysfs, host.dev, group, members, timeout=5)
            binds.append(time.perf_counter() - started)
            started = time.perf_counter()
            writes[1] += vfio.release_group(host.sysfs, host.dev, group, members, timeout=5)
            releases.append(time.perf_counter() - started)
        errors = list(kernel.errors)
    drivers = {a: host.driver(a) for a in members}
    for what, samples, count, label in (("bind to vfio-pci:", binds, writes[0], "bind to vfio-pci (A10 + audio)"),
                                        ("give back:", releases, writes[1], "give back")):  # fmt: skip
        p50, p99 = support.p50_p99([s * 1000 for s in samples])
        print(f"{what:<26}p50 {p50:.1f} ms, p99 {p99:.1f} ms over {rounds} rounds "
              f"(A10 + audio, {count / rounds:g} sysfs writes; simulated kernel, not a real driver's unbind)")
        MEASURED[label] = f"p50 {p50:.1f} ms, p99 {p99:.1f} ms over {rounds} ({count / rounds:g} sysfs writes)"
    if errors or drivers != {"0000:3b:00.0": "nvidia", "0000:3b:00.1": "snd_hda_intel"}:
        print(f"                          after the last give-back: {drivers}; simulated kernel errors: {errors[:5]}")


# --- Watching the Node and the pool plugin ---------------------------------------------------


def extended(allocatable: dict | None) -> dict[str, str]:
    return {k: v for k, v in (allocatable or {}).items() if "/" in k}


class Timeline:
    """A value as it changes, each change stamped (monotonic) with its arrival."""

    def __init__(self) -> None:
        self.value: dict = {}
        self.arrived = time.monotonic()
        self.history: list[tuple[float, dict]] = []
        self.changed = asyncio.Event()

    def record(self, value: dict) -> None:
        if value != self.value:
            self.value, self.arrived = value, time.monotonic()
            self.history.append((self.arrived, value))
        self.changed.set()

    async def until(self, check, since: float | None = None, timeout: float = TIMEOUT, what: str = "") -> float:
        """The arrival time of the first value that passes `check`: the first to arrive from
        `since` on; without `since`, the current one counts too."""
        deadline = time.monotonic() + timeout
        while True:
            self.changed.clear()
            if since is None:
                if check(self.value):
                    return self.arrived
            else:
                start = bisect.bisect_left(self.history, since, key=lambda entry: entry[0])
                for arrived, value in self.history[start:]:
                    if check(value):
                        return arrived
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; now {self.value}")
            await support.wait_event(self.changed, remaining)


class NodeWatch(Timeline):
    """The Node's extended allocatable resources as a watch delivers them; heartbeats that
    change nothing keep the stamp."""

    def __init__(self, api: client.ApiClient, name: str) -> None:
        super().__init__()
        self.core, self.name = client.CoreV1Api(api), name

    async def run(self) -> None:
        selector = f"metadata.name={self.name}"
        version = ""
        while True:
            try:
                if not version:
                    listing = await self.core.list_node(field_selector=selector)
                    version = listing.metadata.resource_version
                    for node in listing.items:
                        self.record(extended(node.status.allocatable if node.status else None))
                w = watch.Watch()
                async with w.stream(self.core.list_node, field_selector=selector, resource_version=version,
                                    allow_watch_bookmarks=True, timeout_seconds=300) as stream:  # fmt: skip
                    async for event in stream:
                        obj = event["raw_object"]
                        version = obj["metadata"].get("resourceVersion", version)
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self.record(extended((obj.get("status") or {}).get("allocatable")))
                        elif event["type"] == "DELETED":
                            self.record({})
            except asyncio.CancelledError:
                raise
            except ApiException as exc:
                if exc.status == 410:
                    version = ""
                    continue
                await asyncio.sleep(0.2)
            except Exception:  # a dropped connection: watch again from where we were
                await asyncio.sleep(0.2)


class PluginStream(Timeline):
    """One plugin's ListAndWatch, read as the kubelet reads it (a second stream beside the
    kubelet's): {"devices": listed, "healthy": of those Healthy}; reconnects when it ends."""

    def __init__(self, socket: Path) -> None:
        super().__init__()
        self.socket = socket

    async def run(self) -> None:
        while True:
            try:
                async with grpc.aio.insecure_channel(f"unix://{self.socket}") as channel:
                    async for listed in api_grpc.DevicePluginStub(channel).ListAndWatch(api_pb.Empty()):
                        healthy = sum(d.health == "Healthy" for d in listed.devices)
                        self.record({"devices": len(listed.devices), "healthy": healthy})
            except asyncio.CancelledError:
                raise
            except Exception:  # not served yet, or served again after a kubelet restart
                pass
            await asyncio.sleep(0.02)


async def appears(check, interval: float = 0.005) -> float:
    """Poll `check` until it holds; the monotonic time it was seen."""
    while not check():
        await asyncio.sleep(interval)
    return time.monotonic()


# --- A stand-in for the kubelet's Registration service (only where the kubelet cannot run) --


class Registrar(api_grpc.RegistrationServicer):
    """Answers Register on `<plugin_dir>/kubelet.sock` as the kubelet does, so the agent's
    plugins serve; it never dials them back."""

    def __init__(self, plugin_dir: Path) -> None:
        self.socket = Path(plugin_dir) / "kubelet.sock"
        self.registered: list[tuple[float, str]] = []  # (monotonic, resource name)
        self.server: grpc.aio.Server | None = None

    async def Register(self, request, context):
        self.registered.append((time.monotonic(), request.resource_name))
        return api_pb.Empty()

    async def start(self) -> Registrar:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.server = grpc.aio.server()
        api_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"unix://{self.socket}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)


# --- The node under test --------------------------------------------------------------------


class Node:
    """The agent over the fixture host, the kubelet (or the stand-in) and the Node's resources."""

    def __init__(self, local, api, root: Path, gpus: int, kubelet_node, registrar: Registrar | None = None) -> None:
        self.local, self.api, self.root = local, api, root
        self.core = client.CoreV1Api(api)
        self.host, self.groups = gpu_host(root / "host", gpus)
        self.gpus = gpus
        self.kubelet, self.registrar = kubelet_node, registrar
        self.name = kubelet_node.node_name if kubelet_node else f"bench-dp-{uuid.uuid4().hex[:6]}"
        self.plugin_dir = kubelet_node.device_plugin_dir if kubelet_node else self.host.root / "device-plugins"
        self.watch = NodeWatch(api, self.name)
        self.agents: list[AgentProcess] = []
        self.names: dict[str, str] = {}  # GPU address -> NodePCIDevice name

    @property
    def agent(self) -> AgentProcess:
        return self.agents[-1]

    def start_agent(self) -> AgentProcess:
        log = self.root / f"agent-{len(self.agents)}.log"
        self.agents.append(AgentProcess(self.local, log, self.name, self.host, PCI_IDS, kubelet=self.kubelet).start())
        return self.agent

    async def reported(self) -> None:
        async def all_there():
            if not self.agent.alive():
                raise RuntimeError(f"the agent exited:\n{self.agent.output()[-3000:]}")
            self.names = {a: n for a, n in (await support.device_names(self.api, self.name)).items() if a in self.groups}
            return len(self.names) == self.gpus

        await support.wait_for(all_there, TIMEOUT, 0.1, what="the agent's first report")

    async def label(self, value: str | None) -> None:
        await self.core.patch_node(self.name, {"metadata": {"labels": {GPU_MODE: value}}})

    def sockets(self, resources: list[str]) -> bool:
        return all(live_socket(self.plugin_dir, r) is not None for r in resources)

    async def serving(self, expected: dict[str, int], since: float | None = None, timeout: float = TIMEOUT) -> float:
        """Until every resource in `expected` is served with that count: in allocatable with the
        kubelet (its arrival time, from `since` on), else registered with the stand-in (the
        last Register's time, from `since` on) with its socket there."""
        if self.kubelet:
            def matches(alloc):
                return all(int(alloc.get(r, "0")) == n for r, n in expected.items())

            return await self.watch.until(matches, since, timeout, what=f"{expected} in allocatable")
        wanted = {r for r, n in expected.items() if n}

        async def registered():
            times = {r: t for t, r in self.registrar.registered if since is None or t >= since}
            return wanted <= times.keys() and self.sockets(sorted(wanted)) and max(times[r] for r in wanted)

        return await support.wait_for(registered, timeout, 0.02, what=f"{sorted(wanted)} registered")

    def rss(self) -> tuple[float, float]:
        """The agent's VmRSS and VmHWM, MiB."""
        pid = self.agent.proc.pid
        rss = psutil.Process(pid).memory_info().rss / 2**20
        status = Path(f"/proc/{pid}/status").read_text()
        hwm = int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 1024
        return rss, hwm

    def problems(self) -> list[str]:
        lines = []
        for agent in self.agents:
            lines += [line for line in agent.output().splitlines()
                      if " WARNING " in line or " ERROR " in line or "Traceback" in line]  # fmt: skip
        return lines


# --- Figures against the node ---------------------------------------------------------------


async def gpu_mode_on(node: Node) -> None:
    started = time.monotonic()
    await node.label("true")
    arrived = await node.serving({POOL: node.gpus}, since=started)
    where = "in allocatable" if node.kubelet else "registered"
    print(f"GPU mode on:              {arrived - started:.2f} s from the label to the pool of {node.gpus} {where} "
          f"({node.gpus} groups bound, 1 sample)")
    MEASURED["GPU mode on: label to the pool in allocatable"] = (
        f"{arrived - started:.2f} s (pool of {node.gpus}{'' if node.kubelet else ', registered'})")


async def bench_allocate(node: Node, calls: int) -> None:
    path = live_socket(node.plugin_dir, POOL)
    async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
        stub = api_grpc.DevicePluginStub(channel)
        stream = stub.ListAndWatch(api_pb.Empty())
        listed = await stream.read()
        stream.cancel()
        ids = [d.ID for d in listed.devices]
        samples = []
        for i in range(calls + 1):
            asked = api_pb.ContainerAllocateRequest(devices_ids=[ids[i % len(ids)]])
            request = api_pb.AllocateRequest(container_requests=[asked])
            started = time.perf_counter()
            response = await stub.Allocate(request, timeout=10)
            samples.append(time.perf_counter() - started)
        devices = len(response.container_responses[0].devices)
    p50, p99 = support.p50_p99([s * 1000 for s in samples[1:]])
    print(f"Allocate over gRPC:       p50 {p50:.2f} ms, p99 {p99:.2f} ms over {calls} calls "
          f"(pool of {len(ids)}, one device a call, {devices} device nodes back)")
    MEASURED["`Allocate` over gRPC"] = f"p50 {p50:.2f} ms, p99 {p99:.2f} ms over {calls}"


def wall(stamp: str) -> float:
    """An RFC 3339 time with up to nanoseconds (Go's RFC3339Nano, UTC), as a Unix time."""
    match = re.fullmatch(r"(.*?)(\.\d+)?Z", stamp)
    base = datetime.datetime.fromisoformat(match.group(1) + "+00:00").timestamp()
    return base + float(match.group(2) or 0)


async def bench_pods(node: Node, count: int) -> None:
    samples = []
    for i in range(count):
        name = f"vm-{i}"
        started = time.time()
        await support.create_pod(node.api, NAMESPACE, support.launcher_pod(name, POOL))

        async def created(name=name):
            return next((c for c in node.kubelet.created_containers() if c.get("envs", {}).get("MARK") == name), None)

        record = await support.wait_for(created, TIMEOUT, 0.02, what=f"CreateContainer of {name}")
        samples.append(wall(record["time"]) - started)
        await support.delete_pod(node.api, NAMESPACE, name)
    p50, p99 = support.p50_p99([s * 1000 for s in samples])
    print(f"pod to CreateContainer:   p50 {p50:.0f} ms, p99 {p99:.0f} ms over {count} pods "
          f"(scheduler, kubelet, our Allocate; one pool GPU each, one at a time)")
    MEASURED["pod to CreateContainer (scheduler, kubelet, `Allocate`)"] = f"p50 {p50:.0f} ms, p99 {p99:.0f} ms over {count}"


async def phase() -> None:
    """Wait a random part of the kubelet's status period: an action started right after a
    status arrived would always wait the whole period for the next one."""
    await asyncio.sleep(random.uniform(0, STATUS_PERIOD))


def print_samples(what: str, samples: list[float], unit: str, tail: str = "", spread: str = "p99") -> str:
    p50, p99 = support.p50_p99([s * 1000 for s in samples])
    top = p99 if spread == "p99" else max(samples) * 1000
    figure = f"p50 {p50:.0f} ms, {spread} {top:.0f} ms over {len(samples)}"
    print(f"{what:<26}{figure} {unit}{tail}")
    return figure


async def bench_assign(node: Node, pool: PluginStream, cycles: int) -> None:
    address = sorted(node.names)[0]
    name = node.names[address]
    resource = exclusive_resource_name(name)
    n = node.gpus
    until = node.watch.until
    up, listed, assigned, pool_down, down, back, relisted, gone = ([] for _ in range(8))
    for _ in range(cycles):
        await phase()
        seen = asyncio.create_task(appears(lambda: live_socket(node.plugin_dir, resource) is not None))
        started = time.monotonic()
        await support.assign(node.api, name, NAMESPACE)
        listed.append(await pool.until(lambda v: v.get("devices") == n - 1, started, what=f"pool lists {n - 1}") - started)
        up.append(await seen - started)
        assigned.append(await until(lambda a: a.get(resource) == "1", started, what=f"{resource} in allocatable") - started)
        pool_down.append(await until(lambda a: int(a.get(POOL, "0")) == n - 1, started, what=f"pool of {n - 1}") - started)

        await phase()
        seen = asyncio.create_task(appears(lambda: live_socket(node.plugin_dir, resource) is None))
        started = time.monotonic()
        await support.assign(node.api, name, "")
        relisted.append(await pool.until(lambda v: v.get("devices") == n, started, what=f"pool lists {n}") - started)
        down.append(await seen - started)
        back.append(await until(lambda a: int(a.get(POOL, "0")) == n, started, what=f"pool of {n}") - started)
        gone.append(await until(lambda a: a.get(resource, "0") == "0", started, what=f"{resource} at 0") - started)
    MEASURED["assign, agent side (spec write to the exclusive plugin's socket up)"] = print_samples(
        "assign, agent side:", up, "cycles", " (spec write to the exclusive plugin's socket up)")
    print_samples("", listed, "cycles", f" (to the pool plugin listing {n - 1})")
    MEASURED["assign to allocatable"] = print_samples(
        "assign to allocatable:", assigned, "cycles", f" ({resource.split('/')[0]}/<name> = 1)")
    print_samples("", pool_down, "cycles", f" (pool at {n - 1})")
    MEASURED["unassign, agent side (spec write to the socket gone)"] = print_samples(
        "unassign, agent side:", down, "cycles", " (spec write to the exclusive plugin's socket gone)")
    print_samples("", relisted, "cycles", f" (to the pool plugin listing {n})")
    MEASURED["unassign to allocatable (the pool back at its size)"] = (
        print_samples("unassign to allocatable:", back, "cycles", f" (pool back at {n})") + f" (pool back at {n})")
    print_samples("", gone, "cycles", " (exclusive at 0)")


async def bench_vanish(node: Node, pool: PluginStream, trials: int) -> None:
    address = sorted(node.names)[-1]
    vfio_node = node.host.vfio_node(node.groups[address])
    n = node.gpus
    unhealthy, dropped = [], []
    for _ in range(trials):
        await node.watch.until(lambda a: int(a.get(POOL, "0")) == n, what=f"pool of {n}")
        await pool.until(lambda v: v.get("healthy") == n, what=f"{n} healthy")
        await phase()
        started = time.monotonic()
        vfio_node.unlink()
        try:
            unhealthy.append(await pool.until(lambda v: v.get("healthy") == n - 1, started, what="one Unhealthy") - started)
            drop = await node.watch.until(lambda a: int(a.get(POOL, "0")) == n - 1, started, what=f"pool of {n - 1}")
            dropped.append(drop - started)
        finally:
            vfio_node.touch()
    await node.watch.until(lambda a: int(a.get(POOL, "0")) == n, what=f"pool of {n}")
    MEASURED["`/dev/vfio/<group>` removed to the device Unhealthy in ListAndWatch"] = print_samples(
        "/dev/vfio/<group> gone:", unhealthy, "trials", " (unlink to the pool plugin listing it Unhealthy)", spread="max")
    print_samples("", dropped, "trials", " (unlink to the pool down by one in allocatable)", spread="max")


async def bench_restart(node: Node, trials: int) -> None:
    n = node.gpus
    for _ in range(trials):
        await node.watch.until(lambda a: int(a.get(POOL, "0")) == n, what=f"pool of {n}")
        started = time.monotonic()
        await asyncio.to_thread(node.kubelet.restart_kubelet)
        ready = time.monotonic() - started

        # A drop may come after the new kubelet's first status: give it a moment to show.
        dropped = None
        with contextlib.suppress(TimeoutError):
            dropped = await node.watch.until(lambda a: int(a.get(POOL, "0")) != n, started, timeout=10)
        if dropped is None:
            print(f"kubelet restart:          Ready again in {ready:.2f} s; the pool never left allocatable")
            MEASURED["kubelet restart"] = f"Ready again in {ready:.2f} s; the pool never left allocatable"
        else:
            back = await node.watch.until(lambda a: int(a.get(POOL, "0")) == n, dropped, what=f"pool of {n} after the restart")
            print(f"kubelet restart:          {back - started:.2f} s to the pool of {n} back in allocatable "
                  f"(left at +{dropped - started:.2f} s; kubelet Ready at +{ready:.2f} s)")
            MEASURED["kubelet restart"] = (f"Ready again in {ready:.2f} s; the pool left allocatable at +{dropped - started:.2f} s "
                                           f"and was back at +{back - started:.2f} s")


async def bench_rss(node: Node, assigned_count: int) -> None:
    chosen = sorted(node.names)[:assigned_count]
    resources = [exclusive_resource_name(node.names[a]) for a in chosen]
    expected = {POOL: node.gpus - assigned_count, **{r: 1 for r in resources}}
    for address in chosen:
        await support.assign(node.api, node.names[address], NAMESPACE)
    await node.serving(expected)
    await asyncio.sleep(SETTLE)
    plugins, devices = 1 + len(resources), 2 * node.gpus
    rss, hwm = node.rss()
    print(f"agent RSS, long-running:  {rss:.0f} MiB (VmHWM {hwm:.0f} MiB) with {devices} devices, {plugins} plugins, "
          f"after everything above")

    old = node.agent
    old.stop()
    if node.kubelet:  # the old agent's plugins gone from allocatable, so the new one's arrival is its own
        with contextlib.suppress(TimeoutError):
            await node.watch.until(lambda a: all(a.get(r, "0") == "0" for r in expected), timeout=15)
    started = time.monotonic()
    node.start_agent()
    arrived = await node.serving(expected, since=started)
    await asyncio.sleep(SETTLE)
    rss, hwm = node.rss()
    where = "in allocatable" if node.kubelet else "registered"
    print(f"agent restart:            {arrived - started:.2f} s from a fresh agent's start to all {plugins} resources {where}")
    print(f"agent RSS:                {rss:.0f} MiB (VmHWM {hwm:.0f} MiB) with {devices} devices, {plugins} plugins "
          f"(fresh agent, {SETTLE:g} s after; goal under 80 MiB)")
    MEASURED["agent restart to all its resources in allocatable"] = (
        f"{arrived - started:.2f} s ({plugins} resources{'' if node.kubelet else ', registered'})")
    MEASURED["agent RSS"] = f"{rss:.0f} MiB ({devices} devices, {plugins} plugins)"


async def bench(local: cluster.LocalCluster, root: Path, args: argparse.Namespace) -> None:
    reason = "--no-kubelet" if args.no_kubelet else kubelet.why_unavailable(local)
    if reason:
        print(f"real kubelet:             not run ({reason}); figures that need it are left out")
    api = await connect(str(local.kubeconfig))
    scheduler = kubelet_node = registrar = kernel = node = operator = None
    watching = streaming = None
    try:
        await support.create_namespace(api, NAMESPACE)
        # The operator hands an assigned device out (Assigned=True): the agent serves it only then.
        (root / "logs").mkdir(parents=True, exist_ok=True)
        operator = OperatorProcess(local, root / "logs" / "operator.log")
        operator.start()
        if not reason:
            scheduler = kubelet.Scheduler(local, root / "logs").start()
            kubelet_node = await asyncio.to_thread(kubelet.KubeletNode(local, "bench-dp").start)
        node = Node(local, api, root, args.gpus, kubelet_node)
        if not kubelet_node:
            await support.ensure_node(api, node.name)
            node.registrar = registrar = await Registrar(node.plugin_dir).start()
        kernel = FakeKernel(node.host).start()
        watching = asyncio.create_task(node.watch.run())
        node.start_agent()
        await node.reported()
        await gpu_mode_on(node)
        pool = PluginStream(live_socket(node.plugin_dir, POOL))
        streaming = asyncio.create_task(pool.run())
        await bench_allocate(node, args.allocates)
        if kubelet_node:
            await bench_pods(node, args.pods)
            await bench_assign(node, pool, args.cycles)
            await bench_vanish(node, pool, args.vanish)
            await bench_restart(node, args.restarts)
        await bench_rss(node, min(3, args.gpus - 1))
    finally:
        if node:
            for agent in node.agents:
                agent.stop()
        for task in (watching, streaming):
            if task:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if kubelet_node:
            await asyncio.to_thread(kubelet_node.stop)
        if scheduler:
            scheduler.stop()
        if registrar:
            await registrar.stop()
        if operator:
            operator.stop()
        if kernel:
            kernel.stop()
        await api.close()
    problems = node.problems() if node else []
    print(f"agent log:                {len(problems)} warnings or errors" + "".join(f"\n    {p}" for p in problems[:10]))
    print()
    print(page_table(MEASURED))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=4, help="A10s (each with its audio function) on the node; at least 2")
    parser.add_argument("--allocates", type=int, default=500, help="Allocate calls over gRPC")
    parser.add_argument("--pods", type=int, default=10, help="pods created one after another")
    parser.add_argument("--cycles", type=int, default=20, help="assign / unassign cycles")
    parser.add_argument("--vanish", type=int, default=5, help="/dev/vfio/<group> unlink trials")
    parser.add_argument("--restarts", type=int, default=1, help="kubelet restarts")
    parser.add_argument("--bind-rounds", type=int, default=50, help="bind_group / release_group rounds")
    parser.add_argument("--no-kubelet", action="store_true", help="do not run the real kubelet even where it can run")
    args = parser.parse_args()
    if args.gpus < 2:
        parser.error("--gpus: at least 2")

    print(f"machine:                  {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        root = Path(tmp)
        bench_bind(root / "bind", args.bind_rounds)
        local = cluster.start(root / "controlplane")
        try:
            asyncio.run(bench(local, root, args))
        finally:
            local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
