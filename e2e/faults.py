"""Faults injected into a running system, and the system they are injected into.

`Rig` is a private control plane (never the shared test cluster: faults stop its API server
and etcd), the operator and one agent per simulated node as their own processes, a KubeVirt
CR, the `cluster` PassthroughConfig and tenant namespaces; it keeps the record of what the
admin asked for, from which `expected()` makes the invariant's snapshot (`e2e.invariants`).
Its writes are the admin's, and retry through a server that is away, as kubectl's user would.

Each fault kind in `KINDS` injects its fault into a rig and returns when the fault has
ended; `run_trial` runs one with a seed, then measures how long the invariant takes to hold
and which processes exited on their own. The fault tests and `e2e/chaos.py` both use these.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from e2e import build, invariants, support
from e2e.cluster import LocalCluster, prepare
from e2e.fakesysfs import HOST_BRIDGE, FakeHost
from e2e.processes import AgentProcess, OperatorProcess
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.connect import connect
from passthrough.kube.custom import Custom
from passthrough.kube.client import ApiError
from passthrough.pci.naming import node_pci_device_name

REPO = Path(__file__).resolve().parent.parent
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
A10 = ("10de", "2236", "030200")
NOT_FOUND_GRACE = 8  # seconds; a deleted Node must come back well within it
CONVERGE_LIMIT = 30.0  # seconds after a fault ends
STOP_GRACE = 3.0  # seconds a stopped etcd or kube-apiserver gets to exit before SIGKILL (as a pod's grace period)
BURST = 200
T = TypeVar("T")


async def retrying(call: Callable[[], Awaitable[T]], timeout: float = 90) -> T:
    """`call()` again, backing off, while the API server is away, refuses (5xx, 429) or hangs up."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            return await call()
        except (ApiException, ApiError) as exc:
            if exc.status not in (0, 429, 500, 502, 503, 504) or time.monotonic() > deadline:
                raise
        except invariants.UNREACHABLE:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


@dataclass
class Trial:
    """One fault kind run once: what was injected, how long the invariant took, what broke."""

    kind: str
    seed: int
    faults: int = 0
    converge_s: float = math.nan  # from the end of the fault to the invariant holding
    violations: list[str] = field(default_factory=list)
    exits: list[str] = field(default_factory=list)  # processes that exited on their own (each started again)
    note: str = ""

    @property
    def ok(self) -> bool:
        return not self.violations and not self.exits


