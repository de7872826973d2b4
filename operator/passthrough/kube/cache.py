"""A list+watch cache of one kind, kept current in the background."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from passthrough.kube.client import ApiError
from passthrough.kube.custom import Custom

log = logging.getLogger(__name__)


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
