"""Leader election over a `coordination.k8s.io/v1` Lease, the Kubernetes convention (client-go's
leaderelection): every replica of the operator serves the webhooks, the one holding the Lease reconciles.

`Elector` decides, from the Lease it last read and its own clock, what to write and whether this
replica leads; `LeaseLock` reads and writes the Lease; `lead` runs the reconciling side while this
replica leads and cancels it the moment leadership can no longer be vouched for.

Why it is safe: a standby takes the Lease only once it has seen the record unchanged for
`leaseDurationSeconds` by its own clock, and the leader stops once `renew_deadline` has passed
since it sent its last successful renewal (a shorter time, by its own clock). A renewal commits
after it is sent and is seen by the standby after it commits, so the leader has stopped before
the standby may start, with `lease_duration - renew_deadline` to spare for clocks that run at
slightly different rates. Only durations on each replica's own monotonic clock are compared;
the timestamps written in the Lease are for people and other tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from passthrough.kube.client import ApiError, session_of

log = logging.getLogger(__name__)

API_VERSION = "coordination.k8s.io/v1"


@dataclasses.dataclass(frozen=True)
class Timing:
    """client-go's three durations, in seconds."""

    lease_duration: float = 10.0  # how long a standby waits, from the last change it saw, before taking over
    renew_deadline: float = 7.0  # how long the leader goes on without a successful renewal
    retry_period: float = 2.0  # how often each replica tries to acquire or renew

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"leader election needs retry period < renew deadline < lease duration, got "
                f"{self.retry_period:g}s, {self.renew_deadline:g}s, {self.lease_duration:g}s"
            )


