"""The API server's 429 ("storage is (re)initializing", load shedding) is waited out, nothing else."""

from __future__ import annotations

import pytest
from passthrough.kube.client import ApiError

from passthrough.kube.retry import patiently


async def test_a_429_is_retried_after_the_servers_delay_and_other_errors_are_not():
    calls = []

    async def initializing():
        calls.append(1)
        if len(calls) < 3:
            exc = ApiError(429, "Too Many Requests")
            exc.headers = {"Retry-After": "0.1"}
            raise exc
        return "listed"

    assert await patiently(initializing) == "listed" and len(calls) == 3

    async def forbidden():
        calls.append(1)
        raise ApiError(403, "Forbidden")

    calls.clear()
    with pytest.raises(ApiError):
        await patiently(forbidden)
    assert len(calls) == 1
