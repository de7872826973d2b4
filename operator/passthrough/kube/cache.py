"""A list+watch cache of one kind, kept current in the background: the operator's informers
and the agent's mirror of its node's NodePCIDevices are both this one.

The operator's two kinds that number in the thousands, NodePCIDevices and PCIDevices, are
cached here rather than in Kopf's indexes: Kopf holds every object's handling back at
start-up until all of them are indexed, and each one indexed wakes every object waiting,
so its start-up grows with the square of the objects (8x the time for 2x the devices).
Here the listing comes in pages, each object is turned into its view as it arrives, and a
change costs its own indexes' keys and one call back, whatever the number of objects.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import random
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from passthrough.api.names import GROUP, VERSION
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.custom import Custom
from passthrough.kube.watch import watch_events

log = logging.getLogger(__name__)
V = TypeVar("V")
Key = str | tuple[str, str]  # the name of a cluster-scoped object, (namespace, name) of another


def _newer(candidate: str, cached: str) -> bool:
    """Whether an object at resourceVersion `candidate` replaces the copy cached at `cached`
    (a write's answer may beat its watch event, and a listing the watch).

    resourceVersions are opaque to clients in general, but the API server's etcd3 storage
    makes them increasing integers; anything else that differs is taken as newer.
    """
    if candidate == cached:
        return False
    try:
        return int(candidate) > int(cached)
    except ValueError:
        return True


def _written_after(version: str, listed: str) -> bool:
    """Whether an object cached at `version` was written after a listing taken at `listed`."""
    try:
        return int(version) > int(listed)
    except ValueError:
        return False


def jittered(backoff: float) -> float:
    """A wait of between `backoff` and twice it, at random (client-go's wait.Jitter with factor 1):
    a thousand agents cut off by one API-server brownout come back spread over the window, not
    all in the same second (and again together at every doubling)."""
    return backoff * (1 + random.random())


def object_key(body: Mapping[str, Any]) -> Key:
    meta = body["metadata"]
    return (meta["namespace"], meta["name"]) if meta.get("namespace") else meta["name"]


def _as_it_is(body: Mapping[str, Any]) -> dict[str, Any]:
    return body  # type: ignore[return-value]


def _resource_version(body: Mapping[str, Any]) -> str:
    return (body.get("metadata") or {}).get("resourceVersion") or ""


class Index(Mapping[Hashable, tuple]):
    """Like a Kopf index: a key to the values given for it, one per object that gives one.

    Most keys (a device's name, its IOMMU group) have one object: that one is held as an
    (object, value) pair, a dict only from the second on.
    """

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[Key, Any] | dict[Key, Any]] = {}

    def __getitem__(self, key: Hashable) -> tuple:
        held = self._entries[key]
        return (held[1],) if type(held) is tuple else tuple(held.values())

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, obj: Key, entries: Mapping[Hashable, Any] | None) -> None:
        for key, value in (entries or {}).items():
            held = self._entries.get(key)
            if held is None or (type(held) is tuple and held[0] == obj):
                self._entries[key] = (obj, value)
            elif type(held) is tuple:
                self._entries[key] = {held[0]: held[1], obj: value}
            else:
                held[obj] = value

    def _drop(self, obj: Key, entries: Mapping[Hashable, Any] | None) -> None:
        for key in entries or ():
            held = self._entries.get(key)
            if held is None:
                continue
            if type(held) is tuple:
                if held[0] == obj:
                    del self._entries[key]
                continue
            held.pop(obj, None)
            if len(held) == 1:
                self._entries[key] = next(iter(held.items()))


class Informer(Generic[V]):
    """Keeps `view(body)` of every object of one kind (under `label_selector`), and indexes of
    those views.

    A view carries its object's resourceVersion (`resource_version(view)`, by default its
    `resource_version` attribute). `indexes` name functions from a view to {key: value} (or
    None), as Kopf index handlers are from a body. `on_change(old, new)` is called once the
    indexes show the change (None for an object not there before, or gone), and `changed` is
    set, so a loop can wait on it instead of polling.
    """

    def __init__(
        self,
        api: Any,
        plural: str,
        view: Callable[[Mapping[str, Any]], V],
        indexes: Mapping[str, Callable[[V], Mapping[Hashable, Any] | None]] | None = None,
        on_change: Callable[[V | None, V | None], None] | None = None,
        page_size: int = 100,
        group: str = GROUP,
        version: str = VERSION,
        *,
        label_selector: str = "",
        resource_version: Callable[[V], str] = operator.attrgetter("resource_version"),
        key: Callable[[Mapping[str, Any]], Key] = object_key,
    ) -> None:
        self.session = session_of(api)
        self.plural, self.group, self.version, self.label_selector = plural, group, version, label_selector
        self.view, self.on_change, self.page_size = view, on_change, page_size
        self._version_of, self._key = resource_version, key
        self._index_functions = dict(indexes or {})
        self.indexes = {name: Index() for name in self._index_functions}
        self._views: dict[Key, V] = {}
        self._resource_version = ""
        self.synced = asyncio.Event()
        self.changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._views)

    # -- the cache ---------------------------------------------------------------------------

    def store(self, body: Mapping[str, Any]) -> None:
        """Put the answer of our own write in the cache, unless the watch already has it newer."""
        self._set(self._key(body), body)

    def _set(self, key: Key, body: Mapping[str, Any] | None) -> None:
        old = self._views.get(key)
        if body is None:
            if old is None:
                return
            del self._views[key]
            new = None
        else:
            if old is not None and not _newer(_resource_version(body), self._version_of(old)):
                return  # what we hold already, or older (a listing or a watch behind our own write)
            try:
                new = self.view(body)
            except Exception as exc:  # an odd object must not stop the cache of all the others
                log.warning("%s %s cannot be read (%s: %s); it counts as it was before until it changes",
                            self.plural, key, type(exc).__name__, exc)
                return
            self._views[key] = new
        for name, function in self._index_functions.items():
            index = self.indexes[name]
            if old is not None:
                index._drop(key, function(old))
            if new is not None:
                index._put(key, function(new))
        if self.on_change is not None:
            self.on_change(old, new)
        self.changed.set()

    # -- list and watch -------------------------------------------------------------------------

    retry_delay = 1.0  # the first wait after a failure; doubled up to 30 s while it lasts
    relist_jitter = 1.0  # at most this many seconds before listing again after a 410
    short_watch = 1.0  # seconds: a watch that ends sooner with no event in it counts as a failure

    async def run(self) -> None:
        backoff = self.retry_delay
        loop = asyncio.get_running_loop()
        while True:
            try:
                if not self._resource_version:
                    await self.relist()
                started = loop.time()
                if await self._watch() or loop.time() - started >= self.short_watch:
                    backoff = self.retry_delay
                    continue
                # Ended at once with nothing in it, as client-go's reflector calls "very short
                # watch": an API server too busy to serve it closes it so ("watcher close due
                # to unresponsiveness"), and at once again from the same resourceVersion, with
                # more to replay each time: wait, as after any failure.
                backoff = await self._back_off(backoff, logging.DEBUG, "watch of %s ended at once with no event")
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:  # our resourceVersion is too old: list again
                    self._resource_version = ""
                    # Every client's watch expires together after an API server's restart or
                    # etcd's compaction: spread the relists instead of listing in step.
                    await asyncio.sleep(random.uniform(0, self.relist_jitter))
                    continue
                backoff = await self._back_off(backoff, logging.WARNING, "watching %s failed (%s %s)", exc.status, exc.reason)
            except Exception as exc:  # connection resets and the like
                backoff = await self._back_off(backoff, logging.WARNING, "watching %s broke (%s)", exc or type(exc).__name__)

    async def _back_off(self, backoff: float, level: int, why: str, *args: object) -> float:
        """Wait about `backoff` seconds (jittered), saying why; the wait after the next failure in a row."""
        wait = jittered(backoff)
        log.log(level, why + "; again in %.1fs", self.plural, *args, wait)
        await asyncio.sleep(wait)
        return min(backoff * 2, 30)

    async def relist(self) -> None:
        """List (again): at start, after the watch fell too far behind, or after connection
        trouble, when a write may have landed whose answer was lost and only the server knows.

        A watch may keep the cache meanwhile: what the listing holds comes in unless the cache
        has it newer, and what it lacks is gone unless the cache saw it written after the
        listing was taken.
        """
        seen: set[Key] = set()
        token = ""
        while True:
            query = {"labelSelector": self.label_selector, "limit": self.page_size, "continue": token}
            page = await self.session.request("GET", self._path, query=query)
            for body in page.get("items") or ():
                key = self._key(body)
                seen.add(key)
                self._set(key, body)
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") or ""
            if not token:
                break
        listed = metadata.get("resourceVersion", "")
        for key in [k for k, view in self._views.items() if k not in seen and not _written_after(self._version_of(view), listed)]:
            self._set(key, None)  # deleted while we were not watching
        self._resource_version = listed
        self.synced.set()

    async def _watch(self) -> int:
        """Follow one watch until it ends; the number of events it brought (bookmarks too)."""
        events = 0
        async for kind, body in watch_events(self.session, self._path, labelSelector=self.label_selector,
                                             resourceVersion=self._resource_version, allowWatchBookmarks=True):  # fmt: skip
            events += 1
            self._resource_version = (body.get("metadata") or {}).get("resourceVersion") or self._resource_version
            if kind == "BOOKMARK":
                continue
            self._set(self._key(body), None if kind == "DELETED" else body)
        return events

    @property
    def _path(self) -> str:
        return f"/apis/{self.group}/{self.version}/{self.plural}"


class Mirror(Informer[dict[str, Any]]):
    """The whole bodies of one kind's objects, by name (`objects`): for a handful of objects,
    such as an agent's own NodePCIDevices."""

    def __init__(self, kind: Custom, label_selector: str = "") -> None:
        super().__init__(kind.session, kind.plural, _as_it_is, group=kind.group, version=kind.version, label_selector=label_selector,
                         resource_version=_resource_version, key=lambda body: body["metadata"]["name"])  # fmt: skip

    @property
    def objects(self) -> dict[str, dict[str, Any]]:
        return self._views  # type: ignore[return-value]
