"""A gRPC server on a Unix socket, as the kubelet dials its plugins (device plugins, DRA drivers
and their registration)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc


async def serve(path: Path, servicer: Any, adds: Iterable[Callable[[Any, grpc.aio.Server], None]]) -> grpc.aio.Server:
    """A started server of `servicer`'s services (`adds`) on `path`, replacing a stale socket file
    of that name; OSError saying which socket when it cannot listen."""
    path.unlink(missing_ok=True)
    server = grpc.aio.server()
    for add in adds:
        add(servicer, server)
    try:
        server.add_insecure_port(f"unix://{path}")
        await server.start()
    except Exception as exc:
        await server.stop(None)
        raise OSError(f"cannot serve on {path}: {exc}") from exc
    return server
