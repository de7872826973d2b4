"""The webhooks' availability through the chart's Service on two real nodes (the second joined to
the first's cluster, `RealNode(joins=...)`, so the replicas spread and a drained one has somewhere
to go), as a client of the API server sees it (e2e/realnode/availability.py): what must refuse
nothing refuses nothing.

- A serving-certificate renewal (a new pair in the Secret the replicas mount, the kubelet
  swapping the files): no connect to the Service or to either replica is refused or fails its
  handshake, no kept-alive connection is closed, and no admission call is refused, until both
  replicas serve the new certificate.
- `kubectl rollout restart` of the operator (the chart's `maxUnavailable: 0`, readiness probe,
  `preStop` and SIGTERM drain): no admission call is refused.
- `kubectl drain` of the leader's node, twice (the second time it holds both replicas, and the
  PDB holds the second until the first one's replacement is ready on the other node): no
  admission call is refused, and no connect to the Service is refused or fails.

What a SIGKILL costs (the call in flight on the killed process) is measured, not asserted:
`e2e/bench/bench_realnode_ha.py`.
"""

from __future__ import annotations

import time

import pytest

from e2e import image, support
from e2e.realnode import availability, install
from e2e.realnode.node import RealNode, why_unavailable

pytestmark = pytest.mark.cluster

# The replicas look at the files every 2 s here (60 s by default) so the renewal is seen soon.
VALUES = {"operator": {"extraArgs": ["--webhook-cert-check=2s"]}}


@pytest.fixture(scope="module")
def node(request, tmp_path_factory):
    if reason := why_unavailable() or image.why_unavailable():
        support.cannot_run(request, "real-node", reason, once_key="realnode")
    started = RealNode(project_image=True).start()
    load = worker = None
    try:
        # Joined before the install, so the scheduler can put the replicas on different nodes.
        worker = RealNode(joins=started).start()
        install.set_up(started, tmp_path_factory.mktemp("values"), image.name(), VALUES)
        started.load = load = availability.Load(started).start().until_answered()
        yield started
    finally:
        if load is not None:
            load.stop()
        if worker is not None:
            worker.stop()
        started.stop()
        assert (worker.leftovers() if worker is not None else []) + started.leftovers() == []


def test_a_certificate_renewal_refuses_no_connect_and_no_admission_call(node, tmp_path):
    targets = availability.targets(node)
    assert len(targets) == 3, targets  # the Service and two replicas
    probe = availability.Probe(node, targets, tmp_path).start()
    try:
        time.sleep(2)
        begun = time.monotonic()
        before = {t: set(c["served"]) for t, c in probe.counts().items()}
        renewed = availability.renew_certificate(node)
        assert all(renewed not in served for served in before.values())

        def everywhere() -> bool:
            counts = probe.counts()
            return all(counts[t]["served"].get(renewed, 0) >= 20 for t in targets)

        install.wait_for(everywhere, 120, "every replica serving the renewed certificate")
        # The kept-alive connections made before the renewal asked again after it.
        asked = {t: c["kept_asks"] for t, c in probe.counts().items()}
        install.wait_for(lambda: all(c["kept_asks"] >= asked[t] + 3 for t, c in probe.counts().items()), 30, "kept connections asked again")
        ended = time.monotonic()
    finally:
        counts = probe.stop()
    calls = node.load.outcomes.between(begun, ended)
    for target, c in counts.items():
        assert c["refused"] == 0 and c["failed"] == 0 and c["kept_closed"] == 0, (target, c["errors"][:5])
        assert c["connects"] > 100, (target, c["connects"])
    assert len(calls) > 50
    assert availability.Outcomes.refused(calls) == [], availability.Outcomes.refused(calls)[:5]


def test_a_rollout_restart_refuses_no_admission_call(node):
    before = {p["metadata"]["name"] for p in availability.operator_pods(node)}
    begun = time.monotonic()
    node.kubectl("rollout", "restart", f"deployment/{install.OPERATOR}", "-n", install.NAMESPACE)
    install.wait_rolled_out(node)
    # Until the old pods are gone for good: the last answers of a terminating replica are counted too.
    install.wait_for(lambda: not {p["metadata"]["name"] for p in install.pods(node)} & before, 120, "the old replicas gone")
    time.sleep(3)
    calls = node.load.outcomes.between(begun, time.monotonic())
    after = {p["metadata"]["name"] for p in availability.operator_pods(node)}
    assert len(after) == 2 and not after & before
    assert len(calls) > 100
    assert availability.Outcomes.refused(calls) == [], availability.Outcomes.refused(calls)[:5]


def test_drains_of_the_leaders_node_refuse_no_admission_call_and_no_connect(node, tmp_path):
    drains = []
    # The first drain leaves both replicas on the other node, so the second drains a node that
    # holds both: the PDB lets them go one at a time.
    for folder in (tmp_path / "first", tmp_path / "second"):
        folder.mkdir()
        drain = availability.drain_the_leaders_node(node, node.load, folder)
        drains.append(drain)
        after = availability.operator_pods(node)
        others = {node.name, node.joined.name} - {drain.node}
        assert {p["spec"]["nodeName"] for p in after} == others, [(p["metadata"]["name"], p["spec"]["nodeName"]) for p in after]
        assert drain.moved and not drain.moved & {p["metadata"]["name"] for p in after}
        assert len(drain.calls) > 100
        assert availability.Outcomes.refused(drain.calls) == [], availability.Outcomes.refused(drain.calls)[:5]
        assert drain.service["connects"] > 100, drain.service["connects"]
        assert drain.service["refused"] == 0 and drain.service["failed"] == 0, drain.service["errors"][:5]
    assert len(drains[1].moved) == 2 and drains[1].held_by_budget
