"""A work queue of keys, each processed by at most one worker at a time (as in client-go).

Events for many kinds map to the same key (a device name); the queue folds them together,
so a burst of events for one device costs one reconcile, and two workers never race on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable


class WorkQueue:
    def __init__(self) -> None:
        self._queue: asyncio.Queue[Hashable] = asyncio.Queue()
        self._dirty: set[Hashable] = set()
        self._processing: set[Hashable] = set()
        self._timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def add(self, key: Hashable) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        self._empty.clear()
        if key not in self._processing:
            self._queue.put_nowait(key)

    def add_after(self, key: Hashable, delay: float) -> None:
        """Add `key` after `delay` seconds; an earlier pending time for the same key wins."""
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        timer = self._timers.get(key)
        if timer is not None and not timer.cancelled() and timer.when() <= when:
            return
        if timer is not None:
            timer.cancel()
        self._timers[key] = loop.call_at(when, self._fire, key)

    def _fire(self, key: Hashable) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> Hashable:
        key = await self._queue.get()
        self._dirty.discard(key)
        self._processing.add(key)
        return key

    def done(self, key: Hashable) -> None:
        self._processing.discard(key)
        if key in self._dirty:
            self._queue.put_nowait(key)
        elif not self._processing and not self._dirty:
            self._empty.set()

    async def wait_empty(self) -> None:
        """Until no key waits or is being processed (keys added later, by a timer, not counted)."""
        await self._empty.wait()

    def __len__(self) -> int:
        return len(self._dirty) + len(self._processing)

    # For metrics: keys waiting for a worker, being processed, and due later.
    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def in_progress(self) -> int:
        return len(self._processing)

    @property
    def delayed(self) -> int:
        return len(self._timers)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


async def run_workers(
    queue: WorkQueue,
    handle: Callable[[Hashable], Awaitable[None]],
    count: int,
    on_error: Callable[[Hashable, BaseException, int], float],
) -> None:
    """Run `count` workers until cancelled. A failed key is retried after `on_error`'s delay."""
    failures: dict[Hashable, int] = {}

    async def worker() -> None:
        while True:
            key = await queue.get()
            try:
                await handle(key)
                failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures[key] = failures.get(key, 0) + 1
                queue.add_after(key, on_error(key, exc, failures[key]))
            finally:
                queue.done(key)

    workers = [asyncio.create_task(worker(), name=f"worker-{i}") for i in range(count)]
    try:
        await asyncio.gather(*workers)
    finally:
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
