"""Leader election (controller/leader.py): the Elector's decisions on a clock of the test's,
and `lead` against an in-memory Lease with the API server's optimistic concurrency."""

from __future__ import annotations

import asyncio
import copy
import datetime
import math

import pytest
from hypothesis import example, given, settings, strategies as st

from passthrough.controller.leader import Elector, Timing, lead
from passthrough.kube.client import ApiError

TIMING = Timing(lease_duration=15, renew_deadline=10, retry_period=2)
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime.datetime:
        return EPOCH + datetime.timedelta(seconds=self.now)


class Store:
    """One Lease as the API server keeps it: a write naming a stale resourceVersion is a 409,
    a create of an existing Lease too."""

    def __init__(self) -> None:
        self.lease: dict | None = None
        self.rv = 0
        self.fail_writes_of: set[str] = set()  # identities whose writes get no answer

    def read(self) -> dict | None:
        return copy.deepcopy(self.lease)

    def write(self, body: dict) -> dict:
        rv = body["metadata"].get("resourceVersion")
        if self.lease is None and rv:
            raise ApiError(404, "Not Found")
        if self.lease is not None and rv != self.lease["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict")
        self.rv += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.rv)
        return copy.deepcopy(self.lease)


def elector(identity: str, clock: Clock, timing: Timing = TIMING) -> Elector:
    return Elector(identity, "passthrough-operator", "ops", timing, clock=clock, wall=clock.wall)


def attempt(e: Elector, store: Store) -> bool:
    """One round as `lead` makes it, all at one instant: read, propose, write."""
    e.observe(store.read())
    body = e.proposal()
    if body is None:
        return False
    try:
        written = store.write(body)
    except ApiError:
        e.write_failed()
        return False
    e.renewed(written)
    return True


def test_the_first_replica_creates_the_lease_and_leads_until_its_renew_deadline():
    clock, store = Clock(), Store()
    a = elector("a", clock)
    assert attempt(a, store)
    spec = store.lease["spec"]
    assert spec == {"holderIdentity": "a", "leaseDurationSeconds": 15, "acquireTime": "2026-01-01T00:16:40.000000Z",
                    "renewTime": "2026-01-01T00:16:40.000000Z", "leaseTransitions": 0}  # fmt: skip
    assert a.leading()
    clock.now += 9.999
    assert a.leading()
    clock.now += 0.001
    assert not a.leading()


def test_a_renewal_keeps_acquire_time_and_transitions_and_moves_renew_time():
    clock, store = Clock(), Store()
    a = elector("a", clock)
    attempt(a, store)
    clock.now += 2
    assert attempt(a, store)
    spec = store.lease["spec"]
    assert (spec["acquireTime"], spec["renewTime"], spec["leaseTransitions"]) == (
        "2026-01-01T00:16:40.000000Z", "2026-01-01T00:16:42.000000Z", 0)  # fmt: skip
    assert a.leads_until() == clock.now + 10


def test_a_standby_waits_a_lease_duration_from_the_last_change_it_saw_then_takes_over():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    clock.now += 1
    assert not attempt(b, store)  # held: not even a write
    assert store.rv == 1
    clock.now += 14.999
    assert not attempt(b, store)
    clock.now += 0.001  # 15 s since b saw the record change
    assert attempt(b, store)
    spec = store.lease["spec"]
    assert spec["holderIdentity"] == "b" and spec["leaseTransitions"] == 1
    assert spec["acquireTime"] == spec["renewTime"] == "2026-01-01T00:16:56.000000Z"
    assert b.leading() and not a.leading()


def test_a_standby_never_takes_a_lease_that_is_being_renewed():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    for _ in range(30):
        clock.now += 2
        assert attempt(a, store)
        assert not attempt(b, store)
    assert store.lease["spec"]["holderIdentity"] == "a"


def test_a_leader_that_cannot_renew_stops_before_a_standby_may_start():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    b.observe(store.read())  # b sees the last renewal at once: the earliest it could count from
    while a.leading():
        clock.now += 0.5
        assert b.proposal() is None, "the standby could write while the leader still leads"
    stopped = clock.now
    while b.proposal() is None:
        clock.now += 0.5
    assert clock.now - stopped >= TIMING.lease_duration - TIMING.renew_deadline


