"""Prometheus plumbing shared by the operator and the agent: a registry per process, the
count of API writes by answer, and the HTTP endpoint that serves a registry.

Each side declares its own metrics and scrape-time collectors (`controller/metrics.py`,
`agent/metrics.py`) in its own registry, so an operator's endpoint shows no agent series
and the other way round; this module knows neither. Collectors read what the caches already
know at scrape time, so it costs nothing between scrapes; the endpoint runs on the
process's event loop, the one that changes those caches, so a scrape never reads them
half-changed. No label names a device: one series per device would grow with the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Info,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

from passthrough import __version__
from passthrough.kube.client import ApiError

# `_created` series double every counter and histogram and no dashboard here reads them.
disable_created_metrics()

# Seconds: a reconcile that waits for the watch to show its writes takes up to 10 s.
SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def registry(component: str) -> CollectorRegistry:
    """The registry of one process (`component`: operator or agent): the process figures
    (memory, CPU, open files), as the default registry would have them, and its build info."""
    made = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        made.register(collector)
    info = Info("passthrough_build", "The running passthrough version; component is operator or agent.", registry=made)
    info.info({"component": component, "version": __version__})
    return made


# -- API writes, counted where they are made ----------------------------------------------------


class _Answer:
    code = "2xx"

    def status(self, status: int) -> None:
        """The status a call returned rather than raised (`Custom.delete`'s 404 and 409)."""
        self.code = "2xx" if 200 <= status < 300 else str(status)


@contextlib.contextmanager
def write(counter: Counter, resource: str, verb: str) -> Iterator[_Answer]:
    """Count one write of `verb` to `resource` ("nodepcidevices/status"), by how it was answered."""
    answer = _Answer()
    try:
        yield answer
    except ApiError as exc:
        counter.labels(resource, verb, str(exc.status)).inc()
        raise
    except Exception:
        counter.labels(resource, verb, "none").inc()
        raise
    counter.labels(resource, verb, answer.code).inc()


# -- the endpoint ---------------------------------------------------------------------------------


def names(registry: CollectorRegistry) -> set[str]:
    """Every series name `registry` can export (`_total`, `_bucket`, ... included), samples or not."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum"),
                "info": ("_info",)}  # fmt: skip
    found = set()
    for family in registry.collect():
        found |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
        found |= {sample.name for sample in family.samples}
    return found


# The endpoint is plain HTTP/1.1 on the event loop, not aiohttp.web: aiohttp's server, router
# and file responses cost the agent 2 MiB (of a 50 MiB goal) to answer one GET. It reads a
# request's line and headers (at most 8 KiB) and answers; a client may ask again on the same
# connection, as Prometheus does.
_HEAD_LIMIT = 8192
_IDLE = 60.0
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
            405: "Method Not Allowed", 413: "Content Too Large", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}  # fmt: skip
_REFUSED = {401: "a bearer token the API server knows is needed: Authorization: Bearer <token>\n",
            403: "this token's user may not get /metrics (the chart's metrics-reader ClusterRole grants it)\n",
            503: "the API server could not be asked about this token; try again\n"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names in lower case
    keep_alive: bool


def parse_request(head: bytes) -> Request | str:
    """A request's line and headers (up to the blank line), or what is wrong with them."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return f"not an HTTP/1.x request line: {lines[0][:80]!r}"
    headers = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return f"not a header line: {line[:80]!r}"
        headers[name.lower()] = value.strip()
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in tokens if parts[2] == "HTTP/1.0" else "close" not in tokens
    return Request(parts[0], parts[1].partition("?")[0], headers, keep_alive)


async def _skip_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bool:
    """Read past a (small) request body; False for one this endpoint will not read."""
    if "transfer-encoding" in headers:
        return False
    length = headers.get("content-length", "0")
    if not length.isdigit() or int(length) > _HEAD_LIMIT:
        return False
    try:
        await reader.readexactly(int(length))
    except asyncio.IncompleteReadError:
        return False
    return True


def _response(status: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8", *, close: bool,
              head: bool = False, headers: dict[str, str] | None = None) -> bytes:  # fmt: skip
    body = body.encode() if isinstance(body, str) else body
    lines = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}",
             *(f"{name}: {value}" for name, value in (headers or {}).items())]  # fmt: skip
    if close:
        lines.append("Connection: close")
    return "\r\n".join([*lines, "", ""]).encode("latin-1") + (b"" if head else body)


class Endpoint:
    """The listening /metrics endpoint; `cleanup()` stops it and closes its connections.

    With `authorize` (kube/review.py MetricsReviewer: the request's bearer token, or None, to an
    HTTP status), the metrics go only to a request it answers 200 for."""

    def __init__(self, registry: CollectorRegistry, authorize: Callable[[str | None], Awaitable[int]] | None = None) -> None:
        self.registry = registry
        self.authorize = authorize
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.StreamWriter] = set()

    async def cleanup(self) -> None:
        if self.server is not None:
            self.server.close()
        for writer in list(self.connections):
            writer.close()
        if self.server is not None:
            await self.server.wait_closed()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the requests of one connection, one after the other, until the client closes
        it, asks to, goes quiet for a minute, or sends something this endpoint cannot read."""
        self.connections.add(writer)
        try:
            while True:
                try:
                    async with asyncio.timeout(_IDLE):
                        head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    writer.write(_response(431, "request header fields too large\n", close=True))
                    return
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return
                request = parse_request(head)
                if isinstance(request, str):
                    writer.write(_response(400, f"{request}\n", close=True))
                    return
                if not await _skip_body(reader, request.headers):
                    writer.write(_response(413, "a request body is not read here\n", close=True))
                    return
                writer.write(await self.respond(request))
                await writer.drain()
                if not request.keep_alive:
                    return
        except ConnectionError:
            return
        finally:
            self.connections.discard(writer)
            writer.close()

    async def respond(self, request: Request) -> bytes:
        close = not request.keep_alive
        if request.path != "/metrics":
            return _response(404, "not found: the metrics are at /metrics\n", close=close)
        if request.method not in ("GET", "HEAD"):
            return _response(405, "only GET and HEAD\n", close=close, headers={"Allow": "GET, HEAD"})
        if self.authorize is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            status = await self.authorize(token.strip() if scheme.lower() == "bearer" else None)
            if status != 200:
                challenge = {"WWW-Authenticate": 'Bearer realm="metrics"'} if status == 401 else {}
                return _response(status, _REFUSED.get(status, "refused\n"), close=close, headers=challenge)
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return _response(200, encoder(self.registry), content_type, close=close, head=request.method == "HEAD")


async def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0",
                authorize: Callable[[str | None], Awaitable[int]] | None = None) -> Endpoint | None:  # fmt: skip
    """Serve `registry` on http://addr:port/metrics until the endpoint is cleaned up (to whom
    `authorize` allows, if given); None with port 0. OSError when the port cannot be had."""
    if not port:
        return None
    endpoint = Endpoint(registry, authorize)
    endpoint.server = await asyncio.start_server(endpoint.connection, addr, port, limit=_HEAD_LIMIT)
    return endpoint
