"""A call again while the API server answers 429 (Too Many Requests).

`Session.request` does this for every request it makes (every verb: a 429 is answered before
the request is acted on); `patiently` is the same for any other call, such as one of
kubernetes_asyncio's typed API that tests and tools use.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from passthrough.kube.client import TOO_MANY_REQUESTS_ATTEMPTS, ApiError, retry_after

T = TypeVar("T")


async def patiently(call: Callable[..., Awaitable[T]], *args: Any, attempts: int = TOO_MANY_REQUESTS_ATTEMPTS, **kwargs: Any) -> T:
    """`call`, again after the server's Retry-After while it answers 429.

    It does while a new kind's storage initializes ("storage is (re)initializing") and when
    priority-and-fairness sheds load; both pass within seconds.
    """
    for attempt in range(attempts):
        try:
            return await call(*args, **kwargs)
        except ApiError as exc:
            if exc.status != 429 or attempt == attempts - 1:
                raise
            await asyncio.sleep(retry_after(exc))
    raise AssertionError("unreachable")
