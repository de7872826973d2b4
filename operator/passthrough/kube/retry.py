"""A call again while the API server answers 429 (Too Many Requests)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from passthrough.kube.client import ApiError

T = TypeVar("T")


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
