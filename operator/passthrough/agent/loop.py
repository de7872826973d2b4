"""The node agent: scan the node's PCI devices and keep one NodePCIDevice per device current.

Scans run at start, every rescan interval, on SIGHUP, on kernel hotplug events and when an
admin (re)assigns one of the node's devices. Each scan diffs against a watched mirror of the
node's NodePCIDevices and applies only what changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from passthrough.agent import report
from passthrough.api.models import NODE_PCI_DEVICE
from passthrough.k8s import AGENT_MANAGER, APPLY, NODE_LABEL, VFIO_LABEL, Custom, Mirror, CannotStart, require_crds
from passthrough.pci.discovery import Discovery, discover
from passthrough.pci.pciids import PciIds

log = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent cannot run at all; the message says what to do."""


@dataclass
class ScanResult:
    writes: int = 0
    devices: int = 0
    missing: int = 0
    failed: list[str] = field(default_factory=list)


class Agent:
    def __init__(
        self,
        api: client.ApiClient,
        node_name: str,
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
        pci_ids: PciIds | None = None,
        rescan_interval: float = 300,
        concurrency: int = 8,
    ) -> None:
        if not node_name:
            raise AgentError("no node name: pass --node-name or set NODE_NAME (the agent reports the devices of one node)")
        self.api = api
        self.node_name = node_name
        self.sysfs_root, self.proc_root = Path(sysfs_root), Path(proc_root)
        self.pci_ids = pci_ids if pci_ids is not None else PciIds.load()
        self.rescan_interval = rescan_interval
        self.devices = Custom(api, NODE_PCI_DEVICE.plural)
        self.mirror = Mirror(self.devices, label_selector=f"{NODE_LABEL}={node_name}")
        self.core = client.CoreV1Api(api)
        self._wake = asyncio.Event()
        self._limit = asyncio.Semaphore(concurrency)
        self._logged: set[str] = set()
        self._assignments: dict[str, str] = {}
        self._node_labels: dict[str, str] = {}
        self.scans = 0
        self.writes = 0

    # -- control -------------------------------------------------------------------------

    def trigger(self, *_: Any) -> None:
        """Ask for a scan now (SIGHUP, hotplug)."""
        self._wake.set()

    async def preflight(self) -> None:
        try:
            await require_crds(self.api, NODE_PCI_DEVICE.plural)
        except CannotStart as exc:
            raise AgentError(str(exc)) from None

    async def run(self) -> None:
        await self.preflight()
        if self.pci_ids.problem:
            log.warning("%s", self.pci_ids.problem)
        mirror = asyncio.create_task(self.mirror.run(), name=f"mirror-{self.node_name}")
        try:
            await self.mirror.synced.wait()
            while True:
                self._wake.clear()
                self.mirror.changed.clear()
                try:
                    result = await self.scan()
                    if result.failed:
                        # Some writes failed (API unavailable, conflict): try again soon, not in 5 minutes.
                        asyncio.get_running_loop().call_later(5, self._wake.set)
                except (ApiException, OSError, TimeoutError) as exc:
                    log.warning("scan failed (%s); retrying in 5s", exc)
                    asyncio.get_running_loop().call_later(5, self._wake.set)
                await self._wait_for_reason()
        finally:
            mirror.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await mirror

    async def _wait_for_reason(self) -> None:
        """Sleep until the interval passes, someone triggers, or an assignment changes."""
        deadline = asyncio.get_running_loop().time() + self.rescan_interval
        while True:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0 or self._wake.is_set():
                return
            woke = asyncio.create_task(self._wake.wait())
            changed = asyncio.create_task(self.mirror.changed.wait())
            done, pending = await asyncio.wait({woke, changed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if changed in done:
                self.mirror.changed.clear()
                if self._relevant_change():
                    return

    def _relevant_change(self) -> bool:
        """Our own status writes come back through the watch too; only assignments and deletions matter."""
        current = {name: (obj.get("spec") or {}).get("assignedNamespace", "") for name, obj in self.mirror.objects.items()}
        return current != self._assignments

    # -- one scan ----------------------------------------------------------------------------

    async def scan(self) -> ScanResult:
        self.scans += 1
        result = ScanResult()
        node = await self._node()
        if node is None:
            return result
        if not self.mirror.synced.is_set():  # a scan outside run(): know what is there first
            await self.mirror.relist()
        discovery: Discovery = await asyncio.to_thread(discover, self.sysfs_root, self.proc_root, self.pci_ids)
        for problem in discovery.problems:
            self._log_once(problem, "%s", problem)
        result.writes += await self._label_node(node, discovery)

        self._assignments = {
            name: (obj.get("spec") or {}).get("assignedNamespace", "") for name, obj in self.mirror.objects.items()
        }
        found: set[str] = set()
        jobs = []
        for device in discovery.devices:
            if not device.reported:
                continue
            name = report.object_name(device, self.node_name)
            found.add(name)
            jobs.append(self._report_present(name, device, node, result))
        for name, live in list(self.mirror.objects.items()):
            if name not in found and not live["metadata"].get("deletionTimestamp"):
                jobs.append(self._report_missing(name, live, result))
        await asyncio.gather(*jobs)
        result.devices = len(found)
        self.writes += result.writes
        if result.writes:
            log.info(
                "scan of %s: %d devices, %d missing, %d writes", self.node_name, result.devices, result.missing, result.writes
            )
        return result

    async def _report_present(self, name: str, device, node: report.Node, result: ScanResult) -> None:
        live = self.mirror.objects.get(name)
        assigned = ((live or {}).get("spec") or {}).get("assignedNamespace", "")
        desired = report.present_status(device, name, self.node_name, assigned)
        if not device.eligible:
            self._log_once(f"{name}:{device.reason}", "%s (%s) is not eligible: %s", device.address, name, device.reason)
        try:
            if live is None or not report.has_identity(live, node):
                live = await self._apply(report.identity(name, node), status=False)
                result.writes += 1
            if report.changed(desired, live):
                await self._apply(report.status_body(name, desired, live), status=True)
                result.writes += 1
        except ApiException as exc:
            result.failed.append(name)
            self._log_once(f"{name}:write:{exc.status}", "writing %s (%s) failed: %s %s", name, device.address, exc.status, exc.reason)

    async def _report_missing(self, name: str, live: dict[str, Any], result: ScanResult) -> None:
        result.missing += 1
        desired = report.missing_status(live, self.node_name)
        if not report.changed(desired, live):
            return
        try:
            await self._apply(report.status_body(name, desired, live), status=True)
            result.writes += 1
            log.info("%s (%s) is gone from %s", name, live.get("status", {}).get("attributes", {}).get("pciAddress"), self.node_name)
        except ApiException as exc:
            if exc.status != 404:  # already deleted by the operator or the garbage collector
                result.failed.append(name)
                self._log_once(f"{name}:write:{exc.status}", "marking %s NotFound failed: %s %s", name, exc.status, exc.reason)

    async def _apply(self, body: dict[str, Any], status: bool) -> dict[str, Any]:
        async with self._limit:
            written = await self.devices.apply(body, AGENT_MANAGER, status=status)
        self.mirror.store(written)
        return written

    async def _node(self) -> report.Node | None:
        try:
            node = await self.core.read_node(self.node_name)
        except ApiException as exc:
            if exc.status == 404:
                self._log_once("node-missing", "Node %s does not exist; not reporting until it does", self.node_name)
                return None
            raise
        self._logged.discard("node-missing")
        self._node_labels = node.metadata.labels or {}
        return report.Node(name=self.node_name, uid=node.metadata.uid)

    async def _label_node(self, node: report.Node, discovery: Discovery) -> int:
        value = "true" if discovery.node.iommu_enabled and discovery.node.vfio_available else "false"
        if self._node_labels.get(VFIO_LABEL) == value:
            return 0
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": {VFIO_LABEL: value}}}
        await self.core.patch_node(node.name, body, field_manager=AGENT_MANAGER, force=True, _content_type=APPLY)
        log.info("labelled Node %s %s=%s", node.name, VFIO_LABEL, value)
        return 1

    def _log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)
