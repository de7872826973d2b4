"""The Kubernetes API as this project uses it: one session, server-side apply, small watches.

Kopf has its own client for watching; everything we write goes through here (over
`kubeapi.Session`), so every write is a server-side apply under a named field manager.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import aiohttp

from passthrough.api.models import GROUP, VERSION
from passthrough.kubeapi import APPLY_PATCH, MERGE_PATCH, ApiError, KubeconfigError, Session, open_session, session_of

log = logging.getLogger(__name__)
T = TypeVar("T")

APPLY = APPLY_PATCH
AGENT_MANAGER = "passthrough-agent"
OPERATOR_MANAGER = "passthrough-operator"
NODE_LABEL = "passthrough.io/node"
VFIO_LABEL = "passthrough.io/vfio"


class CannotStart(RuntimeError):
    """No kubeconfig, no API server, no CRDs: the message says what to do."""


async def session(kubeconfig: str | None = None, connections: int = 64) -> Session:
    """A session to the API server from the in-cluster service account, else from a kubeconfig.

    `connections`: how many requests may be in flight at once. Each open TLS connection holds
    a 256 KiB buffer in asyncio, so a long-running process keeps this to what it needs.
    """
    try:
        return await open_session(kubeconfig, connections)
    except KubeconfigError as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise CannotStart(f"no usable kubeconfig at {where} ({exc}); pass --kubeconfig, set KUBECONFIG, or run in a pod") from None


async def connect(kubeconfig: str | None = None, connections: int = 64) -> Any:
    """A kubernetes_asyncio ApiClient, for tests and tools that use its typed API (the
    operator and the agent use `session`); every helper here takes either."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        try:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise CannotStart(
                f"no usable kubeconfig at {where} ({exc}); pass --kubeconfig, set KUBECONFIG, or run in a pod"
            ) from None
    configuration.connection_pool_maxsize = connections
    api = client.ApiClient(configuration)
    api.rest_client.pool_manager._trust_env = False  # noqa: SLF001 (see Session._resolve_proxy_once)
    session_of(api)._resolve_proxy_once()  # noqa: SLF001
    return api


async def require_crds(api: Any, *plurals: str) -> None:
    """Refuse to start without our CRDs: every write would fail, one object at a time."""
    try:
        resources = await session_of(api).request("GET", f"/apis/{GROUP}/{VERSION}", timeout=30)
    except ApiError as exc:
        if exc.status == 404:
            raise CannotStart(
                f"the {GROUP} CRDs are not installed in this cluster: kubectl apply -f crds/ (or install the chart)"
            ) from None
        raise CannotStart(f"cannot read {GROUP}/{VERSION} from the API server: {exc.status} {exc.reason}") from None
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        raise CannotStart(f"cannot reach the API server: {exc or type(exc).__name__}") from None
    names = {r.get("name") for r in resources.get("resources") or []}
    missing = [p for p in plurals if p not in names]
    if missing:
        raise CannotStart(f"CRDs missing from the cluster: {', '.join(f'{p}.{GROUP}' for p in missing)}; kubectl apply -f crds/")


async def patiently(call: Callable[..., Awaitable[T]], *args: Any, attempts: int = 5, **kwargs: Any) -> T:
    """`call`, again after the server's Retry-After while it answers 429.

    It does while a new kind's storage initializes ("storage is (re)initializing") and when
    priority-and-fairness sheds load; both pass within seconds. Every call here is idempotent.
    """
    for attempt in range(attempts):
        try:
            return await call(*args, **kwargs)
        except ApiError as exc:
            if exc.status != 429 or attempt == attempts - 1:
                raise
            try:
                delay = float((exc.headers or {}).get("Retry-After", 1))
            except ValueError:
                delay = 1.0
            await asyncio.sleep(min(max(delay, 0.1), 10))
    raise AssertionError("unreachable")


