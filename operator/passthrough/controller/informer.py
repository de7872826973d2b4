"""A list+watch cache of one kind that keeps a small view of each object, never its body.

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
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from passthrough.api.models import GROUP, VERSION
from passthrough.kube.watch import watch_events
from passthrough.kube.client import ApiError, session_of

log = logging.getLogger(__name__)
V = TypeVar("V")
Key = str | tuple[str, str]  # the name of a cluster-scoped object, (namespace, name) of another


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
    """Keeps `view(body)` of every object of one kind, and indexes of those views.

    A view carries its object's `resource_version`. `indexes` name functions from a view to
    {key: value} (or None), as Kopf index handlers are from a body. `on_change(old, new)` is
    called once the indexes show the change (None for an object not there before, or gone).
    """

    def __init__(
        self,
        api: Any,
        plural: str,
        view: Callable[[Mapping[str, Any]], V],
        indexes: Mapping[str, Callable[[V], Mapping[Hashable, Any] | None]],
        on_change: Callable[[V | None, V | None], None],
        page_size: int = 100,
        group: str = GROUP,
        version: str = VERSION,
    ) -> None:
        self.session = session_of(api)
        self.plural, self.group, self.version = plural, group, version
        self.view, self.on_change, self.page_size = view, on_change, page_size
        self._index_functions = dict(indexes)
        self.indexes = {name: Index() for name in indexes}
        self._views: dict[Key, V] = {}
        self._resource_version = ""
        self.synced = asyncio.Event()

    def __len__(self) -> int:
        return len(self._views)

    # -- the cache ---------------------------------------------------------------------------

    def _set(self, key: Key, body: Mapping[str, Any] | None) -> None:
        old = self._views.get(key)
        if body is None:
            if old is None:
                return
            del self._views[key]
            new = None
        else:
            if old is not None and old.resource_version == body["metadata"].get("resourceVersion"):
                return  # a relist showing what we hold
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
        self.on_change(old, new)

    @staticmethod
    def _key(body: Mapping[str, Any]) -> Key:
        meta = body["metadata"]
        return (meta["namespace"], meta["name"]) if meta.get("namespace") else meta["name"]

    # -- list and watch -------------------------------------------------------------------------

    retry_delay = 1.0  # the first wait after a failure; doubled up to 30 s while it lasts

    async def run(self) -> None:
        backoff = self.retry_delay
        while True:
            try:
                if not self._resource_version:
                    await self._relist()
                    self.synced.set()
                await self._watch()
                backoff = self.retry_delay
            except asyncio.CancelledError:
                raise
            except ApiError as exc:
                if exc.status == 410:  # our resourceVersion is too old: list again
                    self._resource_version = ""
                    continue
                log.warning("watching %s failed (%s %s); again in %.0fs", self.plural, exc.status, exc.reason, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
            except Exception as exc:  # connection resets and the like
                log.warning("watching %s broke (%s); again in %.0fs", self.plural, exc or type(exc).__name__, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)

    async def _relist(self) -> None:
        seen: set[Key] = set()
        token = ""
        while True:
            page = await self.session.request("GET", self._path, query={"limit": self.page_size, "continue": token})
            for body in page.get("items") or ():
                key = self._key(body)
                seen.add(key)
                self._set(key, body)
            metadata = page.get("metadata") or {}
            token = metadata.get("continue") or ""
            if not token:
                break
        for key in [k for k in self._views if k not in seen]:  # deleted while we were not watching
            self._set(key, None)
        self._resource_version = metadata.get("resourceVersion", "")

    async def _watch(self) -> None:
        async for kind, body in watch_events(self.session, self._path, resourceVersion=self._resource_version, allowWatchBookmarks=True):
            self._resource_version = (body.get("metadata") or {}).get("resourceVersion") or self._resource_version
            if kind == "BOOKMARK":
                continue
            self._set(self._key(body), None if kind == "DELETED" else body)

    @property
    def _path(self) -> str:
        return f"/apis/{self.group}/{self.version}/{self.plural}"
