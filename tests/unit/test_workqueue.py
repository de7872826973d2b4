"""The work queue folds repeated keys and never lets two workers hold the same key."""

from __future__ import annotations

import asyncio

import pytest

from passthrough.controller.workqueue import WorkQueue, run_workers
from passthrough.durations import DurationError, parse_duration


async def test_a_key_added_many_times_is_handled_once():
    queue = WorkQueue()
    for _ in range(5):
        queue.add("a")
    queue.add("b")
    assert [await queue.get(), await queue.get()] == ["a", "b"]
    assert len(queue) == 2
    queue.done("a")
    queue.done("b")
    assert len(queue) == 0


async def test_a_key_added_while_being_processed_comes_back_after_done():
    queue = WorkQueue()
    queue.add("a")
    key = await queue.get()
    queue.add("a")  # an event arrives mid-reconcile
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(queue.get(), 0.05)  # not handed to a second worker meanwhile
    queue.done(key)
    assert await asyncio.wait_for(queue.get(), 1) == "a"


async def test_add_after_keeps_the_earliest_time():
    queue = WorkQueue()
    queue.add_after("a", 0.05)
    queue.add_after("a", 10)
    assert await asyncio.wait_for(queue.get(), 1) == "a"
    queue.close()


async def test_workers_never_run_one_key_twice_at_once_and_retry_failures():
    queue = WorkQueue()
    running: set[str] = set()
    overlaps, calls = [], []

    async def handle(key):
        if key in running:
            overlaps.append(key)
        running.add(key)
        calls.append(key)
        await asyncio.sleep(0.01)
        running.discard(key)
        if key == "flaky" and calls.count("flaky") < 3:
            raise RuntimeError("transient")
        for _ in range(3):
            queue.add(key) if calls.count(key) < 4 else None

    task = asyncio.create_task(run_workers(queue, handle, 8, lambda key, exc, n: 0.01))
    for key in ("a", "b", "flaky"):
        queue.add(key)
    await asyncio.sleep(0.5)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert overlaps == []
    assert calls.count("flaky") >= 3


@pytest.mark.parametrize(("text", "seconds"), [("300", 300), ("90s", 90), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), (4, 4)])
def test_durations_read_as_admins_write_them(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5 m", "m5", "0", "-1m", "1h-5m"])
def test_a_bad_duration_says_what_is_accepted(text):
    with pytest.raises(DurationError):
        parse_duration(text)



async def test_wait_empty_returns_once_no_key_waits_or_is_processed():
    queue = WorkQueue()
    await asyncio.wait_for(queue.wait_empty(), 1)  # empty from the start
    queue.add("a")
    queue.add("b")
    empty = asyncio.create_task(queue.wait_empty())
    for _ in range(2):
        key = await queue.get()
        await asyncio.sleep(0.01)
        assert not empty.done()
        if key == "a":
            queue.add("a")  # added again while being processed: not empty when it is done
        queue.done(key)
    await asyncio.sleep(0.01)
    assert not empty.done()
    queue.done(await queue.get())
    await asyncio.wait_for(empty, 1)
