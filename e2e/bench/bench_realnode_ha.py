"""Benchmark of the webhooks' availability through the chart's Service on a real node.

    .venv/bin/python e2e/bench/bench_realnode_ha.py [--runs 2]

The chart as a user installs it (`helm install`, two operator replicas) on two real nodes
(e2e/realnode: the second joined to the first's cluster before the install). Four clients of the API server create launcher-shaped pods and VMs that name a
device their namespace does not hold, each on its own kept-alive connection, one every 50 ms:
the API server must call the webhook through the Service for each, and an answer is its denial.
Everything else the clients get is counted as refused (`failed calling webhook`, a timeout).
Each disruption is counted from its start until the replicas are both Ready again and 3 s more:

- SIGKILL of the leader's process (as the OOM killer does), sent mid-request: the moment a
  connection to its webhook port holds request bytes it has not read (its /proc/<pid>/net/tcp
  polled); the kubelet restarts the container in place;
- a kill of the leader's container through the runtime (`ctr task kill -s SIGKILL`), as a node's
  runtime or an admin does it;
- `kubectl rollout restart` of the operator's Deployment;
- a serving-certificate renewal (a new pair in the Secret, the kubelet swapping the files), with
  a connect and TLS handshake every 10 ms to the Service and to each replica;
- `kubectl drain` of the leader's node, with the same probe to the Service, counted until both
  replicas are ready on the other node and 3 s more; then the node is uncordoned (so the next
  drain's node holds both replicas, which the PDB lets go one at a time).

Nothing is asserted; tests/integration/test_real_node_ha.py asserts the zeros.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from e2e import image  # noqa: E402
from e2e.bench import table  # noqa: E402
from e2e.realnode import availability, install  # noqa: E402
from e2e.realnode.availability import Outcomes  # noqa: E402
from e2e.realnode.node import RealNode  # noqa: E402

VALUES = {"operator": {"extraArgs": ["--webhook-cert-check=2s"]}}
REFUSED = "calls refused: on its connections, dialed to its address"

# Each figure as the page labels it, with its goal (None: none set).
GOALS: dict[str, str | None] = {
    "node Ready (the image built first where stale), then the chart rolled out": None,
    "second node joined and Ready": None,
    f"SIGKILL of the leader's process: {REFUSED}": "only those (the protocol's)",
    "SIGKILL of the leader's process: latency p50 / p99 / max": None,
    f"runtime kill of the leader's container: {REFUSED}": "only those (the protocol's)",
    "runtime kill of the leader's container: latency p50 / p99 / max": None,
    "rollout restart: calls refused": "0",
    "rollout restart: latency p50 / p99 / max": None,
    "certificate renewal: connects refused or failed (Service, each replica)": "0",
    "certificate renewal: calls refused": "0",
    "certificate renewal: files changed to every replica serving the new pair": None,
    "drain of the leader's node: calls refused": "0",
    "drain of the leader's node: connects to the Service refused or failed": "0",
    "drain of the leader's node: latency p50 / p99 / max": None,
    "drain of the leader's node: drain begun to both replicas ready on the other node": None,
}


def page_table(measured: dict[str, object], note: str = "", **lead) -> str:
    return table.figures_page(measured, GOALS, note=note, **lead)


def _latency(calls: list) -> str:
    p50, p99, top = Outcomes.latency_ms(calls)
    return f"{p50:.0f} / {p99:.0f} / {top:.0f} ms"


def _refused(counts: list[tuple[int, int, str]]) -> str:
    """Per run: refused of all calls, which, and how the kill landed."""
    return "; ".join(f"{r} of {n} ({f})" for r, n, f in counts)


def _which(refused: list) -> str:
    """The refused calls that were on a connection to the killed process (reset, EOF, broken
    pipe: in flight, or sent on a kept connection before the reset reached the API server) and
    those the API server dialed to its address before kube-proxy dropped it (refused connect)."""
    dialed = sum(1 for c in refused if "dial tcp" in c.detail)
    return f"{len(refused) - dialed} on it, {dialed} dialed"


def _restarts(node: RealNode) -> dict[str, int]:
    return {p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"] for p in availability.operator_pods(node)}


def _settle(node: RealNode, load: availability.Load, begun: float, killed: str | None = None, before: int = 0) -> list:
    """Until the killed container runs again (the pod's status says ready a moment after its
    container died) and both replicas are the Service's ready endpoints, then 3 s more."""
    if killed is not None:
        install.wait_for(lambda: _restarts(node).get(killed, 0) > before, 180, f"{killed} restarted")
    install.wait_for(lambda: availability.ready_endpoints(node) == 2, 180, "both replicas ready endpoints")
    time.sleep(3)
    return load.outcomes.between(begun, time.monotonic())