def test_a_renewal_answered_late_counts_from_when_it_was_sent():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    clock.now += 2
    a.observe(store.read())
    sent = clock.now
    written = store.write(a.proposal())
    b.observe(store.read())  # b counts from the commit
    clock.now += 6  # the answer is slow
    a.renewed(written)
    assert a.leads_until() == sent + TIMING.renew_deadline
    clock.now = sent + TIMING.lease_duration
    assert b.proposal() is not None and not a.leading()


def test_seeing_another_holder_ends_leadership_at_once():
    clock, store = Clock(), Store()
    a = elector("a", clock)
    attempt(a, store)
    store.lease["spec"]["holderIdentity"] = "intruder"
    a.observe(store.read())
    assert not a.leading()


def test_a_stale_resource_version_is_a_conflict_and_the_next_round_reads_again():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    b.observe(store.read())
    clock.now += 16  # expired in b's eyes, but a renews first
    assert attempt(a, store)
    assert b.proposal() is not None
    with pytest.raises(ApiError):
        store.write(b.proposal())
    b.write_failed()
    assert not b.leading() and not attempt(b, store)  # read again: renewed, held
    assert store.lease["spec"]["holderIdentity"] == "a"


def test_a_released_lease_is_taken_at_once_and_counts_a_transition():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    assert not attempt(b, store)
    store.write(a.release())
    assert not a.leading()
    spec = store.lease["spec"]
    assert "holderIdentity" not in spec and spec["leaseDurationSeconds"] == 1
    assert attempt(b, store)
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1


def test_nothing_to_release_when_the_lease_names_another():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    attempt(b, store)
    assert b.release() is None
    clock.now += 16
    assert attempt(b, store)
    a.observe(store.read())
    assert a.release() is None


def test_a_release_at_a_stale_resource_version_cannot_undo_a_takeover():
    clock, store = Clock(), Store()
    a, b = elector("a", clock), elector("b", clock)
    attempt(a, store)
    b.observe(store.read())
    clock.now += 16
    assert attempt(b, store)
    with pytest.raises(ApiError):
        store.write(a.release())  # a never saw b's write
    assert store.lease["spec"]["holderIdentity"] == "b"


def test_the_three_durations_must_nest():
    for durations in [(15, 15, 2), (15, 10, 10), (15, 10, 0), (10, 15, 2)]:
        with pytest.raises(ValueError, match="retry period < renew deadline < lease duration"):
            Timing(*durations)


# -- two replicas on one clock, every interleaving -----------------------------------------------

STEPS = st.lists(st.tuples(st.sampled_from("ab"), st.sampled_from([0, 0.5, 1, 3, 7, 12]), st.booleans()),
                 min_size=1, max_size=80)  # fmt: skip


@settings(max_examples=1000, deadline=None)
@given(STEPS)
# a's renewal answered 6 s after it committed, b counting from that commit: leadership counted
# from the answer instead of the send would overlap b's by a second.
@example([("a", 0, False)] * 7 + [("b", 0, False), ("a", 6, False)] + [("b", p, False) for p in (4, 4, 1, 0, 0)])
def test_two_replicas_never_lead_at_once_whatever_the_order_and_delays(steps):
    """Each replica goes round read, send, commit, answer (or the answer lost), one stage per
    step, the two interleaved at random and the clock moving between stages: at no instant
    do both replicas lead."""
    clock, store = Clock(), Store()
    replicas = {name: elector(name, clock) for name in "ab"}
    stage = {name: ("read", None) for name in "ab"}
    for name, pause, lost in steps:
        clock.now += pause
        e = replicas[name]
        now, carried = stage[name]
        if now == "read":
            e.observe(store.read())
            stage[name] = ("send", None)
        elif now == "send":
            body = e.proposal()
            stage[name] = ("commit", body) if body is not None else ("read", None)
        elif now == "commit":
            try:
                stage[name] = ("answer", store.write(carried))
            except ApiError:
                e.write_failed()
                stage[name] = ("read", None)
        else:
            if lost:
                e.write_failed()
            else:
                e.renewed(carried)
            stage[name] = ("read", None)
        assert not (replicas["a"].leading() and replicas["b"].leading()), f"both lead at {clock.now}"