def _micro_time(now: datetime.datetime) -> str:
    # The Lease's MicroTime: RFC 3339 with microseconds.
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """The decisions of leader election, with no I/O: feed it what was read and written.

    `clock` (monotonic seconds) decides everything; `wall` only stamps acquireTime and renewTime.
    """

    def __init__(
        self, identity: str, name: str, namespace: str, timing: Timing = Timing(),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime.datetime] = lambda: datetime.datetime.now(datetime.UTC),
    ) -> None:  # fmt: skip
        self.identity, self.name, self.namespace, self.timing = identity, name, namespace, timing
        self._clock, self._wall = clock, wall
        self._spec: dict[str, Any] | None = None  # the Lease's spec as last read or written; None: no Lease
        self._resource_version = ""  # what the next write names; cleared when it may be stale
        self._seen = ""  # the resourceVersion last seen, to tell a change
        self._changed_at = -math.inf  # our clock when that spec was first seen as it is
        self._valid_until = -math.inf  # we lead until then, by our clock
        self._attempt_started: float | None = None

    # -- what was read and written ---------------------------------------------------------------

    def observe(self, lease: dict[str, Any] | None) -> None:
        """The Lease as just read (None: there is none)."""
        if lease is None:
            self._spec, self._resource_version = None, ""
            self._valid_until = -math.inf
            return
        spec = dict(lease.get("spec") or {})
        rv = (lease.get("metadata") or {}).get("resourceVersion", "")
        # Any write changes the resourceVersion, even one that left the record as it was.
        if spec != self._spec or rv != self._seen:
            self._spec, self._seen, self._changed_at = spec, rv, self._clock()
        self._resource_version = rv
        if self.holder != self.identity:
            self._valid_until = -math.inf  # someone else's now: whatever we thought, we do not lead

    def renewed(self, lease: dict[str, Any]) -> None:
        """Our last `proposal` was written; `lease` is the answer."""
        assert self._attempt_started is not None, "renewed() without a proposal()"
        # Counted from before the write was sent: it committed no earlier, and standbys count
        # their lease_duration from no earlier than its commit.
        self._valid_until = self._attempt_started + self.timing.renew_deadline
        self._attempt_started = None
        self.observe(lease)

    def write_failed(self) -> None:
        """The write was refused (a conflict) or got no answer: read the Lease again before the next try.
        Leadership runs out on its own, at the deadline of the last success."""
        self._attempt_started = None
        self._resource_version = ""

    # -- decisions ---------------------------------------------------------------------------

    @property
    def holder(self) -> str:
        return (self._spec or {}).get("holderIdentity") or ""

    @property
    def transitions(self) -> int:
        return int((self._spec or {}).get("leaseTransitions") or 0)

    @property
    def known(self) -> bool:
        """Whether a read may be skipped: we wrote the Lease last and know its resourceVersion."""
        return bool(self._resource_version) and self.holder == self.identity

    def now(self) -> float:
        return self._clock()

    def leading(self) -> bool:
        return self._clock() < self._valid_until

    def leads_until(self) -> float:
        """Our clock's time at which leadership ends unless renewed; -inf when not leading."""
        return self._valid_until

    def expires_at(self) -> float:
        """When, by our clock, another holder's Lease expires if it is not renewed (-inf: free)."""
        if self._spec is None or not self.holder or self.holder == self.identity:
            return -math.inf
        return self._changed_at + float(self._spec.get("leaseDurationSeconds") or 0)

    def proposal(self) -> dict[str, Any] | None:
        """The Lease to write now to acquire or renew (created when none was read, else replaced
        at the resourceVersion read), or None: another replica holds it and it has not expired."""
        now = self._clock()
        if now < self.expires_at():
            return None
        stamp = _micro_time(self._wall())
        spec = self._spec or {}
        mine = self.holder == self.identity
        body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace},
            "spec": {
                "holderIdentity": self.identity,
                "leaseDurationSeconds": max(1, math.ceil(self.timing.lease_duration)),
                "acquireTime": spec.get("acquireTime", stamp) if mine else stamp,
                "renewTime": stamp,
                "leaseTransitions": self.transitions if mine or self._spec is None else self.transitions + 1,
            },
        }
        if self._spec is not None:
            body["metadata"]["resourceVersion"] = self._resource_version
        self._attempt_started = now
        return body

    def release(self) -> dict[str, Any] | None:
        """Stop leading now; the Lease to write so that a standby takes over at once (as client-go's
        ReleaseOnCancel: no holder, a one-second duration), or None when it does not name us.
        Written at the resourceVersion read, it cannot undo another replica's acquisition."""
        self._valid_until = -math.inf
        if self._spec is None or self.holder != self.identity or not self._resource_version:
            return None
        stamp = _micro_time(self._wall())
        return {
            "apiVersion": API_VERSION,
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.namespace, "resourceVersion": self._resource_version},
            "spec": {
                "leaseDurationSeconds": 1, "acquireTime": stamp, "renewTime": stamp,
                "leaseTransitions": self.transitions,
            },
        }  # fmt: skip