class Endpoints:
    """The webhook Service's ready endpoints, sampled every 0.5 s: a window with none explains
    refusals that no single replica's death does."""

    def __init__(self, node: RealNode) -> None:
        self.node, self.samples, self._stop = node, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic(), availability.ready_endpoints(self.node)))

    def fewest(self, start: float, end: float) -> int | str:
        counts = [n for t, n in self.samples if start <= t <= end]
        return min(counts) if counts else "?"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def kill(node: RealNode, load: availability.Load, endpoints: Endpoints, how) -> tuple[tuple[int, int, str], list, list]:
    pod = availability.leader(node)
    install.wait_for(lambda: sum(1 for c in load.outcomes.calls if c.outcome == "answered") > 20, 60, "answers before the kill")
    # Land the kill mid-request: bytes of a webhook request delivered to the process, unanswered.
    name = pod["metadata"]["name"]
    before = _restarts(node)[name]
    caught = availability.when_a_request_is_in_flight(pod)
    begun = time.monotonic()
    how(pod)
    calls = _settle(node, load, begun, name, before)
    refused = Outcomes.refused(calls)
    caught_text = "caught" if caught else "not caught"
    if endpoints.fewest(begun, time.monotonic()) == 0:  # why the other replica left the Service too
        events = node.kubectl("get", "events", "-n", install.NAMESPACE, "--field-selector=reason=Unhealthy", "-o",
                              "custom-columns=LAST:.lastTimestamp,POD:.involvedObject.name,MESSAGE:.message", check=False)  # fmt: skip
        print(f"no ready endpoint for a while; the probes' failures:\n{events.stdout[-3000:]}", flush=True)
    landed = f"{_which(refused)}; kill mid-request {caught_text}; fewest ready endpoints {endpoints.fewest(begun, time.monotonic())}"
    return (len(refused), len(calls), landed), calls, refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="kills of each kind, and drains (default 2)")
    args = parser.parse_args()
    measured: dict[str, object] = {}
    node = RealNode(project_image=True)
    worker: RealNode | None = None
    probe: availability.Probe | None = None
    folder = Path(tempfile.mkdtemp(prefix="bench-realnode-ha-"))
    started = time.monotonic()
    node.start()
    try:
        worker = RealNode(joins=node).start()
        measured["second node joined and Ready"] = f"{worker.info['start_seconds']:.0f} s"
        rolled = time.monotonic()
        install.set_up(node, folder, image.name(), VALUES)
        measured["node Ready (the image built first where stale), then the chart rolled out"] = f"{node.info['start_seconds']:.0f} s, then {time.monotonic() - rolled:.0f} s"
        load = availability.Load(node).start().until_answered()
        endpoints = Endpoints(node)

        for label, how in (("SIGKILL of the leader's process", availability.sigkill),
                           ("runtime kill of the leader's container", lambda pod: availability.runtime_kill(node, pod))):  # fmt: skip
            counts, every = [], []
            for run in range(args.runs):
                figures, calls, refused = kill(node, load, endpoints, how)
                counts.append(figures)
                every += calls
                print(f"{label}, run {run + 1}: {figures[0]} of {figures[1]} refused ({figures[2]})", flush=True)
                for call in refused:
                    print(f"  {call.outcome}: {call.detail[:80]} ... {call.detail[-120:]}", flush=True)
            measured[f"{label}: {REFUSED}"] = _refused(counts)
            measured[f"{label}: latency p50 / p99 / max"] = _latency(every)

        before = {p["metadata"]["name"] for p in availability.operator_pods(node)}
        begun = time.monotonic()
        node.kubectl("rollout", "restart", f"deployment/{install.OPERATOR}", "-n", install.NAMESPACE)
        install.wait_rolled_out(node)
        install.wait_for(lambda: not {p["metadata"]["name"] for p in install.pods(node)} & before, 120, "the old replicas gone")
        calls = _settle(node, load, begun)
        measured["rollout restart: calls refused"] = (
            f"{len(Outcomes.refused(calls))} of {len(calls)} (fewest ready endpoints {endpoints.fewest(begun, time.monotonic())})")
        measured["rollout restart: latency p50 / p99 / max"] = _latency(calls)
        print(f"rollout restart: {measured['rollout restart: calls refused']} refused", flush=True)

        targets = availability.targets(node)
        probe = availability.Probe(node, targets, folder).start()
        time.sleep(2)
        begun = time.monotonic()
        renewed = availability.renew_certificate(node)
        install.wait_for(lambda: all(c["served"].get(renewed, 0) >= 20 for c in probe.counts().values()), 180,
                         "every replica serving the renewed certificate")  # fmt: skip
        took = time.monotonic() - begun
        counts = probe.stop()
        probe = None
        calls = load.outcomes.between(begun, time.monotonic())
        bad = [c["refused"] + c["failed"] for c in counts.values()]
        connects = sum(c["connects"] for c in counts.values())
        measured["certificate renewal: connects refused or failed (Service, each replica)"] = (
            f"{' / '.join(map(str, bad))} of {connects}")
        measured["certificate renewal: calls refused"] = f"{len(Outcomes.refused(calls))} of {len(calls)}"
        measured["certificate renewal: files changed to every replica serving the new pair"] = (
            f"{took:.0f} s (the kubelet's sync, the replicas' 2 s look)")

        refusals, connects, every, times = [], [], [], []
        for run in range(args.runs):
            drain = availability.drain_the_leaders_node(node, load, folder)
            held = f"{len(drain.moved)} replica{'s' if len(drain.moved) > 1 else ''} on it"
            refusals.append(f"{len(Outcomes.refused(drain.calls))} of {len(drain.calls)} ({held})")
            connects.append(f"{drain.service['refused'] + drain.service['failed']} of {drain.service['connects']}")
            every += drain.calls
            times.append(f"{drain.seconds:.0f} s")
            print(f"drain, run {run + 1}: {refusals[-1]} refused; connects refused or failed {connects[-1]}; {times[-1]}", flush=True)
            for call in Outcomes.refused(drain.calls):
                print(f"  {call.outcome}: {call.detail[:80]} ... {call.detail[-120:]}", flush=True)
        measured["drain of the leader's node: calls refused"] = "; ".join(refusals)
        measured["drain of the leader's node: connects to the Service refused or failed"] = "; ".join(connects)
        measured["drain of the leader's node: latency p50 / p99 / max"] = _latency(every)
        measured["drain of the leader's node: drain begun to both replicas ready on the other node"] = ", ".join(times)
        load.stop()
        endpoints.stop()
    finally:
        if probe is not None:
            probe.stop()  # it runs in the node's network namespace, not in its PID namespace
        if worker is not None:
            worker.stop()
        node.stop()
        shutil.rmtree(folder, ignore_errors=True)
    print()
    print(page_table(measured, note=f"The chart on two real nodes, two replicas, four clients each calling every 50 ms; "
                                    f"{args.runs} kills of each kind and {args.runs} drains."))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