# -- lead(): the loop, against an in-memory Lease -------------------------------------------------


class MemoryLock:
    def __init__(self, store: Store, identity: str) -> None:
        self.store, self.identity = store, identity
        self.writes = 0
        self.hang_write: int | None = None  # the write (counted from 1) that never gets an answer

    async def get(self, timeout: float) -> dict | None:
        await asyncio.sleep(0)
        return self.store.read()

    async def write(self, body: dict, timeout: float) -> dict:
        self.writes += 1
        if self.writes == self.hang_write:
            self.store.write(body)  # committed; the answer never comes
            await asyncio.Event().wait()
        if self.identity in self.store.fail_writes_of:
            await asyncio.sleep(timeout)
            raise TimeoutError
        await asyncio.sleep(0)
        return self.store.write(body)


FAST = Timing(lease_duration=0.6, renew_deadline=0.4, retry_period=0.05)


def recorder():
    """Work that runs until cancelled, noting (replica, start or stop, loop time) in `log`."""
    log: list[tuple[str, str, float]] = []
    started = {name: asyncio.Event() for name in "ab"}

    def work(name: str):
        async def run() -> None:
            log.append((name, "start", asyncio.get_running_loop().time()))
            started[name].set()
            try:
                await asyncio.Event().wait()
            finally:
                log.append((name, "stop", asyncio.get_running_loop().time()))
        return run

    return log, started, work


async def test_lead_runs_the_work_only_while_leading_and_hands_over_on_cancel():
    store = Store()
    log, started, work = recorder()

    a = asyncio.create_task(lead(Elector("a", "l", "ns", FAST), MemoryLock(store, "a"), work("a")))
    await asyncio.wait_for(started["a"].wait(), 5)
    b = asyncio.create_task(lead(Elector("b", "l", "ns", FAST), MemoryLock(store, "b"), work("b")))
    a.cancel()
    await asyncio.gather(a, return_exceptions=True)
    await asyncio.wait_for(started["b"].wait(), 5)
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
    b.cancel()
    await asyncio.gather(b, return_exceptions=True)
    assert [(n, what) for n, what, _ in log] == [("a", "start"), ("a", "stop"), ("b", "start"), ("b", "stop")]


async def test_a_leader_that_cannot_renew_stops_its_work_before_the_standby_starts():
    store = Store()
    log, started, work = recorder()

    a = asyncio.create_task(lead(Elector("a", "l", "ns", FAST), MemoryLock(store, "a"), work("a")))
    await asyncio.wait_for(started["a"].wait(), 5)
    b = asyncio.create_task(lead(Elector("b", "l", "ns", FAST), MemoryLock(store, "b"), work("b")))
    store.fail_writes_of.add("a")  # a's renewals hang and time out; a keeps running
    await asyncio.wait_for(started["b"].wait(), 5)
    assert not a.done()
    (_, _, a_stop), (_, _, b_start) = [e for e in log if e[:2] == ("a", "stop")][0], [e for e in log if e[:2] == ("b", "start")][0]
    assert a_stop < b_start, log
    assert store.lease["spec"]["holderIdentity"] == "b"
    for task in (a, b):
        task.cancel()
    await asyncio.gather(a, b, return_exceptions=True)
    assert math.isclose(len([e for e in log if e[1] == "start"]), 2)


async def test_a_leader_stopped_in_the_middle_of_a_renewal_still_gives_the_lease_up():
    store = Store()
    lock = MemoryLock(store, "a")
    lock.hang_write = 3  # the second renewal
    a = asyncio.create_task(lead(Elector("a", "l", "ns", FAST), lock, lambda: asyncio.Event().wait()))
    await asyncio.wait_for(_until(lambda: lock.writes == 3), 5)
    a.cancel()
    await asyncio.gather(a, return_exceptions=True)
    assert "holderIdentity" not in store.lease["spec"] and store.lease["spec"]["leaseDurationSeconds"] == 1


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
