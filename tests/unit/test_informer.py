"""The informer's cache and indexes, against a fake API that serves pages and watch lines."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import pytest

from passthrough.kube.cache import Index, Informer
from passthrough.kube.client import ApiError


@dataclass(frozen=True)
class View:
    name: str
    resource_version: str
    group: str


def view(body) -> View:
    return View(body["metadata"]["name"], body["metadata"]["resourceVersion"], body.get("spec", {}).get("group", ""))


def obj(name: str, rv: int, group: str = "") -> dict:
    return {"metadata": {"name": name, "resourceVersion": str(rv)}, "spec": {"group": group}}


class FakeSession:
    """Serves `items` in pages, then the watch `streams` one after the other (then waits);
    shaped as `kube.client.Session` (whose JSON lines are read against the real API server in
    the integration tests)."""

    def __init__(self, items, streams=(), list_rv: str = "100", later_listings=()) -> None:
        self.items, self.streams, self.list_rv = list(items), list(streams), list_rv
        self.later_listings = list(later_listings)  # what each further listing from scratch shows
        self.calls: list[dict] = []
        self.refusals: list[int] = []  # statuses the next listings answer with

    async def request(self, method, path, query=None, **kwargs):
        self.calls.append(dict(query or {}))
        if self.refusals:
            raise ApiError(self.refusals.pop(0), "refused")
        start = int(query.get("continue") or 0)
        if not start and any(not c.get("watch") for c in self.calls[:-1]) and self.later_listings:
            self.items = self.later_listings.pop(0)
        page = self.items[start:start + query["limit"]]
        more = start + query["limit"] < len(self.items)
        meta = {"resourceVersion": self.list_rv, "continue": str(start + query["limit"]) if more else ""}
        return json.loads(json.dumps({"items": page, "metadata": meta}))

    async def watch(self, path, query=None, **kwargs):
        self.calls.append({**(query or {}), "watch": True})
        if not self.streams:
            await asyncio.Event().wait()
        stream = self.streams.pop(0)
        if isinstance(stream, int):
            raise ApiError(stream, "refused")
        for event in stream:
            if isinstance(event, BaseException):
                raise event
            if event["type"] == "ERROR":
                raise ApiError(event["object"].get("code"), event["object"].get("message", ""))
            yield event["type"], event["object"]


FakeObjects = FakeSession


def informer(objects: FakeObjects, changes: list, page_size: int = 100) -> Informer:
    return Informer(objects, "things", view, {"by_group": lambda v: {v.group: v.name} if v.group else None,
                                             "by_name": lambda v: {v.name: v}},
                    lambda old, new: changes.append((old and old.name, new and new.name)), page_size=page_size)


async def run_until(inf: Informer, predicate, timeout: float = 2) -> None:
    task = asyncio.create_task(inf.run())
    try:
        async with asyncio.timeout(timeout):
            while not predicate():
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_an_index_holds_one_value_per_object_and_key():
    index = Index()
    index._put("a", {"g1": "a"})
    index._put("b", {"g1": "b"})
    index._put("c", {"g2": "c"})
    assert sorted(index["g1"]) == ["a", "b"] and index["g2"] == ("c",)
    index._drop("a", {"g1": "a"})
    assert index["g1"] == ("b",)
    index._put("b", {"g1": "b2"})  # the same object, a new value
    assert index["g1"] == ("b2",)
    index._drop("b", {"g1": "b2"})
    index._drop("c", {"g2": "c"})
    assert len(index) == 0 and index.get("g1") is None


async def test_the_listing_comes_in_pages_and_every_object_is_indexed_by_its_view():
    objects = FakeObjects([obj(f"d{i}", i + 1, group=f"g{i % 3}") for i in range(250)])
    changes: list = []
    inf = informer(objects, changes)
    await run_until(inf, inf.synced.is_set)
    lists = [c for c in objects.calls if not c.get("watch")]
    assert [c["limit"] for c in lists] == [100, 100, 100]
    assert len(inf) == 250 and len(changes) == 250
    assert len(inf.indexes["by_group"]["g0"]) == 84 and inf.indexes["by_name"]["d7"][0].group == "g1"
    watch = objects.calls[-1]
    assert watch["watch"] and watch["resourceVersion"] == "100" and watch["allowWatchBookmarks"]


async def test_watch_events_move_index_entries_and_call_back_once_each():
    events = [
        {"type": "ADDED", "object": obj("new", 101, "g1")},
        {"type": "MODIFIED", "object": obj("old", 102, "g2")},  # moved from g1 to g2
        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "103"}}},
        {"type": "DELETED", "object": obj("gone", 104, "g1")},
    ]
    objects = FakeObjects([obj("old", 1, "g1"), obj("gone", 2, "g1")], streams=[events])
    changes: list = []
    inf = informer(objects, changes)
    await run_until(inf, lambda: len(changes) == 5)
    assert changes[2:] == [(None, "new"), ("old", "old"), ("gone", None)]
    assert inf.indexes["by_group"]["g1"] == ("new",) and inf.indexes["by_group"]["g2"] == ("old",)
    assert "gone" not in inf.indexes["by_name"]
    assert inf._resource_version == "104"


async def test_a_watch_too_old_lists_again_and_drops_what_was_deleted_meanwhile():
    objects = FakeObjects([obj("a", 1), obj("b", 2)], streams=[[{"type": "ERROR", "object": {"code": 410, "message": "too old"}}]],
                          later_listings=[[obj("a", 1), obj("c", 3)]])  # b deleted, c made while we were not watching
    changes: list = []
    inf = informer(objects, changes)
    await run_until(inf, lambda: len(changes) == 4)
    assert changes[2:] == [(None, "c"), ("b", None)] or changes[2:] == [("b", None), (None, "c")]
    assert sorted(inf.indexes["by_name"]) == ["a", "c"]  # a: same version, no call back


async def test_a_broken_watch_is_retried_from_where_it_was():
    objects = FakeObjects([obj("a", 1)], streams=[[{"type": "MODIFIED", "object": obj("a", 5)}, ConnectionResetError()],
                                                  [{"type": "MODIFIED", "object": obj("a", 6)}]])
    changes: list = []
    inf = informer(objects, changes)
    inf.retry_delay = 0.01
    await run_until(inf, lambda: len(changes) == 3)
    watches = [c for c in objects.calls if c.get("watch")]
    assert [w["resourceVersion"] for w in watches[:2]] == ["100", "5"]
    assert inf.indexes["by_name"]["a"][0].resource_version == "6"


async def test_an_error_answer_to_the_listing_is_raised_and_retried():
    objects = FakeObjects([obj("a", 1)])
    objects.refusals = [503]
    inf = informer(objects, [])
    with pytest.raises(ApiError):
        await inf.relist()
    await inf.relist()
    assert len(inf) == 1


async def test_an_object_whose_view_fails_is_skipped_and_the_others_are_cached(caplog):
    objects = FakeObjects([obj("a", 1), {"metadata": {"name": "odd"}}, obj("b", 2)])  # no resourceVersion
    inf = informer(objects, [])
    await inf.relist()
    assert sorted(inf.indexes["by_name"]) == ["a", "b"]
    assert "things odd cannot be read (KeyError" in caplog.text


async def test_a_watch_that_ends_at_once_with_nothing_in_it_is_tried_again_after_a_wait():
    # An API server too busy to serve a watch closes it at once ("unresponsive"); watching again
    # at once from the same resourceVersion, with more to replay each time, fed its load.
    objects = FakeObjects([obj("a", 1)], streams=[[], [], [{"type": "MODIFIED", "object": obj("a", 5)}]])
    changes: list = []
    inf = informer(objects, changes)
    inf.retry_delay = 0.1
    started = asyncio.get_running_loop().time()
    await run_until(inf, lambda: len(changes) == 2)
    assert asyncio.get_running_loop().time() - started >= 0.1 + 0.2  # waited 0.1-0.2 s, then 0.2-0.4 s
    assert [c["resourceVersion"] for c in objects.calls if c.get("watch")][:3] == ["100", "100", "100"]


async def test_a_watch_that_brought_events_is_followed_at_once():
    objects = FakeObjects([obj("a", 1)], streams=[[{"type": "MODIFIED", "object": obj("a", 5)}],
                                                  [{"type": "MODIFIED", "object": obj("a", 6)}]])
    changes: list = []
    inf = informer(objects, changes)
    inf.retry_delay = 5
    await run_until(inf, lambda: len(changes) == 3, timeout=1)
