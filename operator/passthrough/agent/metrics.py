"""The agent's metrics, in its own registry: scans, vfio-pci moves and the device plugins,
counted where they happen, and the device plugins' state, read at scrape time."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from passthrough import metrics
from passthrough.metrics import SECONDS, registry
from passthrough.pci.naming import EXCLUSIVE_DOMAIN

AGENT = registry("agent")

SCAN_SECONDS = Histogram(
    "passthrough_agent_scan_duration_seconds",
    "Time of one scan: sysfs discovery, vfio-pci binds and give-backs, and the writes of what changed.",
    buckets=SECONDS, registry=AGENT,
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


# Counts one write of the agent's, by how it was answered: `with write("pcidevices", "delete"):`.
write = functools.partial(metrics.write, AGENT_WRITES)


def resource_kind(resource_name: str) -> str:
    """pool (a GPU model's shared name) or exclusive (one namespace-assigned device)."""
    return "exclusive" if resource_name.startswith(f"{EXCLUSIVE_DOMAIN}/") else "pool"


# -- read at scrape time -------------------------------------------------------------------------


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
            plugins = {(kind, state): 0 for kind in ("pool", "exclusive") for state in ("registered", "unregistered")}
            devices = {(kind, health): 0 for kind in ("pool", "exclusive") for health in ("Healthy", "Unhealthy")}
            for name, state in manager.registrations().items():
                kind = resource_kind(name)
                plugins[(kind, "registered" if state.registered else "unregistered")] += 1
                plugin = manager.plugin(name)
                for device in (plugin.devices.values() if plugin is not None else ()):
                    devices[(kind, "Healthy" if device.healthy else "Unhealthy")] += 1
            for key, count in plugins.items():
                plugins_family.add_metric(key, count)
            for key, count in devices.items():
                devices_family.add_metric(key, count)
        return families


# The agent points it at its device plugins, when it serves any.
AGENT_STATE = AgentCollector()
AGENT.register(AGENT_STATE)
