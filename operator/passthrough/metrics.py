"""Prometheus metrics of the operator and the agent, and the HTTP endpoint that serves them.

Each process has its own registry (`OPERATOR`, `AGENT`), so an operator's endpoint shows no
agent series and the other way round. Counters and histograms are updated where things
happen; what the caches already know (devices by condition, assignments, the work queue,
the device plugins) is read at scrape time by a collector, so it costs nothing between
scrapes. The endpoint runs on the process's event loop, the one that changes those caches,
so a scrape never reads them half-changed. No label names a device: one series per device
would grow with the cluster.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aiohttp import web
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from passthrough.kubeapi import ApiError

# `_created` series double every counter and histogram and no dashboard here reads them.
disable_created_metrics()

OPERATOR = CollectorRegistry()
AGENT = CollectorRegistry()
for _registry in (OPERATOR, AGENT):
    # The process figures (memory, CPU, open files), as the default registry would have them.
    for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        _registry.register(_collector)

# Seconds: a reconcile that waits for the watch to show its writes takes up to 10 s.
_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def _version() -> str:
    try:
        return importlib.metadata.version("passthrough-operator")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _build_info(registry: CollectorRegistry, component: str) -> Info:
    info = Info("passthrough_build", "The running passthrough version; component is operator or agent.", registry=registry)
    info.info({"component": component, "version": _version()})
    return info


# -- operator ----------------------------------------------------------------------------------

_build_info(OPERATOR, "operator")
RECONCILE_SECONDS = Histogram(
    "passthrough_operator_reconcile_duration_seconds",
    "Time to decide and write one work-queue key, waiting for the watch to show the writes included; "
    "kind is device (one NodePCIDevice name) or kubevirt (the KubeVirt CR and the config's status).",
    ["kind"], buckets=_SECONDS, registry=OPERATOR,
)  # fmt: skip
RECONCILE_FAILURES = Counter(
    "passthrough_operator_reconcile_failures_total",
    "Reconciles that raised and were queued again with back-off.",
    ["kind"], registry=OPERATOR,
)  # fmt: skip
OPERATOR_WRITES = Counter(
    "passthrough_operator_api_writes_total",
    "Writes the operator sent to the API server (Events not counted), KubeVirt CR applies included "
    "(resource kubevirts); code is 2xx, the HTTP status of a refusal, or none when no answer came.",
    ["resource", "verb", "code"], registry=OPERATOR,
)  # fmt: skip
CONFIG_VALID = Gauge(
    "passthrough_operator_config_valid",
    "1 while the PassthroughConfig exists and its values are valid; 0 while KubeVirt keeps the last good "
    "configuration, or there is no config.",
    registry=OPERATOR,
)
ALLOWLIST_MISMATCHES = Gauge(
    "passthrough_operator_allowlist_mismatches",
    "KubeVirt allow-list against what nodes advertise: not_permitted are GPUs advertised but not allow-listed "
    "(VMs asking for them will not start), not_advertised are allow-listed names no node advertises, "
    "left_out are assigned devices whose own entry could not be written.",
    ["kind"], registry=OPERATOR,
)  # fmt: skip
ADMISSION_DECISIONS = Counter(
    "passthrough_operator_admission_decisions_total",
    "Answers of the validating webhooks to objects that use passthrough.io devices; decision is allowed, denied "
    "or unavailable (the operator was still starting).",
    ["kind", "decision"], registry=OPERATOR,
)  # fmt: skip

# -- agent -------------------------------------------------------------------------------------

_build_info(AGENT, "agent")
SCAN_SECONDS = Histogram(
    "passthrough_agent_scan_duration_seconds",
    "Time of one scan: sysfs discovery, vfio-pci binds and give-backs, and the writes of what changed.",
    buckets=_SECONDS, registry=AGENT,
)  # fmt: skip
SCAN_FAILURES = Counter(
    "passthrough_agent_scan_failures_total", "Scans that failed as a whole (API server unreachable, timeout).", registry=AGENT
)
AGENT_DEVICES = Gauge(
    "passthrough_agent_devices",
    "PCI devices the last scan reported, by eligibility for passthrough (true or false).",
    ["eligible"], registry=AGENT,
)  # fmt: skip
AGENT_DEVICES_MISSING = Gauge(
    "passthrough_agent_devices_missing",
    "NodePCIDevices of this node whose device the last scan did not find (Ready=False, NotFound).",
    registry=AGENT,
)
AGENT_WRITES = Counter(
    "passthrough_agent_api_writes_total",
    "Writes the agent sent to the API server (Events not counted); code as for the operator's.",
    ["resource", "verb", "code"], registry=AGENT,
)  # fmt: skip
BINDS = Counter(
    "passthrough_agent_vfio_binds_total", "IOMMU groups moved to vfio-pci.", registry=AGENT
)
BIND_FAILURES = Counter(
    "passthrough_agent_vfio_bind_failures_total",
    "Attempts to move an IOMMU group to vfio-pci that failed, by reason (VfioNotLoaded, UnbindRefused, ...).",
    ["reason"], registry=AGENT,
)  # fmt: skip
GIVE_BACKS = Counter(
    "passthrough_agent_vfio_give_backs_total", "IOMMU groups given back to their default drivers.", registry=AGENT
)
GIVE_BACK_FAILURES = Counter(
    "passthrough_agent_vfio_give_back_failures_total",
    "Attempts to give an IOMMU group back to its drivers that failed, by reason.",
    ["reason"], registry=AGENT,
)  # fmt: skip
ALLOCATIONS = Counter(
    "passthrough_agent_device_plugin_allocations_total",
    "Containers the kubelet asked devices for (Allocate), by resource kind (pool or exclusive) and result "
    "(ok or refused).",
    ["kind", "result"], registry=AGENT,
)  # fmt: skip
REGISTRATIONS = Counter(
    "passthrough_agent_device_plugin_registrations_total",
    "Successful registrations of a device plugin with the kubelet (again after every kubelet restart).",
    registry=AGENT,
)
REGISTRATION_FAILURES = Counter(
    "passthrough_agent_device_plugin_registration_failures_total",
    "Register calls the kubelet refused or did not answer.",
    registry=AGENT,
)



def allow_list(valid: bool, not_permitted: int = 0, not_advertised: int = 0, left_out: int = 0) -> None:
    """What the last KubeVirt sync found (all 0 without a config: nothing is checked then)."""
    CONFIG_VALID.set(1 if valid else 0)
    for kind, count in (("not_permitted", not_permitted), ("not_advertised", not_advertised), ("left_out", left_out)):
        ALLOWLIST_MISMATCHES.labels(kind).set(count)


EXCLUSIVE_DOMAIN = "passthrough.io/"  # the prefix of a namespace-assigned device's resource


def resource_kind(resource_name: str) -> str:
    """pool (a GPU model's shared name) or exclusive (one namespace-assigned device)."""
    return "exclusive" if resource_name.startswith(EXCLUSIVE_DOMAIN) else "pool"


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


# -- read at scrape time -------------------------------------------------------------------------


def _status(cond: Any) -> str:
    return cond.status if cond is not None else "Unknown"


class OperatorCollector(Collector):
    """Devices by node and condition, assignments by namespace and the work queue, from the
    reconciler's indexes. `reconciler()` is None until the operator has started one."""

    CONDITIONS = ("Ready", "Assigned", "Attached")

    def __init__(self) -> None:
        self.reconciler: Callable[[], Any] = lambda: None

    def describe(self) -> Iterable[Metric]:
        return self._families().values()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        return {
            "devices": GaugeMetricFamily(
                "passthrough_operator_devices",
                "NodePCIDevices by node and condition (Ready, Assigned, Attached) and its status "
                "(True, False, Unknown when not written yet).",
                labels=["node", "condition", "status"],
            ),
            "reasons": GaugeMetricFamily(
                "passthrough_operator_device_conditions",
                "NodePCIDevices by condition and reason, all nodes together (NotFound, VfioNotLoaded, NamespaceMissing, ...).",
                labels=["condition", "reason"],
            ),
            "assignments": GaugeMetricFamily(
                "passthrough_operator_assignments",
                "NodePCIDevices whose spec.assignedNamespace names the namespace.",
                labels=["namespace"],
            ),
            "depth": GaugeMetricFamily(
                "passthrough_operator_workqueue_depth", "Work-queue keys waiting for a worker."
            ),
            "in_progress": GaugeMetricFamily(
                "passthrough_operator_workqueue_in_progress", "Work-queue keys a worker is reconciling now."
            ),
            "delayed": GaugeMetricFamily(
                "passthrough_operator_workqueue_delayed",
                "Keys queued for later: retries after a failure, grace periods, KubeVirt syncs folded together.",
            ),
        }

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        reconciler = self.reconciler()
        if reconciler is not None:
            from passthrough.controller import reconciler as rec

            by_node: dict[tuple[str, str, str], int] = {}
            by_reason: dict[tuple[str, str], int] = {}
            for store in reconciler.indices[rec.NODE_DEVICES].values():
                for device in store[:1]:
                    for type_, cond in zip(self.CONDITIONS, (device.ready, device.assigned, device.attached)):
                        key = (device.node_name, type_, _status(cond))
                        by_node[key] = by_node.get(key, 0) + 1
                        if cond is not None and cond.reason:
                            by_reason[(type_, cond.reason)] = by_reason.get((type_, cond.reason), 0) + 1
            for key, count in sorted(by_node.items()):
                families["devices"].add_metric(key, count)
            for key, count in sorted(by_reason.items()):
                families["reasons"].add_metric(key, count)
            for namespace, members in sorted(reconciler.indices[rec.DEVICES_BY_NAMESPACE].items()):
                families["assignments"].add_metric([namespace], len(members))
            queue = reconciler.queue
            families["depth"].add_metric([], queue.waiting)
            families["in_progress"].add_metric([], queue.in_progress)
            families["delayed"].add_metric([], queue.delayed)
        return families.values()


class AgentCollector(Collector):
    """The device plugins of the node: registered or not, and the devices they serve."""

    def __init__(self) -> None:
        self.plugins: Callable[[], Any] = lambda: None  # the PluginManager, once there is one

    def describe(self) -> Iterable[Metric]:
        return self._families()

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "passthrough_agent_device_plugins",
                "Resources the agent serves to the kubelet, by kind (pool or exclusive) and state "
                "(registered with the current kubelet, or unregistered).",
                labels=["kind", "state"],
            ),
            GaugeMetricFamily(
                "passthrough_agent_device_plugin_devices",
                "Devices the device plugins advertise, by resource kind and health (Healthy or Unhealthy).",
                labels=["kind", "health"],
            ),
        ]

    def collect(self) -> Iterable[Metric]:
        plugins_family, devices_family = families = self._families()
        manager = self.plugins()
        if manager is not None:
            from passthrough.deviceplugin.server import HEALTHY, UNHEALTHY

            plugins = {(kind, state): 0 for kind in ("pool", "exclusive") for state in ("registered", "unregistered")}
            devices = {(kind, health): 0 for kind in ("pool", "exclusive") for health in (HEALTHY, UNHEALTHY)}
            for name, state in manager.registrations().items():
                kind = resource_kind(name)
                plugins[(kind, "registered" if state.registered else "unregistered")] += 1
                plugin = manager.plugin(name)
                for device in (plugin.devices.values() if plugin is not None else ()):
                    devices[(kind, HEALTHY if device.healthy else UNHEALTHY)] += 1
            for key, count in plugins.items():
                plugins_family.add_metric(key, count)
            for key, count in devices.items():
                devices_family.add_metric(key, count)
        return families


# What the caches hold, read at scrape time: the operator and the agent point these at them.
OPERATOR_STATE = OperatorCollector()
OPERATOR.register(OPERATOR_STATE)
AGENT_STATE = AgentCollector()
AGENT.register(AGENT_STATE)

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