class Custom:
    """One kind of custom object, cluster-scoped or namespaced, with apply as the only write verb."""

    def __init__(self, api: Any, plural: str, namespaced: bool = False, group: str = GROUP, version: str = VERSION) -> None:
        self.session = session_of(api)
        self.plural, self.namespaced, self.group, self.version = plural, namespaced, group, version

    def path(self, name: str = "", namespace: str | None = None, status: bool = False) -> str:
        path = f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            path += f"/namespaces/{namespace}"
        path += f"/{self.plural}"
        if name:
            path += f"/{name}" + ("/status" if status else "")
        return path

    async def get(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return await patiently(self.session.request, "GET", self.path(name, namespace))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, label_selector: str = "", namespace: str | None = None, **query: Any) -> dict[str, Any]:
        return await patiently(self.session.request, "GET", self.path(namespace=namespace), query={"labelSelector": label_selector, **query})

    async def apply(self, body: dict[str, Any], manager: str, status: bool = False, force: bool = True) -> dict[str, Any]:
        """Server-side apply of `body` (its metadata names the object); `status` targets the subresource."""
        path = self.path(body["metadata"]["name"], body["metadata"].get("namespace"), status)
        query = {"fieldManager": manager, "force": force}
        return await patiently(self.session.request, "PATCH", path, query=query, body=body, content_type=APPLY)

    async def delete(
        self, name: str, namespace: str | None = None, uid: str | None = None, resource_version: str | None = None
    ) -> int:
        """Delete; the answer's status: 200 (deleted or being deleted), 404 (already gone) or 409
        (a precondition failed: `uid` guards against a newer object of that name, `resource_version`
        against one that changed since it was decided on)."""
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions} if preconditions else None
        try:
            await patiently(self.session.request, "DELETE", self.path(name, namespace), body=body)
            return 200
        except ApiError as exc:
            if exc.status in (404, 409):
                return exc.status
            raise

    async def watch(self, label_selector: str = "", resource_version: str = "", timeout: int = 300) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Events after `resource_version` until the server ends the watch; raises ApiError(410) when too old."""
        async for event in watch_events(self.session, self.path(), labelSelector=label_selector,
                                        resourceVersion=resource_version, allowWatchBookmarks=True, timeoutSeconds=timeout):  # fmt: skip
            yield event


def watch_events(api: Any, path: str, timeoutSeconds: int = 300, **query: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:  # noqa: N803
    """(type, object) of each event of a watch of `path` (a list's path), read as plain JSON
    lines; an ERROR event raises ApiError with its code."""
    connect, read = watch_request_timeout(timeoutSeconds)
    return session_of(api).watch(path, {**query, "timeoutSeconds": timeoutSeconds}, connect=connect, read=read)


def watch_request_timeout(server_timeout: int) -> tuple[float, float]:
    """(connect, read) seconds for a watch's request: a connection that never opens, or a server
    gone silent, ends the watch (to be started again) instead of holding it for ever."""
    return (10.0, server_timeout + 30.0)


def merge_listing(cached: Mapping[str, dict[str, Any]], items: Iterable[dict[str, Any]], list_rv: str) -> dict[str, dict[str, Any]]:
    """A cache made current by a listing taken at `list_rv` while a watch may have kept it too:
    what the listing holds, unless the cache has it newer; what the listing lacks is gone,
    unless the cache saw it written after the listing was taken."""
    fresh = {o["metadata"]["name"]: o for o in items}
    merged = {name: cached[name] if name in cached and not newer(obj, cached[name]) else obj for name, obj in fresh.items()}
    probe = {"metadata": {"resourceVersion": list_rv}}
    for name, obj in cached.items():
        if name not in fresh and not newer(probe, obj):
            merged[name] = obj
    return merged


def newer(candidate: dict[str, Any], cached: dict[str, Any] | None) -> bool:
    """Whether `candidate` is not older than `cached` (a write's response may beat its watch event).

    resourceVersions are opaque to clients in general, but the API server's etcd3 storage
    makes them increasing integers; anything else is taken as newer.
    """
    if cached is None:
        return True
    try:
        return int(candidate["metadata"]["resourceVersion"]) >= int(cached["metadata"]["resourceVersion"])
    except (KeyError, ValueError):
        return True


class Mirror:
    """A list+watch cache of one kind under a label selector, kept current in the background.

    `changed` is set whenever an object is added, modified or deleted, so a loop can wait on
    it instead of polling.
    """

    def __init__(self, kind: Custom, label_selector: str = "") -> None:
        self.kind, self.label_selector = kind, label_selector
        self.objects: dict[str, dict[str, Any]] = {}
        self.changed = asyncio.Event()
        self.synced = asyncio.Event()
        self._resource_version = ""

    async def relist(self) -> None:
        """List again: after a connection trouble, a write may have landed whose answer was lost
        while the watch was away, and only the server knows."""
        listing = await self.kind.list(self.label_selector)
        rv = listing["metadata"]["resourceVersion"]
        self.objects = merge_listing(self.objects, listing.get("items", []), rv)
        self._resource_version = rv
        self.synced.set()

    def store(self, obj: dict[str, Any]) -> None:
        """Put the response of our own write in the cache, unless the watch already has newer."""
        if newer(obj, self.objects.get(obj["metadata"]["name"])):
            self.objects[obj["metadata"]["name"]] = obj

    async def run(self) -> None:
        backoff = 1.0
        while True:
            try:
                if not self.synced.is_set() or not self._resource_version:
                    await self.relist()
                    self.changed.set()
                async for kind, obj in self.kind.watch(self.label_selector, self._resource_version):
                    self._resource_version = obj["metadata"].get("resourceVersion", self._resource_version)
                    if kind == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    if kind == "DELETED":
                        self.objects.pop(name, None)
                    elif newer(obj, self.objects.get(name)):
                        self.objects[name] = obj
                    self.changed.set()
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:  # our resourceVersion is too old: start over
                    self._resource_version = ""
                    continue
                log.warning("watch of %s failed (%s); retrying in %.0fs", self.kind.plural, exc.reason, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
            except Exception as exc:  # connection resets and the like
                log.warning("watch of %s broke (%s); retrying in %.0fs", self.kind.plural, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)


_REFERENCE_FIELDS = {"api_version": "apiVersion", "resource_version": "resourceVersion", "field_path": "fieldPath"}


class EventRecorder:
    """Posts core/v1 Events in the background; a failure to post is logged, never raised.

    Events wait their turn in a queue, at most `concurrency` in flight. With `quiet` (a wait
    until the poster's own work is done, such as the work queue running empty), an Event also
    waits for that, but never more than `max_delay` seconds: in a burst (hundreds of
    assignments at once) they yield the API server to the writes that make the transitions.
    None is dropped for that: every transition gets its Event, in order, seconds later at
    most, stamped with when it happened. Should more than `backlog` wait (the API server
    away for long), the oldest are dropped and counted in a warning; the objects' conditions
    still say where each one stands.

    Events of cluster-scoped objects go to the `default` namespace, where kubectl describe
    finds them.
    """

    def __init__(
        self, api: Any, component: str, concurrency: int = 4, backlog: int = 10_000,
        quiet: Callable[[], Awaitable[None]] | None = None, max_delay: float = 10.0,
    ) -> None:  # fmt: skip
        self.session = session_of(api)
        self.component = component
        self.concurrency, self.backlog = concurrency, backlog
        self.quiet, self.max_delay = quiet, max_delay
        self._pending: collections.deque[tuple[float, tuple[dict[str, Any], str, str, str, datetime.datetime]]] = collections.deque()
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
        self._pending.append((asyncio.get_running_loop().time(), (involved, type_, reason, message, now)))
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
        loop = asyncio.get_running_loop()
        while self._pending:
            hold = self.max_delay - (loop.time() - self._pending[0][0])
            if self.quiet is not None and hold > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.quiet(), hold)
                if not self._pending:
                    break
            await self._post(*self._pending.popleft()[1])

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
        self.quiet = None  # nothing more to wait for
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), timeout)
        self._pending.clear()
        for task in list(self._posters):
            task.cancel()
        await asyncio.gather(*self._posters, return_exceptions=True)