class Rig:
    """The system under faults. `await Rig.up(workdir)`; `await rig.close()` stops it all."""

    def __init__(self, workdir: Path, nodes: int = 2, devices_per_node: int = 6, tenants: int = 3) -> None:
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.cluster = LocalCluster(workdir=workdir / "controlplane", bin_dir=build.ensure_binaries())
        self.node_names = [f"fault-node-{i}" for i in range(nodes)]
        self.devices_per_node = devices_per_node
        self.tenants = [f"team-{i}" for i in range(tenants)]
        self.api: client.ApiClient | None = None
        self.operator: OperatorProcess | None = None
        self.agents: dict[str, AgentProcess] = {}
        self.hosts: dict[str, FakeHost] = {}
        self.present: dict[str, dict[str, str]] = {}  # node -> address -> NodePCIDevice name, of devices it has
        self.removed: dict[str, dict[str, str]] = {}  # node -> address -> name, of devices taken out
        self._next_bus: dict[str, int] = {}
        self.assignments: dict[str, str] = {}  # what the admin asked for: NodePCIDevice -> namespace
        self.deleted_namespaces: set[str] = set()
        self.burst_names: list[str] = []
        self.history: list[str] = []  # KIND:SEED of every trial run so far (what `chaos.py --replay` takes)
        self.exits: list[str] = []  # processes found exited on their own
        self.down: set[str] = set()  # processes stopped on purpose right now
        self._monitor: asyncio.Task | None = None
        self._serial = 0

    # -- start and stop ----------------------------------------------------------------------

    @classmethod
    async def up(cls, workdir: Path, **kwargs: Any) -> Rig:
        rig = cls(workdir, **kwargs)
        try:
            await rig._start()
        except BaseException:
            await rig.close()
            raise
        return rig

    async def _start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self.cluster.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster.start(before_controllers=prepare)
        self.api = await connect(str(self.cluster.kubeconfig))
        for namespace in ("kubevirt", *self.tenants):
            await support.create_namespace(self.api, namespace)
        await support.create_kubevirt(self.api, "kubevirt")
        config = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                  "spec": {"kubevirt": {"namespace": "kubevirt", "name": "kubevirt"}}}  # fmt: skip
        await Custom(self.api, "passthroughconfigs").apply(config, "admin")
        self.operator = OperatorProcess(self.cluster, self.logs / "operator.log", f"--not-found-grace={NOT_FOUND_GRACE}s")
        await asyncio.to_thread(self.operator.start)
        for node in self.node_names:
            await support.ensure_node(self.api, node)
            host = self.hosts[node] = FakeHost(self.workdir / "nodes" / node)
            host.add_device("0000:00:00.0", *HOST_BRIDGE, iommu_group=0)
            self.present[node], self.removed[node], self._next_bus[node] = {}, {}, 0x10
            for _ in range(self.devices_per_node):
                self._add_gpu(node)
            self.agents[node] = self._agent(node).start()
        for node in self.node_names:
            await self.wait_ready(node, set(self.present[node].values()))
        self._monitor = asyncio.create_task(self._watch_processes(), name="process-monitor")
        await invariants.converge(self.api, self.expected(), timeout=60)

    async def close(self) -> None:
        try:
            if self._monitor is not None:
                self._monitor.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._monitor
            for agent in self.agents.values():
                agent.stop()
            if self.operator is not None and self.operator.proc is not None:
                self.operator.stop()
            if self.api is not None:
                await self.api.close()
        finally:
            self.cluster.stop()

    def _agent(self, node: str) -> AgentProcess:
        return AgentProcess(self.cluster, self.logs / f"agent-{node}.log", node, self.hosts[node], PCI_IDS, "--no-device-plugin")

    def _add_gpu(self, node: str, address: str | None = None) -> str:
        """An A10 in an IOMMU group of its own behind a root port of its own; its address."""
        host = self.hosts[node]
        if address is None:
            bus = self._next_bus[node]
            self._next_bus[node] += 1
            n = bus - 0x10
            host.add_root_port(f"0000:00:{n // 8 + 1:02x}.{n % 8}", f"{bus:02x}", iommu_group=bus)
            address = f"0000:{bus:02x}:00.0"
        bus = int(address.split(":")[1], 16)
        host.add_device(address, *A10, driver="nvidia", iommu_group=0x100 + bus, subsystem=("10de", "1482"))
        self.present[node][address] = node_pci_device_name(address, A10[0], A10[1], node)
        return address

    # -- what the admin does, through a server that may be away ---------------------------------

    async def assign(self, name: str, namespace: str) -> None:
        """Set (or with "" clear) spec.assignedNamespace, and record it once the server took it."""
        objects = client.CustomObjectsApi(self.api)
        await retrying(lambda: objects.patch_cluster_custom_object(
            "passthrough.io", "v1alpha1", "nodepcidevices", name, {"spec": {"assignedNamespace": namespace}},
            _content_type="application/merge-patch+json", _request_timeout=15))  # fmt: skip
        if namespace:
            self.assignments[name] = namespace
        else:
            self.assignments.pop(name, None)

    def expected(self) -> invariants.Expected:
        """The snapshot the invariant is checked against: what was asked for, and what of it is kept back
        (a namespace that was deleted, a device taken out of its node longer than the grace period)."""
        gone = {name for removed in self.removed.values() for name in removed.values()}
        withheld = {n for n, ns in self.assignments.items() if n in gone or ns in self.deleted_namespaces}
        return invariants.Expected(dict(self.assignments), withheld)

    async def adopt(self) -> None:
        """Take what the objects say as what was asked for: after a failed trial, so the next starts clean.

        The agents rescan first (SIGHUP), so devices whose objects were lost are reported again.
        """
        for agent in self.agents.values():
            if agent.alive():
                agent.proc.send_signal(signal.SIGHUP)
        for node in self.node_names:
            await self.wait_ready(node, set(self.present[node].values()))
        nodes = await retrying(lambda: Custom(self.api, "nodepcidevices").list())
        self.assignments = {o["metadata"]["name"]: o["spec"]["assignedNamespace"] for o in nodes["items"]
                            if (o.get("spec") or {}).get("assignedNamespace")}  # fmt: skip

    def churn_devices(self) -> list[str]:
        return sorted(name for node in self.node_names for name in self.present[node].values())

    async def churn(self, rng: random.Random, stop: asyncio.Event, pause: tuple[float, float] = (0.05, 0.4)) -> int:
        """Assign, reassign and unassign the agents' devices at random until `stop`; the writes made."""
        writes = 0
        while not stop.is_set():
            name = rng.choice(self.churn_devices())
            current = self.assignments.get(name, "")
            await self.assign(name, rng.choice([ns for ns in self.tenants if ns != current] + ([""] if current else [])))
            writes += 1
            await support.wait_event(stop, rng.uniform(*pause))
        return writes

    async def wait_ready(self, node: str, names: set[str], timeout: float = 60) -> None:
        kind = Custom(self.api, "nodepcidevices")

        async def ready() -> bool:
            items = (await retrying(lambda: kind.list(f"{NODE_LABEL}={node}")))["items"]
            return names <= {o["metadata"]["name"] for o in items if invariants.is_true(o, "Ready")}

        await support.wait_for(ready, timeout, 0.2, what=f"{len(names)} Ready devices on {node} (agent log {self.logs}/agent-{node}.log)")

    async def burst_devices(self) -> list[str]:
        """BURST devices on a node of their own, written as its agent would (made once)."""
        if not self.burst_names:
            node = await retrying(lambda: support.ensure_node(self.api, "fault-burst"))
            limit = asyncio.Semaphore(16)

            async def report(i: int) -> str:
                async with limit:
                    return await retrying(lambda: support.report_device(self.api, node, support.gpu(f"0000:{i // 8 + 1:02x}:{i % 8:02x}.0")))

            self.burst_names = list(await asyncio.gather(*(report(i) for i in range(BURST))))
        return self.burst_names

    # -- the processes ------------------------------------------------------------------------

    def processes(self) -> dict[str, subprocess.Popen | None]:
        procs: dict[str, subprocess.Popen | None] = {"operator": self.operator.proc if self.operator else None}
        procs.update({f"agent {node}": agent.proc for node, agent in self.agents.items()})
        return procs

    def exited(self) -> list[str]:
        """Processes not running that should be, with their exit codes."""
        return [f"{name} exited with {proc.returncode}" for name, proc in self.processes().items()
                if name not in self.down and proc is not None and proc.poll() is not None]  # fmt: skip

    async def _watch_processes(self) -> None:
        # A process that exits on its own is recorded and started again, as its Deployment or
        # DaemonSet would, so one failure does not spoil every later trial.
        while True:
            for line in self.exited():
                self.exits.append(line)
                name = line.split(" exited")[0]
                if name == "operator":
                    await self.restart_operator(kill=False)
                else:
                    node = name.removeprefix("agent ")
                    self.agents[node] = self._agent(node).start()
            await asyncio.sleep(0.2)

    async def restart_operator(self, kill: bool = True) -> None:
        """SIGKILL the operator (or find it dead) and start it again, as its Deployment would."""
        self.down.add("operator")
        try:
            self.operator.stop(signal.SIGKILL if kill else signal.SIGTERM)
            await asyncio.to_thread(self.operator.start)
        finally:
            self.down.discard("operator")

    def unique(self, prefix: str) -> str:
        self._serial += 1
        return f"{prefix}-{self._serial}"


