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

import contextlib
import importlib.metadata
from collections.abc import Iterator

from aiohttp import web
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

from passthrough.kube.client import ApiError

# `_created` series double every counter and histogram and no dashboard here reads them.
disable_created_metrics()

# Seconds: a reconcile that waits for the watch to show its writes takes up to 10 s.
SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _version() -> str:
    try:
        return importlib.metadata.version("passthrough-operator")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def registry(component: str) -> CollectorRegistry:
    """The registry of one process (`component`: operator or agent): the process figures
    (memory, CPU, open files), as the default registry would have them, and its build info."""
    made = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        made.register(collector)
    info = Info("passthrough_build", "The running passthrough version; component is operator or agent.", registry=made)
    info.info({"component": component, "version": _version()})
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


def application(registry: CollectorRegistry) -> web.Application:
    async def metrics(request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encoder(registry), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return app


async def serve(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> web.AppRunner | None:
    """Serve `registry` on http://addr:port/metrics until the runner is cleaned up; None with
    port 0. OSError when the port cannot be had."""
    if not port:
        return None
    runner = web.AppRunner(application(registry), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, addr, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
