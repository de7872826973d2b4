"""A listing taken while a watch kept the cache: what each side knows best is kept."""

from __future__ import annotations

from passthrough.kube.cache import Mirror
from passthrough.kube.custom import Custom
from passthrough.kube.watch import watch_request_timeout
from tests.unit.test_informer import FakeSession


def obj(name: str, rv: int, **extra) -> dict:
    return {"metadata": {"name": name, "resourceVersion": str(rv)}, **extra}


async def merge_listing(cached: dict[str, dict], items: list[dict], list_rv: str) -> dict[str, dict]:
    """What a mirror that holds `cached` (written by us, or seen by its watch) holds once a
    listing of `items` taken at `list_rv` is in."""
    mirror = Mirror(Custom(FakeSession(items, list_rv=list_rv), "things"))
    for body in cached.values():
        mirror.store(body)
    await mirror.relist()
    return mirror.objects


async def test_an_object_written_while_the_cache_was_away_comes_in_with_the_listing():
    # The answer to its create was lost and the watch was gone: only the listing has it.
    merged = await merge_listing({"a": obj("a", 5)}, [obj("a", 5), obj("lost-answer", 7)], "8")
    assert set(merged) == {"a", "lost-answer"}


async def test_the_listing_drops_what_is_gone_but_not_what_was_written_after_it():
    cached = {"deleted": obj("deleted", 3), "newer-than-the-list": obj("newer-than-the-list", 12)}
    merged = await merge_listing(cached, [], "10")
    assert set(merged) == {"newer-than-the-list"}


async def test_the_newer_copy_wins_either_way():
    cached = {"a": obj("a", 12, spec="cache"), "b": obj("b", 4, spec="cache")}
    merged = await merge_listing(cached, [obj("a", 9, spec="list"), obj("b", 9, spec="list")], "10")
    assert merged["a"]["spec"] == "cache" and merged["b"]["spec"] == "list"


def test_a_watch_ends_once_its_connection_or_its_server_goes_silent():
    connect, read = watch_request_timeout(300)
    assert 0 < connect <= 30 and read > 300