# -- the fault kinds ----------------------------------------------------------------------------
# Each injects its fault into the rig, keeps the rig's record of what the admin asked for, and
# returns time.monotonic() at the moment the fault ended.


async def apiserver_restart(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """kube-apiserver stopped for a few seconds in the middle of a burst of BURST assignments."""
    names = await rig.burst_devices()
    now = {rig.assignments.get(n, "") for n in names}
    target = rng.choice([ns for ns in rig.tenants if ns not in now])
    done = 0
    limit = asyncio.Semaphore(16)

    async def one(name: str) -> None:
        nonlocal done
        async with limit:
            await rig.assign(name, target)
        done += 1

    burst = asyncio.ensure_future(asyncio.gather(*(one(n) for n in names)))
    stop_at = rng.randint(BURST // 10, BURST // 2)
    await support.wait_for(lambda: asyncio.sleep(0, done >= stop_at or burst.done()), 60, 0.01, what="the burst under way")
    if burst.done():
        raise AssertionError(f"the burst of {BURST} was over before kube-apiserver could be stopped")
    stopped_after = done
    outage = await _outage(rig, "kube-apiserver", rng.uniform(2, 5))
    trial.faults += 1
    trial.note = f"kube-apiserver stopped after {stopped_after} of {BURST} assignments to {target}; {outage}"
    ended = time.monotonic()
    await burst
    return ended


async def _outage(rig: Rig, component: str, down_for: float) -> str:
    """Stop `component`, keep it down `down_for` s, start it again and wait until the API server
    is ready; what it took, for the trial's note."""
    started = time.monotonic()
    exited = await asyncio.to_thread(rig.cluster.stop_component, component, signal.SIGTERM, STOP_GRACE)
    stopped = time.monotonic()
    await asyncio.sleep(down_for)
    rig.cluster.start_component(component, wait=False)
    await asyncio.to_thread(rig.cluster.wait_component, component)
    await asyncio.to_thread(rig.cluster.wait_component, "kube-apiserver")
    ready = time.monotonic()
    how = "SIGTERM" if exited else f"SIGTERM, SIGKILL after {STOP_GRACE:.0f}s"
    return (f"stopped in {stopped - started:.1f}s ({how}), {down_for:.1f}s down, ready again {ready - stopped - down_for:.1f}s "
            f"after its start ({ready - started:.0f}s from stop to ready)")


async def etcd_restart(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """etcd stopped for a few seconds while the admin keeps assigning."""
    stop = asyncio.Event()
    churn = asyncio.create_task(rig.churn(random.Random(rng.random()), stop))
    await asyncio.sleep(rng.uniform(0.5, 2))
    outage = await _outage(rig, "etcd", rng.uniform(2, 5))
    trial.faults += 1
    ended = time.monotonic()
    stop.set()
    writes = await churn
    trial.note = f"etcd: {outage}; {writes} assignment writes around it"
    return ended


async def operator_kill(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """The operator SIGKILLed at random moments while assignments and unassignments go on."""
    stop = asyncio.Event()
    churn = asyncio.create_task(rig.churn(random.Random(rng.random()), stop))
    kills = rng.randint(1, 3)
    delays = []
    for _ in range(kills):
        delays.append(rng.uniform(0.05, 2.5))
        await asyncio.sleep(delays[-1])
        await rig.restart_operator(kill=True)
        trial.faults += 1
    await asyncio.sleep(rng.uniform(0, 1))
    stop.set()
    writes = await churn
    trial.note = f"{kills} SIGKILL(s), {', '.join(f'{d:.2f}s' for d in delays)} after the last start; {writes} assignment writes"
    return time.monotonic()


async def agent_hardware_change(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """An agent restarted on changed hardware: an assigned device gone, a new one added (and the
    device taken out the time before put back). The device gone keeps its assignment; once the
    grace period is over it is not handed out until it returns."""
    node = rng.choice(rig.node_names)
    host = rig.hosts[node]
    rig.down.add(f"agent {node}")
    rig.agents[node].stop()
    back = list(rig.removed[node])
    for address in back:
        del rig.removed[node][address]
        rig._add_gpu(node, address)
    assigned = [a for a, n in rig.present[node].items() if n in rig.assignments and a not in back]
    gone = rng.choice(assigned or [a for a in rig.present[node] if a not in back])
    host.remove_device(gone)
    rig.removed[node][gone] = rig.present[node].pop(gone)
    added = rig._add_gpu(node)
    rig.agents[node] = rig._agent(node).start()
    rig.down.discard(f"agent {node}")
    trial.faults += 1
    ended = time.monotonic()
    new = rig.present[node][added]
    # The admin gives the new device to a tenant as soon as it shows up.
    await rig.wait_ready(node, {new}, timeout=CONVERGE_LIMIT)
    await rig.assign(new, rng.choice(rig.tenants))
    trial.note = (f"{node}: {gone} taken out ({'assigned' if rig.removed[node][gone] in rig.assignments else 'unassigned'}), "
                  f"{added} added{', ' + ', '.join(back) + ' put back' if back else ''}")  # fmt: skip
    return ended


async def node_recreate(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """A Node deleted and created again under the same name: its devices keep their assignments.

    A node with an assigned device taken out (by `agent_hardware_change`) goes first: a node
    that re-registers after a reboot without a card is the case most worth trying.
    """
    node = rng.choice([n for n in rig.node_names if set(rig.removed[n].values()) & set(rig.assignments)] or rig.node_names)
    core = client.CoreV1Api(rig.api)
    if not any(n in rig.assignments for n in rig.present[node].values()):
        await rig.assign(rng.choice(sorted(rig.present[node].values())), rng.choice(rig.tenants))
        await invariants.converge(rig.api, rig.expected(), CONVERGE_LIMIT)
    live = await retrying(lambda: core.read_node(node))
    await retrying(lambda: core.delete_node(node))
    trial.faults += 1

    async def gone() -> bool:
        try:
            await core.read_node(node)
        except ApiException as exc:
            return exc.status == 404
        return False

    await support.wait_for(gone, 30, 0.05, what=f"Node {node} deleted")
    away = rng.uniform(0.5, 2)
    await asyncio.sleep(away)
    body = client.V1Node(metadata=client.V1ObjectMeta(name=node, labels=live.metadata.labels))
    await retrying(lambda: core.create_node(body))
    held = sum(1 for n in rig.present[node].values() if n in rig.assignments)
    gone = sum(1 for n in rig.removed[node].values() if n in rig.assignments)
    trial.note = f"Node {node} ({held} assigned devices, {gone} assigned and taken out) away for {away:.1f}s"
    return time.monotonic()


async def namespace_deleted_with_vm(rig: Rig, rng: random.Random, trial: Trial) -> float:
    """A namespace deleted while a VirtualMachine there lists its device: the PCIDevice goes with
    the namespace, the assignment stays (not handed out: a new namespace of that name does not
    inherit it)."""
    namespace = rig.unique(f"vm-{trial.seed % 10000}")
    await retrying(lambda: support.create_namespace(rig.api, namespace))
    name = rng.choice(rig.churn_devices())
    await rig.assign(name, namespace)
    vm = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm", "namespace": namespace},
        "spec": {"runStrategy": "Always", "template": {"spec": {"domain": {
            "devices": {"hostDevices": [{"name": "dev0", "deviceName": f"passthrough.io/{name}"}]},
            "resources": {"requests": {"memory": "1Gi"}}}}}},
    }  # fmt: skip
    objects = client.CustomObjectsApi(rig.api)
    await retrying(lambda: objects.create_namespaced_custom_object("kubevirt.io", "v1", namespace, "virtualmachines", vm))
    devices = Custom(rig.api, "pcidevices", namespaced=True)

    async def held() -> bool:
        device = await devices.get(name, namespace)
        return bool(device) and "passthrough.io/in-use" in (device["metadata"].get("finalizers") or [])

    await support.wait_for(held, CONVERGE_LIMIT, 0.1, what=f"PCIDevice {namespace}/{name} held by the VM's finalizer")
    await retrying(lambda: client.CoreV1Api(rig.api).delete_namespace(namespace))
    rig.deleted_namespaces.add(namespace)
    trial.faults += 1
    trial.note = f"namespace {namespace} deleted with VirtualMachine vm listing {name}"
    return time.monotonic()


KINDS: dict[str, Callable[[Rig, random.Random, Trial], Awaitable[float]]] = {
    "operator-kill": operator_kill,
    "agent-hardware": agent_hardware_change,
    "namespace-delete": namespace_deleted_with_vm,
    "etcd": etcd_restart,
    "apiserver-burst": apiserver_restart,
    "node-recreate": node_recreate,
}


# How long the invariant must keep holding once it holds: long enough for the garbage collector
# (a deleted Node's dependents go within a second or two) and the operator's late reactions.
SETTLE = {"node-recreate": 5.0}
DEFAULT_SETTLE = 2.0


async def run_trial(rig: Rig, kind: str, seed: int, limit: float = CONVERGE_LIMIT) -> Trial:
    """Inject one fault of `kind` with `seed`, then wait up to `limit` s for the invariant to hold
    (and keep holding, see SETTLE).

    A trial that fails leaves the rig adopting what the objects say, so the next starts clean.
    """
    trial = Trial(kind, seed)
    rig.history.append(f"{kind}:{seed}")
    exits_before = len(rig.exits)
    try:
        ended = await KINDS[kind](rig, random.Random(seed), trial)
        trial.converge_s = (time.monotonic() - ended) + await invariants.converge(
            rig.api, rig.expected(), timeout=max(0.0, limit - (time.monotonic() - ended)), settle=SETTLE.get(kind, DEFAULT_SETTLE)
        )
    except invariants.NotConverged as exc:
        trial.violations = exc.violations
    except AssertionError as exc:  # a step of the fault itself timed out
        trial.violations = [f"the fault did not run through: {exc}"]
    trial.exits = rig.exits[exits_before:] + rig.exited()
    if not trial.ok:
        await rig.adopt()
    return trial
