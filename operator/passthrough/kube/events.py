"""core/v1 Events, posted in the background and counted up when they repeat."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
from typing import Any

from passthrough.kube.client import MERGE_PATCH, ApiError, session_of

log = logging.getLogger(__name__)

_REFERENCE_FIELDS = {"api_version": "apiVersion", "resource_version": "resourceVersion", "field_path": "fieldPath"}


class EventRecorder:
    """Posts core/v1 Events in the background; a failure to post is logged, never raised.

    Events wait their turn in a queue, at most `concurrency` in flight, in order, each stamped
    with when it happened. Should more than `backlog` wait (the API server away for long), the
    oldest are dropped and counted in a warning; the objects' conditions still say where each
    one stands.

    Events of cluster-scoped objects go to the `default` namespace, where kubectl describe
    finds them.
    """

    def __init__(self, api: Any, component: str, concurrency: int = 4, backlog: int = 10_000) -> None:
        self.session = session_of(api)
        self.component = component
        self.concurrency, self.backlog = concurrency, backlog
        self._pending: collections.deque[tuple[dict[str, Any], str, str, str, datetime.datetime]] = collections.deque()
        self._posters: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._failures: set[str] = set()
        self.dropped = 0
        # Identical Events (same object, type, reason and message) count up on one Event, as
        # client-go's correlator does: (namespace, name, count) of the last one posted per key.
        self._posted: collections.OrderedDict[tuple, tuple[str, str, int]] = collections.OrderedDict()

    def post(self, involved: dict[str, Any], type_: str, reason: str, message: str) -> None:
        if len(self._pending) >= self.backlog:
            self._pending.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("%d Events dropped: more than %d waited to be posted", self.dropped, self.backlog)
        now = datetime.datetime.now(datetime.UTC)
        self._pending.append((involved, type_, reason, message, now))
        self._idle.clear()
        self._start_posters()

    def _start_posters(self) -> None:
        # A poster that has returned but whose done-callback has not run yet counts as gone.
        while self._pending and sum(not t.done() for t in self._posters) < min(self.concurrency, len(self._pending)):
            task = asyncio.create_task(self._poster())
            self._posters.add(task)
            task.add_done_callback(self._poster_done)

    def _poster_done(self, task: asyncio.Task) -> None:
        self._posters.discard(task)
        if not task.cancelled():
            self._start_posters()
        if not self._posters:
            self._idle.set()

    async def _poster(self) -> None:
        while self._pending:
            await self._post(*self._pending.popleft())

    async def _post(self, involved: dict[str, Any], type_: str, reason: str, message: str, when: datetime.datetime) -> None:
        namespace = involved.get("namespace") or "default"
        stamp = when.isoformat()  # when it happened, not when its turn came
        # A plain body, and the answer read as plain JSON (for its name): the client's models
        # would cost more CPU than the request itself (a date parser per timestamp).
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": {_REFERENCE_FIELDS.get(k, k): v for k, v in involved.items()},
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        key = (namespace, *(involved.get(k, "") for k in ("kind", "name", "uid")), type_, reason, message[:1024])
        try:
            if await self._count_up(key, stamp):
                return
            created = await self.session.request("POST", f"/api/v1/namespaces/{namespace}/events", body=event, timeout=30)
            self._remember(key, (namespace, created["metadata"]["name"], 1))
        except Exception as exc:  # Events are best effort: losing one must not stop a reconcile
            # ...but a lasting cause (RBAC, a missing namespace) is worth one warning.
            cause = f"{exc.status} {exc.reason}" if isinstance(exc, ApiError) else type(exc).__name__
            if cause not in self._failures:
                self._failures.add(cause)
                log.warning("posting Events fails (%s), e.g. %s for %s; further failures of this kind are not logged",
                            cause, reason, involved.get("name"))

    async def _count_up(self, key: tuple, stamp: str) -> bool:
        """The same Event posted before: its count and lastTimestamp move instead (False when it
        was not, or has expired since: the API server keeps Events an hour)."""
        seen = self._posted.get(key)
        if seen is None:
            return False
        namespace, name, count = seen
        patch = {"count": count + 1, "lastTimestamp": stamp}
        try:
            await self.session.request(
                "PATCH", f"/api/v1/namespaces/{namespace}/events/{name}", body=patch, content_type=MERGE_PATCH, timeout=30
            )
        except ApiError:
            # Gone (expired), or not ours to patch (RBAC of an older chart): a new one.
            self._posted.pop(key, None)
            return False
        self._remember(key, (namespace, name, count + 1))
        return True

    def _remember(self, key: tuple, posted: tuple[str, str, int]) -> None:
        self._posted[key] = posted
        self._posted.move_to_end(key)
        while len(self._posted) > self.remembered:
            self._posted.popitem(last=False)

    remembered = 4096  # Events whose repeats are counted up (the least recently posted forgotten)

    async def drain(self) -> None:
        """Wait until every Event posted so far has been sent (or has failed)."""
        await self._idle.wait()

    async def close(self, timeout: float = 5) -> None:
        """Drain for at most `timeout` seconds (the API server may be gone), then stop posting."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.drain()
        self._pending.clear()
        for task in list(self._posters):
            task.cancel()
        await asyncio.gather(*self._posters, return_exceptions=True)