class LeaseLock:
    """Reads and writes one Lease; a write with a resourceVersion fails (409) if it changed since."""

    def __init__(self, api: Any, namespace: str, name: str) -> None:
        self.session = session_of(api)
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.name = name

    async def get(self, timeout: float) -> dict[str, Any] | None:
        try:
            return await self.session.request("GET", f"{self.collection}/{self.name}", timeout=timeout, attempts=1)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def write(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        if body["metadata"].get("resourceVersion"):
            return await self.session.request("PUT", f"{self.collection}/{self.name}", body=body, timeout=timeout, attempts=1)
        return await self.session.request("POST", self.collection, body=body, timeout=timeout, attempts=1)


# What a failed read or write of the Lease looks like: the API server away, or another replica first.
_WEATHER = (ApiError, aiohttp.ClientError, OSError, TimeoutError)


async def _try_once(elector: Elector, lock: LeaseLock) -> None:
    """One round: read the Lease (unless we wrote it last), then acquire or renew if we may.
    While leading, nothing here outlasts the leadership it tries to extend."""
    timing = elector.timing
    bound = elector.leads_until() - elector.now() if elector.leading() else timing.renew_deadline
    try:
        async with asyncio.timeout(max(bound, 0.001)):
            if not elector.known:
                elector.observe(await lock.get(timeout=timing.renew_deadline))
            body = elector.proposal()
            if body is None:
                return
            try:
                written = await lock.write(body, timeout=timing.renew_deadline)
            except BaseException:
                elector.write_failed()
                raise
            elector.renewed(written)
    except _WEATHER as exc:
        status = getattr(exc, "status", None)
        if status == 409:
            log.debug("the Lease changed since it was read (another replica wrote it); reading it again")
        elif elector.leading() or elector.holder == elector.identity:
            log.warning("could not renew the leader Lease: %s", exc if str(exc) else type(exc).__name__)
        else:
            log.debug("could not read or take the leader Lease: %r", exc)


async def _stop(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def lead(elector: Elector, lock: LeaseLock, work: Callable[[], Awaitable[None]]) -> None:
    """Run `work()` while this replica holds the Lease, until cancelled (then give the Lease up).

    `work` is cancelled when leadership runs out (a renewal not made by the renew deadline, or
    another holder seen) and started again if it comes back. Should `work` fail, so does this.
    """
    timing = elector.timing
    task: asyncio.Task | None = None
    term = 0
    try:
        while True:
            await _try_once(elector, lock)
            if elector.leading() and task is None:
                term += 1
                log.info("leading: holding Lease %s/%s as %s (transitions %d); reconciling from monotonic %.3f",
                         elector.namespace, elector.name, elector.identity, elector.transitions, time.monotonic())
                task = asyncio.create_task(work(), name=f"reconciling as leader ({term})")
            elif task is not None and not elector.leading():
                await _stop(task)
                task = None
                # A fact an admin looks for when two replicas disagree; the monotonic stamp lets a
                # test order it against the next leader's start on the same machine.
                log.warning("stopped leading: Lease %s/%s not renewed in time (holder now %r); reconciling stopped "
                            "at monotonic %.3f", elector.namespace, elector.name, elector.holder, time.monotonic())
            now = elector.now()
            wake = now + timing.retry_period
            if elector.leading():
                wake = min(wake, elector.leads_until())
            elif elector.expires_at() > now:
                # A standby tries again when the holder's Lease would expire, or on its period.
                wake = min(wake, elector.expires_at())
            if task is None:
                await asyncio.sleep(max(wake - now, 0))
                continue
            done, _ = await asyncio.wait([task], timeout=max(wake - now, 0))
            if done:
                task.result()  # work ended on its own: a bug, surfaced
                raise RuntimeError("the reconciler stopped while leading")
    finally:
        if task is not None:
            await _stop(task)
            log.info("stopped leading at monotonic %.3f: shutting down", time.monotonic())
        await _give_up(elector, lock)


async def _give_up(elector: Elector, lock: LeaseLock) -> None:
    """Hand the Lease back, so that a standby takes over at once instead of at its expiry. Stopped
    in the middle of a renewal, we do not know its resourceVersion: read it again first."""
    with contextlib.suppress(*_WEATHER):
        async with asyncio.timeout(2.0):
            if elector.holder == elector.identity and not elector.known:
                elector.observe(await lock.get(timeout=2.0))
            body = elector.release()
            if body is not None:
                await lock.write(body, timeout=2.0)
                log.info("gave up Lease %s/%s", elector.namespace, elector.name)


class Leadership:
    """What `passthrough operator --leader-elect` keeps in Kopf's memo: the Lease to hold and how."""

    def __init__(self, identity: str, name: str, namespace: str, timing: Timing = Timing()) -> None:
        self.elector = Elector(identity, name, namespace, timing)

    def leading(self) -> bool:
        return self.elector.leading()

    async def lead(self, api: Any, work: Callable[[], Awaitable[None]]) -> None:
        await lead(self.elector, LeaseLock(api, self.elector.namespace, self.elector.name), work)
