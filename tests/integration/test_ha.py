"""Two operator replicas against the real API server: both serve the webhooks, the Lease's holder reconciles.

The replicas run as their own processes with `--leader-elect`, each with its webhook server on
its own loopback port behind a TCP balancer (e2e/balancer.py) that stands in for their Service;
the chart's ValidatingWebhookConfiguration calls the balancer. Pods and VMs that ask for the
namespace's devices are created in a loop through the webhook while replicas are killed and
restarted: none may be refused, and reconciliation (a device assigned after the kill gets its
PCIDevice) must resume on the other replica within 15 s.

Each replica logs when it starts and stops reconciling, with a stamp of the machine's monotonic
clock (CLOCK_MONOTONIC, the same for every process here): the test orders those stamps and
the Lease's transitions to show that no two replicas ever reconciled at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from e2e import chart, support
from e2e.balancer import Balancer
from e2e.cluster import free_ports
from e2e.processes import OperatorProcess, WebhookServing
from e2e.proxy import FlakyProxy
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster

TAKEOVER_LIMIT = 15.0
_STARTED = re.compile(r"leading: holding Lease \S+ as (\S+) \(transitions (\d+)\); reconciling from monotonic ([\d.]+)")
_STOPPED = re.compile(r"stopped leading.*? at monotonic ([\d.]+)")


class Replica:
    """One operator replica, started again under a new identity (a new pod) each time."""

    def __init__(self, name: str, cluster, folder: Path, serving: WebhookServing, balancer: Balancer, lease: str) -> None:
        self.name, self.cluster, self.folder, self.serving, self.balancer, self.lease = name, cluster, folder, serving, balancer, lease
        self.generation = 0
        self.proc: OperatorProcess | None = None
        self.port = self.ready_port = 0
        self.terms: list[Term] = []  # every generation's, in order
        self.kubeconfig: Path | None = None

    @property
    def identity(self) -> str:
        return f"{self.name}-{self.generation}"

    def start(self, timeout: float = 60) -> None:
        """Start, wait until ready (webhooks listening, caches filled), put it behind the balancer."""
        self.generation += 1
        self.port, self.ready_port = free_ports(2)
        ready_port = self.ready_port
        args = [
            f"--webhook-port={self.port}", "--webhook-addr=127.0.0.1", f"--webhook-cert-dir={self.serving.directory}",
            f"--readiness=http://127.0.0.1:{ready_port}/readyz", "--leader-elect", f"--leader-elect-identity={self.identity}",
            f"--leader-elect-resource-name={self.lease}", "--leader-elect-resource-namespace=default",
        ]  # fmt: skip
        if self.kubeconfig is not None:
            args.append(f"--kubeconfig={self.kubeconfig}")
        self.proc = OperatorProcess(self.cluster, self.folder / f"{self.identity}.log", *args)
        self.proc.start(timeout)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{ready_port}/readyz", timeout=1) as answer:
                    if answer.status == 200:
                        break
            assert time.monotonic() < deadline, f"{self.identity} not ready after {timeout}s:\n{self.proc.output()[-3000:]}"
            time.sleep(0.1)
        self.balancer.add(self.port)

    def ready(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ready_port}/readyz", timeout=5) as answer:
            return answer.status == 200

    def kill(self) -> float:
        """SIGKILL, as the OOM killer or a node loss does; the monotonic time it is certainly dead."""
        assert self.proc and self.proc.proc
        self.proc.proc.kill()
        self.proc.proc.wait()
        self.proc.log.close()
        ended = time.monotonic()
        self._close_terms(ended)
        return ended

    def stop(self) -> None:
        """What a rolling update does to an old pod: out of the endpoints, then SIGTERM."""
        self.balancer.remove(self.port)
        assert self.proc
        self.proc.stop(signal.SIGTERM)
        assert self.proc.proc.returncode == 0, self.proc.output()[-3000:]
        self._close_terms(None)

    def _close_terms(self, killed_at: float | None) -> None:
        terms = parse_terms(self.identity, self.proc.output())
        if terms and terms[-1].end is None and killed_at is not None:
            terms[-1].end = killed_at
        assert all(t.end is not None for t in terms), f"{self.identity} stopped with a term open: {terms}"
        self.terms += terms

    def all_terms(self) -> list[Term]:
        running = parse_terms(self.identity, self.proc.output()) if self.proc and self.proc.proc.poll() is None else []
        return self.terms + running

    def output(self) -> str:
        return self.proc.output() if self.proc else ""


@dataclasses.dataclass
class Term:
    identity: str
    transitions: int
    start: float
    end: float | None  # None: still leading


def parse_terms(identity: str, log: str) -> list[Term]:
    terms: list[Term] = []
    for line in log.splitlines():
        if m := _STARTED.search(line):
            assert m.group(1) == identity, line
            assert not terms or terms[-1].end is not None, f"{identity} started a term inside another:\n{line}"
            terms.append(Term(identity, int(m.group(2)), float(m.group(3)), None))
        elif m := _STOPPED.search(line):
            assert terms and terms[-1].end is None, f"{identity} stopped a term it had not started:\n{line}"
            terms[-1].end = float(m.group(1))
    return terms


@dataclasses.dataclass
class Outcomes:
    admitted: int = 0
    denied: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)


class Creator:
    """Pods and VMs that ask for the namespace's devices, created one after another through the
    webhook; every few, one asking for another namespace's device, which must be denied (not
    failed). `pause` holds the loop between two creations."""

    def __init__(self, api, namespace: str, own: list[str], foreign: str) -> None:
        self.session = session_of(api)
        self.namespace, self.own, self.foreign = namespace, own, foreign
        self.outcomes = Outcomes()
        self.pause = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._stop = False
        self.count = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> Outcomes:
        self._stop = True
        assert self._task
        await self._task
        return self.outcomes

    async def until(self, admitted: int, timeout: float = 120) -> None:
        """Until `admitted` more have been admitted."""
        target = self.outcomes.admitted + admitted
        await support.wait_for(lambda: _true(self.outcomes.admitted >= target), timeout, what=f"{admitted} admissions")

    async def _loop(self) -> None:
        while not self._stop:
            async with self.pause:
                await self._one()
            await asyncio.sleep(0.02)

    async def _one(self) -> None:
        self.count += 1
        i = self.count
        device = self.own[i % len(self.own)]
        expect_denial = i % 5 == 0
        if expect_denial:
            device = self.foreign
        resource = f"passthrough.io/{device}"
        if i % 2:
            path, query = f"/api/v1/namespaces/{self.namespace}/pods", None
            body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "launcher-"},
                    "spec": {"automountServiceAccountToken": False,
                             "containers": [{"name": "compute", "image": "virt-launcher:test",
                                             "resources": {"limits": {resource: "1"}}}]}}  # fmt: skip
            if expect_denial:
                query = {"dryRun": "All"}
        else:
            # A dry run: the webhook judges it all the same, and no VM stays to hold the device.
            path, query = f"/apis/kubevirt.io/v1/namespaces/{self.namespace}/virtualmachines", {"dryRun": "All"}
            body = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": f"vm-{i}"},
                    "spec": {"runStrategy": "Always", "template": {"spec": {"domain": {
                        "devices": {"hostDevices": [{"name": "dev0", "deviceName": resource}]},
                        "resources": {"requests": {"memory": "1Gi"}}}}}}}  # fmt: skip
        try:
            await self.session.request("POST", path, query=query, body=body, timeout=30)
        except ApiError as exc:
            if exc.status == 403 and "denied the request" in exc.body and expect_denial:
                self.outcomes.denied += 1
            else:
                self.outcomes.errors.append(f"{body['kind']} {i} ({device}): {exc.status} {exc.message}")
            return
        if expect_denial:
            self.outcomes.errors.append(f"{body['kind']} {i} with another namespace's device {device} was admitted")
        else:
            self.outcomes.admitted += 1


async def _true(value: bool) -> bool:
    return value


# -- the set-up: devices, the webhook through the balancer, two replicas ---------------------------


@dataclasses.dataclass
class Setup:
    api: object
    cluster: object
    namespace: str
    node: object
    own: list[str]
    spare: list[str]  # devices to assign later, to see reconciliation happen
    foreign: str
    replicas: dict[str, Replica]
    balancer: Balancer
    lease: str
    folder: Path


@pytest.fixture(scope="module")
async def ha(api, cluster, helm, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ha")
    suffix = os.urandom(3).hex()
    lease = f"passthrough-ha-{suffix}"
    serving = WebhookServing(folder / "tls")
    balancer = Balancer().start()
    serving.port = balancer.port  # the webhook configuration calls the balancer
    replicas = {name: Replica(name, cluster, folder, serving, balancer, lease) for name in "ab"}
    configuration = chart.webhook_configuration(helm, serving)
    namespace, other = f"ha-{suffix}", f"ha-other-{suffix}"
    for ns in (namespace, other):
        await support.create_namespace(api, ns)
    for ns in (namespace, other):  # a pod needs its namespace's default ServiceAccount, made a moment later
        await support.wait_for(lambda: _true(cluster.kubectl("get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0),
                               30, what=f"the default ServiceAccount of {ns}")  # fmt: skip
    node = await support.ensure_node(api, f"ha-{suffix}")
    names = [await support.report_device(api, node, support.gpu(f"0000:{0x10 + i:02x}:00.0")) for i in range(8)]
    try:
        for replica in replicas.values():
            await asyncio.to_thread(replica.start)
        await asyncio.to_thread(cluster.kubectl, "create", "-f", "-", input=json.dumps(configuration))
        own, spare, foreign = names[:3], names[3:7], names[7]
        for name in own:
            await support.assign(api, name, namespace)
        await support.assign(api, foreign, other)
        for name, ns in [*((n, namespace) for n in own), (foreign, other)]:
            await handed_out(api, name, ns, 60)
        yield Setup(api, cluster, namespace, node, own, spare, foreign, replicas, balancer, lease, folder)
    finally:
        await asyncio.to_thread(cluster.kubectl, "delete", "validatingwebhookconfiguration",
                                configuration["metadata"]["name"], check=False)  # fmt: skip
        for replica in replicas.values():
            if replica.proc and replica.proc.proc and replica.proc.proc.poll() is None:
                await asyncio.to_thread(replica.stop)
        balancer.stop()
        for name in names:
            with contextlib.suppress(ApiError):
                await support.assign(api, name, "")
        for ns in (namespace, other):
            await asyncio.to_thread(cluster.kubectl, "delete", "namespace", ns, "--wait=false", check=False)
        await support.remove_node(api, node.name)
        for replica in replicas.values():
            assert "Traceback" not in replica.output(), replica.output()[-5000:]


async def handed_out(api, name: str, namespace: str, timeout: float) -> None:
    """Until the operator has handed the device to the namespace: its PCIDevice exists there."""
    pcidevices = Custom(api, "pcidevices", namespaced=True)

    async def made() -> bool:
        return await pcidevices.get(name, namespace) is not None

    await support.wait_for(made, timeout, interval=0.05, what=f"PCIDevice {namespace}/{name}")


async def holder(s: Setup) -> Replica:
    """The replica whose identity the Lease names (waiting for one to hold it)."""
    by_identity = {r.identity: r for r in s.replicas.values()}

    async def named() -> Replica | None:
        lease = await session_of(s.api).request("GET", f"/apis/coordination.k8s.io/v1/namespaces/default/leases/{s.lease}")
        return by_identity.get((lease.get("spec") or {}).get("holderIdentity") or "")

    return await support.wait_for(named, 30, what="a replica holding the Lease")


def lease_spec(s: Setup) -> dict:
    return json.loads(s.cluster.kubectl("get", "lease", s.lease, "-n", "default", "-o", "json").stdout)["spec"]


# -- the tests --------------------------------------------------------------------------------------


async def test_killing_the_leader_refuses_nothing_and_the_other_replica_reconciles_within_15s(ha):
    leader = await holder(ha)
    standby = next(r for r in ha.replicas.values() if r is not leader)
    assert leader.ready() and standby.ready()  # a standby answers the webhooks as well as the leader
    creator = Creator(ha.api, ha.namespace, ha.own, ha.foreign)
    creator.start()
    try:
        await creator.until(10)
        # Killed between two creations: a call in flight to a replica that dies is lost whatever
        # the design (the API server does not retry a webhook POST).
        async with creator.pause:
            killed_at = await asyncio.to_thread(leader.kill)
            await support.wait_for(lambda: _true(ha.balancer.open[leader.port] == 0), 10, what="the killed replica's connections closed")
        device = ha.spare.pop()
        await support.assign(ha.api, device, ha.namespace)
        await handed_out(ha.api, device, ha.namespace, 60)
        reconciled = time.monotonic() - killed_at
        assert await holder(ha) is standby
        took_lease = parse_terms(standby.identity, standby.output())[-1].start - killed_at
        print(f"\nleader {leader.identity} SIGKILLed: {standby.identity} took the Lease after {took_lease:.1f}s and "
              f"handed out a device assigned after the kill {reconciled:.1f}s after it")  # fmt: skip
        ha.own.append(device)  # the survivor's webhook admits the new device too
        await creator.until(10)
    finally:
        outcomes = await creator.stop()
    print(f"through the webhook: {outcomes.admitted} admitted, {outcomes.denied} denied as they should be, "
          f"{len(outcomes.errors)} refused or failed")  # fmt: skip
    assert outcomes.errors == []
    assert outcomes.denied > 0
    assert reconciled < TAKEOVER_LIMIT
    await asyncio.to_thread(leader.start)


async def test_a_rolling_restart_of_every_replica_refuses_nothing(ha):
    creator = Creator(ha.api, ha.namespace, ha.own, ha.foreign)
    creator.start()
    restarted = []
    try:
        await creator.until(5)
        for replica in ha.replicas.values():
            started = time.monotonic()
            await asyncio.to_thread(replica.stop)
            await asyncio.to_thread(replica.start)
            restarted.append(time.monotonic() - started)
            await creator.until(5)
        device = ha.spare.pop()
        await support.assign(ha.api, device, ha.namespace)
        await handed_out(ha.api, device, ha.namespace, 30)
    finally:
        outcomes = await creator.stop()
    print(f"\nrolling restart ({', '.join(f'{t:.1f}s' for t in restarted)} per replica): {outcomes.admitted} admitted, "
          f"{outcomes.denied} denied as they should be, {len(outcomes.errors)} refused or failed")  # fmt: skip
    assert outcomes.errors == []
    assert await holder(ha) in ha.replicas.values()


async def test_a_leader_cut_off_from_the_api_server_stops_before_the_other_replica_starts(ha, tmp_path):
    """The leader keeps running but cannot renew (its API server connections hang up): it stops
    reconciling by its renew deadline, before the other replica may take the Lease."""
    proxy = await FlakyProxy(ha.cluster, tmp_path / "proxy").start()
    try:
        # `a` again, now through the proxy, and holding the Lease.
        a, b = ha.replicas["a"], ha.replicas["b"]
        await asyncio.to_thread(a.stop)
        a.kubeconfig = proxy.kubeconfig(tmp_path / "through-proxy.kubeconfig")
        await asyncio.to_thread(a.start)
        if await holder(ha) is not a:
            await asyncio.to_thread(b.stop)
            await support.wait_for(lambda: _true(bool(parse_terms(a.identity, a.output()))), 30, what="a leading")
            await asyncio.to_thread(b.start)
        before = lease_spec(ha)["leaseTransitions"]
        proxy.hang_up()
        await support.wait_for(lambda: _true(bool(parse_terms(b.identity, b.output()))), 30, what="b leading")
        assert a.proc.proc.poll() is None, "the cut-off replica exited"
        [a_term] = parse_terms(a.identity, a.output())
        [b_term] = parse_terms(b.identity, b.output())
        assert a_term.end is not None and a_term.end < b_term.start
        assert b_term.transitions == before + 1
        print(f"\ncut-off leader stopped {b_term.start - a_term.end:.1f}s before the other replica started")
        proxy.pass_through()
        # Back in touch, it stands by: the other holds the Lease.
        device = ha.spare.pop()
        await support.assign(ha.api, device, ha.namespace)
        await handed_out(ha.api, device, ha.namespace, 30)
        assert await holder(ha) is b
        await asyncio.to_thread(a.stop)
        a.kubeconfig = None
        await asyncio.to_thread(a.start)
    finally:
        await proxy.stop()


async def test_two_replicas_never_reconciled_at_once(ha):
    """Every term of every replica of this module, ordered: each began after the last ended, and
    each new holder's began with a transition of the Lease."""
    terms = sorted((t for r in ha.replicas.values() for t in r.all_terms()), key=lambda t: t.start)
    assert len(terms) >= 4, terms  # the tests above handed the Lease over at least three times
    for before, after in zip(terms, terms[1:]):
        assert before.end is not None and before.end <= after.start, f"overlap: {before} and {after}"
        if after.identity != before.identity:
            assert after.transitions > before.transitions, (before, after)
    print(f"\n{len(terms)} terms in turn: " + ", ".join(f"{t.identity} (transitions {t.transitions})" for t in terms))
