"""The Kubernetes API as this project uses it: one client, server-side apply, small watches.

Kopf has its own client for watching; everything we write goes through here, with
kubernetes-asyncio, so every write is a server-side apply under a named field manager.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

import aiohttp
import yarl
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client import rest as _rest
from kubernetes_asyncio.client.exceptions import ApiException

from passthrough.api.models import GROUP, VERSION

log = logging.getLogger(__name__)
T = TypeVar("T")

APPLY = "application/apply-patch+yaml"
AGENT_MANAGER = "passthrough-agent"
OPERATOR_MANAGER = "passthrough-operator"
NODE_LABEL = "passthrough.io/node"
VFIO_LABEL = "passthrough.io/vfio"


class CannotStart(RuntimeError):
    """No kubeconfig, no API server, no CRDs: the message says what to do."""


class _Utf8Json:
    """What the generated client's REST layer calls `json`: bodies as UTF-8, not \\u escapes.

    It serializes every body with `json.dumps`, whose ASCII escapes write a character beyond
    the Basic Multilingual Plane (an emoji in a device's name) as a surrogate pair, which is
    JSON but not YAML: the API server parses apply patches as YAML and answers 400, and the
    object's key would retry for ever.
    """

    @staticmethod
    def dumps(obj: Any, **kwargs: Any) -> str:
        return json.dumps(obj, ensure_ascii=False, **kwargs)


_rest.json = _Utf8Json  # type: ignore[assignment]


async def connect(kubeconfig: str | None = None, connections: int = 64) -> client.ApiClient:
    """An API client from the in-cluster service account, else from a kubeconfig.

    `connections`: how many requests may be in flight at once. Each open TLS connection holds
    a 256 KiB buffer in asyncio, so a long-running process keeps this to what it needs.
    """
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
    _resolve_proxy_once(api, configuration)
    return api


def _resolve_proxy_once(api: client.ApiClient, configuration: client.Configuration) -> None:
    # Trusting the environment, aiohttp reads ~/.netrc and the proxy variables in a worker
    # thread for every request: a tenth of the operator's CPU in a burst. The server is one
    # and known, so its proxy (if the environment names one) is looked up once, here.
    session = api.rest_client.pool_manager
    if not configuration.proxy:
        with contextlib.suppress(LookupError):
            proxy, auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(configuration.host))
            api.rest_client.proxy = str(proxy)
            if auth is not None:
                api.rest_client.proxy_headers = {"Proxy-Authorization": auth.encode()}
    session._trust_env = False  # noqa: SLF001 (no public switch once the session exists)


async def require_crds(api: client.ApiClient, *plurals: str) -> None:
    """Refuse to start without our CRDs: every write would fail, one object at a time."""
    try:
        resources = await client.CustomObjectsApi(api).get_api_resources(GROUP, VERSION)
    except ApiException as exc:
        if exc.status == 404:
            raise CannotStart(
                f"the {GROUP} CRDs are not installed in this cluster: kubectl apply -f crds/ (or install the chart)"
            ) from None
        raise CannotStart(f"cannot read {GROUP}/{VERSION} from the API server: {exc.status} {exc.reason}") from None
    except OSError as exc:
        raise CannotStart(f"cannot reach the API server: {exc}") from None
    names = {r.name for r in resources.resources or []}
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
        except ApiException as exc:
            if exc.status != 429 or attempt == attempts - 1:
                raise
            try:
                delay = float((exc.headers or {}).get("Retry-After", 1))
            except ValueError:
                delay = 1.0
            await asyncio.sleep(min(max(delay, 0.1), 10))
    raise AssertionError("unreachable")


class Custom:
    """One passthrough.io kind, cluster-scoped or namespaced, with apply as the only write verb."""

    def __init__(self, api: client.ApiClient, plural: str, namespaced: bool = False, group: str = GROUP, version: str = VERSION) -> None:
        self.objects = client.CustomObjectsApi(api)
        self.plural, self.namespaced, self.group, self.version = plural, namespaced, group, version

    async def get(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            if self.namespaced:
                return await patiently(self.objects.get_namespaced_custom_object, self.group, self.version, namespace, self.plural, name)
            return await patiently(self.objects.get_cluster_custom_object, self.group, self.version, self.plural, name)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, label_selector: str = "", namespace: str | None = None) -> dict[str, Any]:
        if self.namespaced and namespace:
            return await patiently(
                self.objects.list_namespaced_custom_object, self.group, self.version, namespace, self.plural, label_selector=label_selector
            )
        return await patiently(
            self.objects.list_cluster_custom_object, self.group, self.version, self.plural, label_selector=label_selector
        )

    async def apply(self, body: dict[str, Any], manager: str, status: bool = False, force: bool = True) -> dict[str, Any]:
        """Server-side apply of `body` (its metadata names the object); `status` targets the subresource."""
        name = body["metadata"]["name"]
        namespace = body["metadata"].get("namespace")
        # The generated client maps only 200 to a body; an apply that creates answers 201.
        kwargs = {"field_manager": manager, "force": force, "_content_type": APPLY, "_preload_content": False}
        if self.namespaced:
            call = self.objects.patch_namespaced_custom_object_status if status else self.objects.patch_namespaced_custom_object
            args = (self.group, self.version, namespace, self.plural, name, body)
        else:
            call = self.objects.patch_cluster_custom_object_status if status else self.objects.patch_cluster_custom_object
            args = (self.group, self.version, self.plural, name, body)

        async def once() -> dict[str, Any]:
            response = await call(*args, **kwargs)
            data = await response.read()
            if not 200 <= response.status < 300:
                # Without preloading, the client hands back errors as if they were the object.
                exc = ApiException(status=response.status, reason=response.reason)
                exc.body, exc.headers = data.decode(errors="replace"), response.headers
                raise exc
            return json.loads(data)

        return await patiently(once)

    async def delete(
        self, name: str, namespace: str | None = None, uid: str | None = None, resource_version: str | None = None
    ) -> int:
        """Delete; the answer's status: 200 (deleted or being deleted), 404 (already gone) or 409
        (a precondition failed: `uid` guards against a newer object of that name, `resource_version`
        against one that changed since it was decided on)."""
        preconditions = client.V1Preconditions(uid=uid or None, resource_version=resource_version or None)
        body = client.V1DeleteOptions(preconditions=preconditions) if uid or resource_version else None
        try:
            if self.namespaced:
                await patiently(self.objects.delete_namespaced_custom_object, self.group, self.version, namespace, self.plural, name, body=body)
            else:
                await patiently(self.objects.delete_cluster_custom_object, self.group, self.version, self.plural, name, body=body)
            return 200
        except ApiException as exc:
            if exc.status in (404, 409):
                return exc.status
            raise

    async def watch(self, label_selector: str = "", resource_version: str = "", timeout: int = 300) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Events after `resource_version` until the server ends the watch; raises ApiException(410) when too old."""
        async for event in watch_events(
            self.objects.list_cluster_custom_object, self.group, self.version, self.plural,
            label_selector=label_selector, resource_version=resource_version, allow_watch_bookmarks=True, timeout_seconds=timeout,
        ):  # fmt: skip
            yield event


async def watch_events(list_call: Callable[..., Awaitable[Any]], *args: Any, timeout_seconds: int = 300,
                       **kwargs: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:  # fmt: skip
    """(type, object) of each event of a watch made with `list_call` (a generated client's list
    method), read as plain JSON lines; an ERROR event raises ApiException with its code.

    Not kubernetes_asyncio's `Watch`: that builds an ApiClient for every stream (an SSL context
    loading the system CA store, 20 ms of CPU, and a session it never closes), which a
    thousand agents in one process, or one agent over days, pay again at every reconnect.
    """
    response = await list_call(
        *args, watch=True, timeout_seconds=timeout_seconds, _request_timeout=watch_request_timeout(timeout_seconds),
        _preload_content=False, **kwargs,
    )  # fmt: skip
    try:
        if response.status != 200:
            raise ApiException(status=response.status, reason=response.reason)
        async for line in response.content:
            if not line.strip():
                continue
            event = json.loads(line)  # a line cut short by a dropped connection raises: the watch starts over
            kind, body = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise ApiException(status=body.get("code"), reason=f"{body.get('reason')}: {body.get('message')}")
            yield kind, body
    finally:
        response.release()


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
            except ApiException as exc:
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
        self, api: client.ApiClient | client.CoreV1Api, component: str, concurrency: int = 4, backlog: int = 10_000,
        quiet: Callable[[], Awaitable[None]] | None = None, max_delay: float = 10.0,
    ) -> None:  # fmt: skip
        self.core = client.CoreV1Api(api) if isinstance(api, client.ApiClient) else api
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
            response = await self.core.create_namespaced_event(namespace, event, _request_timeout=30, _preload_content=False)
            try:
                if not 200 <= response.status < 300:
                    raise ApiException(status=response.status, reason=response.reason)
                created = json.loads(await response.read())
            finally:
                response.release()
            self._remember(key, (namespace, created["metadata"]["name"], 1))
        except Exception as exc:  # Events are best effort: losing one must not stop a reconcile
            # ...but a lasting cause (RBAC, a missing namespace) is worth one warning.
            cause = f"{exc.status} {exc.reason}" if isinstance(exc, ApiException) else type(exc).__name__
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
        response = await self.core.patch_namespaced_event(
            name, namespace, patch, _content_type="application/merge-patch+json", _request_timeout=30, _preload_content=False
        )
        try:
            if not 200 <= response.status < 300:
                # Gone (expired), or not ours to patch (RBAC of an older chart): a new one.
                self._posted.pop(key, None)
                return False
        finally:
            response.release()
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
