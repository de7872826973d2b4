"""The node's NodePCIDevices as the agent writes them: one object and status per device found,
`NotFound` for one gone, and the Events and log lines that go with its moves and failures.

Writes are diffed against a watched mirror of the node's objects, so a scan that finds
nothing new writes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from passthrough.agent import metrics
from passthrough.agent import report
from passthrough.agent.handover import WAITING, Outcome
from passthrough.api.labels import NODE_LABEL
from passthrough.api.names import NODE_PCI_DEVICE_PLURAL
from passthrough.kube.cache import Mirror
from passthrough.kube.client import ApiError
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.kube.events import EventRecorder

log = logging.getLogger(__name__)


@dataclass
class ScanResult:
    writes: int = 0
    devices: int = 0
    missing: int = 0
    failed: list[str] = field(default_factory=list)


class Reporter:
    """Writes what one scan found about each device, and says what moved or failed."""

    def __init__(self, api: Any, node_name: str, concurrency: int) -> None:
        self.node_name = node_name
        self.devices = Custom(api, NODE_PCI_DEVICE_PLURAL)
        self.mirror = Mirror(self.devices, label_selector=f"{NODE_LABEL}={node_name}")
        self.events = EventRecorder(api, "passthrough-agent")
        self._attributes: dict[str, dict[str, Any]] = {}  # object name -> attributes last reported
        self._limit = asyncio.Semaphore(concurrency)
        self._logged: set[str] = set()
        self._bind_failures: dict[str, str] = {}  # address -> message of the last failure reported

    async def present(
        self, name: str, device, node: report.Node, result: ScanResult, failure: Exception | None, held: tuple | None
    ) -> None:
        live = self.mirror.objects.get(name)
        assigned = ((live or {}).get("spec") or {}).get("assignedNamespace", "")
        desired = report.present_status(device, name, self.node_name, assigned, failure, held)
        self._attributes[name] = desired["attributes"]  # for a NotFound write, should this status never land
        if not device.eligible:
            self.log_once(f"{name}:{device.reason}", "%s (%s) is not eligible: %s", device.address, name, device.reason)
        try:
            if live is None or not report.has_identity(live, node):
                live = await self._apply(report.identity(name, node), status=False)
                result.writes += 1
            if report.changed(desired, live):
                await self._apply(report.status_body(name, desired, live), status=True)
                result.writes += 1
        except ApiError as exc:
            result.failed.append(name)
            self.log_once(f"{name}:write:{exc.status}", "writing %s (%s) failed: %s %s %s", name, device.address,
                          exc.status, exc.reason, exc.message)

    async def missing(self, name: str, live: dict[str, Any], result: ScanResult) -> None:
        result.missing += 1
        desired = report.missing_status(live, self.node_name, self._attributes.get(name))
        if desired is None:
            self.log_once(f"{name}:no-status", "%s is gone from %s before its first status was written; nothing is known "
                          "to report about it (it is not assigned to anyone yet, unless an admin did so meanwhile)",
                          name, self.node_name)  # fmt: skip
            return
        if not report.changed(desired, live):
            return
        try:
            await self._apply(report.status_body(name, desired, live), status=True)
            result.writes += 1
            log.info("%s (%s) is gone from %s", name, live.get("status", {}).get("attributes", {}).get("pciAddress"), self.node_name)
            self.event(name, "Warning", "NotFound", desired["conditions"][0]["message"])  # a surprise removal says so at once
        except ApiError as exc:
            if exc.status != 404:  # already deleted by the operator or the garbage collector
                result.failed.append(name)
                self.log_once(f"{name}:write:{exc.status}", "marking %s NotFound failed: %s %s %s", name, exc.status,
                              exc.reason, exc.message)

    async def _apply(self, body: dict[str, Any], status: bool) -> dict[str, Any]:
        async with self._limit:
            with metrics.write("nodepcidevices/status" if status else "nodepcidevices", "apply"):
                written = await self.devices.apply(body, AGENT_MANAGER, status=status)
        self.mirror.store(written)
        return written

    def tell(self, outcome: Outcome, names: dict[str, str]) -> None:
        """Log and post an Event for every move and every new failure; repeats stay quiet."""
        for group, members in outcome.bound.items():
            log.info("bound IOMMU group %d (%s) to vfio-pci", group, ", ".join(members))
            for address in members:
                self.event(names.get(address), "Normal", "BoundToVfio",
                           f"{address} (IOMMU group {group}) is bound to vfio-pci, ready for a VM")
        for group, members in outcome.released.items():
            log.info("gave IOMMU group %d (%s) back to its drivers", group, ", ".join(members))
            for address in members:
                self.event(names.get(address), "Normal", "GivenBack",
                           f"{address} (IOMMU group {group}) left passthrough and is back with its default driver")
        problems = outcome.problems()
        for address, exc in problems.items():
            message = str(exc)
            if self._bind_failures.get(address) != message:
                self._bind_failures[address] = message
                log.warning("%s: %s", address, message)
                kind = "Normal" if exc.reason in WAITING else "Warning"
                self.event(names.get(address), kind, exc.reason, message)
        for address in list(self._bind_failures):
            if address not in problems:
                del self._bind_failures[address]

    def event(self, name: str | None, type_: str, reason: str, message: str) -> None:
        live = self.mirror.objects.get(name or "")
        if live is None:
            return
        involved = {"api_version": live["apiVersion"], "kind": live["kind"], "name": name, "uid": live["metadata"]["uid"]}
        self.events.post(involved, type_, reason, message)

    def log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)

    def forget(self, key: str) -> None:
        """Let `key`'s message be logged again the next time it is true."""
        self._logged.discard(key)
