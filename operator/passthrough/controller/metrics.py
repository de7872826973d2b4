"""The operator's metrics, in its own registry: counted where things happen, and what the
reconciler's indexes and work queue hold, read at scrape time."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from passthrough import metrics
from passthrough.metrics import SECONDS, registry

OPERATOR = registry("operator")

RECONCILE_SECONDS = Histogram(
    "passthrough_operator_reconcile_duration_seconds",
    "Time to decide and write one work-queue key, waiting for the watch to show the writes included; "
    "kind is device (one NodePCIDevice name), kubevirt (the KubeVirt CR and the config's status) or deviceclasses (DRA mode).",
    ["kind"], buckets=SECONDS, registry=OPERATOR,
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


# Counts one write of the operator's, by how it was answered: `with write("pcidevices", "delete"):`.
write = functools.partial(metrics.write, OPERATOR_WRITES)


def allow_list(valid: bool, not_permitted: int = 0, not_advertised: int = 0, left_out: int = 0) -> None:
    """What the last KubeVirt sync found (all 0 without a config: nothing is checked then)."""
    CONFIG_VALID.set(1 if valid else 0)
    for kind, count in (("not_permitted", not_permitted), ("not_advertised", not_advertised), ("left_out", left_out)):
        ALLOWLIST_MISMATCHES.labels(kind).set(count)


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
            by_node: dict[tuple[str, str, str], int] = {}
            by_reason: dict[tuple[str, str], int] = {}
            for device in reconciler.node_devices_known():
                for type_, cond in zip(self.CONDITIONS, (device.ready, device.assigned, device.attached)):
                    key = (device.node_name, type_, _status(cond))
                    by_node[key] = by_node.get(key, 0) + 1
                    if cond is not None and cond.reason:
                        by_reason[(type_, cond.reason)] = by_reason.get((type_, cond.reason), 0) + 1
            for key, count in sorted(by_node.items()):
                families["devices"].add_metric(key, count)
            for key, count in sorted(by_reason.items()):
                families["reasons"].add_metric(key, count)
            for namespace, members in sorted(reconciler.assignments().items()):
                families["assignments"].add_metric([namespace], len(members))
            queue = reconciler.queue
            families["depth"].add_metric([], queue.waiting)
            families["in_progress"].add_metric([], queue.in_progress)
            families["delayed"].add_metric([], queue.delayed)
        return families.values()


# The operator points it at its reconciler once it has one.
OPERATOR_STATE = OperatorCollector()
OPERATOR.register(OPERATOR_STATE)
