"""The reader of watch streams: (type, object) of each event, read as plain JSON lines."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from passthrough.kube.client import session_of


def watch_events(api: Any, path: str, timeoutSeconds: int = 300, **query: Any) -> AsyncIterator[tuple[str, dict[str, Any]]]:  # noqa: N803
    """(type, object) of each event of a watch of `path` (a list's path), read as plain JSON
    lines; an ERROR event raises ApiError with its code."""
    connect, read = watch_request_timeout(timeoutSeconds)
    return session_of(api).watch(path, {**query, "timeoutSeconds": timeoutSeconds}, connect=connect, read=read)


def watch_request_timeout(server_timeout: int) -> tuple[float, float]:
    """(connect, read) seconds for a watch's request: a connection that never opens, or a server
    gone silent, ends the watch (to be started again) instead of holding it for ever."""
    return (10.0, server_timeout + 30.0)
