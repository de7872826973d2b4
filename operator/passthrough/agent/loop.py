"""The node agent's loop: scan the node's PCI devices and keep one NodePCIDevice per device current.

Scans run at start, every rescan interval, on SIGHUP, on kernel hotplug events, when an
admin (re)assigns one of the node's devices and when the node enters or leaves GPU
passthrough mode. Each scan diffs against a watched mirror of the node's NodePCIDevices and
applies only what changed. With a `Handover`, a scan also binds what the plan asks for to
vfio-pci, gives back what it no longer needs, and tells the device plugins what to serve.

The loop decides when to scan and puts a scan together; each job is a room of its own: the
Node (`ownnode`), the NodePCIDevices and Events (`reporter`), the moves (`moves`), the
kubelet's admission question (`admit`), the pod watch (`watches`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from passthrough.agent import metrics
from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.agent.admit import admit
from passthrough.agent.handover import Handover, Outcome
from passthrough.agent.moves import Moves
from passthrough.agent.ownnode import NodeChanges, OwnNode
from passthrough.agent.reporter import Reporter, ScanResult
from passthrough.agent.watches import PodEnds, keep_watching
from passthrough.api.names import NODE_PCI_DEVICE_PLURAL
from passthrough.kube.cache import jittered
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.connect import CannotStart
from passthrough.kube.preflight import require_crds
from passthrough.pci import overrides
from passthrough.pci.discovery import Discovery, discover
from passthrough.pci.naming import EXCLUSIVE_DOMAIN
from passthrough.pci.pciids import PciIds
from passthrough.pci.vfio import BindError

__all__ = ["CONNECTIONS", "START_JITTER", "Agent", "AgentError", "ScanResult", "retry_delay"]

log = logging.getLogger(__name__)


# Connections to the API server: at most its two watches, its writes and the rest (its Node,
# Events). Each is a TLS handshake on both sides at every agent's start, which a thousand nodes
# starting at once (a cluster's restart) pay together: two writes at once open two connections
# for the first scan, and the watches, started after it, take those (bench_fleet: 2 connections
# per agent, was 6 with four writes at once and the watches first; 32 ms of this process per
# agent, was 47). A first report of 8 GPUs is 16 writes, so two at once cost it little.
CONNECTIONS = 8
WRITES_AT_ONCE = 2
SCAN_TIMEOUT = 60.0  # seconds one scan may take, its API requests included
# A DaemonSet's agents start together (a cluster's restart, an upgrade's rollout): each waits
# up to this long, at random, before its first request, so the API server meets them spread out
# (`passthrough agent --start-jitter`; an Agent made in a test starts at once).
START_JITTER = 10.0
# A scan that failed (timed out, refused, a write that did not land) is tried again after
# RETRY_FIRST, doubling with each failure in a row up to RETRY_MAX, each wait between that and
# twice it at random: a thousand agents whose first scans time out together (an API server
# they overload at once) back off apart instead of coming back in step and feeding the lag.
RETRY_FIRST, RETRY_MAX = 2.5, 60.0


def retry_delay(failures: int) -> float:
    """Seconds before trying again after `failures` failed scans in a row (1 or more)."""
    return jittered(min(RETRY_FIRST * 2 ** (failures - 1), RETRY_MAX))


class AgentError(RuntimeError):
    """The agent cannot run at all; the message says what to do."""



class Agent:
    def __init__(
        self,
        api: Any,
        node_name: str,
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
        pci_ids: PciIds | None = None,
        rescan_interval: float = 300,
        concurrency: int = WRITES_AT_ONCE,
        handover: Handover | None = None,
        virtual_functions: bool = False,
        start_jitter: float = 0.0,
    ) -> None:
        if not node_name:
            raise AgentError("no node name: pass --node-name or set NODE_NAME (the agent reports the devices of one node)")
        self.api = api
        self.node_name = node_name
        self.sysfs_root, self.proc_root = Path(sysfs_root), Path(proc_root)
        self.pci_ids = pci_ids if pci_ids is not None else PciIds.load()
        self.rescan_interval = rescan_interval
        self.session = session_of(api)
        self.reporter = Reporter(api, node_name, concurrency)
        self.mirror = self.reporter.mirror
        self.node = OwnNode(self.session, node_name, self.reporter.log_once, self.reporter.forget)
        self._wake = asyncio.Event()
        self._resync = False  # list the objects again before the next scan (set after trouble)
        self._assignments: dict[str, str] = {}  # object name -> namespace it is handed out to
        self._claimed: frozenset[str] = frozenset()  # object names an admin assigned, handed out or not
        self.handover = handover
        self.moves = Moves(handover, node_name, rescan_interval, self.trigger, self._discover) if handover else None
        self.virtual_functions = virtual_functions  # SR-IOV VFs reported too (an admin's opt-in)
        self.start_jitter = start_jitter
        # DRA mode (no handover): the DRA driver's answer of which devices other servers have
        # (`OtherServers.elsewhere`), reported as the device-plugin mode's `others` are, and whom to
        # tell when the node changes what it publishes: its GPU passthrough mode, or its extended
        # resources (another device plugin came or went).
        self.other_servers: Callable[[], Mapping[str, BindError]] | None = None
        # DRA mode: the give-back request the DRA driver has carried out (`Driver.given_back`);
        # the agent answers a request on the Node only once the driver has.
        self.given_back_by: Callable[[], str] | None = None
        self.on_node_change: Callable[[], None] | None = None
        if handover is not None:
            handover.on_change = self.trigger  # a late write returned, or a served device's health flipped
            handover.admit = self.admit
        self.scans = 0
        self.writes = 0

    # -- control -------------------------------------------------------------------------

    def trigger(self, *_: Any) -> None:
        """Ask for a scan now (SIGHUP, hotplug)."""
        self._wake.set()

    async def preflight(self) -> None:
        try:
            await require_crds(self.api, NODE_PCI_DEVICE_PLURAL)
        except CannotStart as exc:
            raise AgentError(str(exc)) from None

    async def run(self) -> None:
        await asyncio.sleep(random.uniform(0, self.start_jitter))  # see START_JITTER
        await self.preflight()
        for problem in (self.pci_ids.problem, self.pci_ids.damage_report):
            if problem:
                log.warning("%s", problem)
        background = []
        if self.handover is not None:
            background.append(asyncio.create_task(self.handover.run(), name=f"plugins-{self.node_name}"))
            pods = PodEnds(self._asks_ours, self.trigger)
            background.append(asyncio.create_task(
                keep_watching(self.session, f"the pods of {self.node_name}", "/api/v1/pods", f"spec.nodeName={self.node_name}",
                              pods.seen), name=f"pods-{self.node_name}"))  # fmt: skip
        watching = False
        try:
            failures = 0
            while True:
                self._wake.clear()
                self.mirror.changed.clear()
                try:
                    # The API client sets no timeout: a request to a server that vanished
                    # silently would hold every later scan back.
                    async with asyncio.timeout(SCAN_TIMEOUT):
                        result = await self.scan()
                    if result.failed:
                        # Some writes failed (API unavailable, conflict): try again soon, not in 5 minutes.
                        failures += 1
                        self._resync = True
                        asyncio.get_running_loop().call_later(retry_delay(failures), self._wake.set)
                    else:
                        failures = 0
                except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    # aiohttp.ClientError: a server that accepted the connection and went away
                    # mid-request (ServerDisconnectedError) is no OSError, and no reason to stop.
                    failures += 1
                    delay = retry_delay(failures)
                    log.warning("scan failed (%s: %s); retrying in %.0fs", type(exc).__name__, exc, delay)
                    metrics.SCAN_FAILURES.inc()
                    # A write whose answer was lost may have landed: the next scan lists first.
                    self._resync = True
                    asyncio.get_running_loop().call_later(delay, self._wake.set)
                if not watching:
                    background += self._start_watches()
                    watching = True
                await self._wait_for_reason()
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.handover is not None:
                await self.handover.close()
            await self.reporter.events.drain()

    def _start_watches(self) -> list[asyncio.Task]:
        """The watches of the node's NodePCIDevices and of its Node, started once the first scan
        is done (or failed), not before it.

        Their connections are then the ones the scan opened and left idle: a TLS handshake fewer
        each, on both sides, at every agent's start. Nothing is missed meanwhile: the mirror's
        watch begins at the resourceVersion of the scan's own listing (the API server replays
        what came since), and the Node's is held against what the scan read of the Node.
        """
        node = NodeChanges(self.node, self._mode_changed, self._resources_changed)
        return [
            asyncio.create_task(self.mirror.run(), name=f"mirror-{self.node_name}"),
            asyncio.create_task(keep_watching(self.session, f"Node {self.node_name}", "/api/v1/nodes",
                                              f"metadata.name={self.node_name}", node.seen), name=f"node-{self.node_name}"),
        ]  # fmt: skip

    def _mode_changed(self) -> None:
        self.trigger()
        if self.on_node_change is not None:
            self.on_node_change()

    def _resources_changed(self) -> None:
        if self.handover is not None:
            self.trigger()  # one server per device: look at what the kubelet serves now
        if self.on_node_change is not None:
            self.on_node_change()

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

    def _asks_ours(self, pod: dict[str, Any]) -> bool:
        """Whether the pod asks for a resource we serve or served (any exclusive one), or holds a device of ours."""
        assert self.handover is not None
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        asked = {name for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
                 for kind in ("limits", "requests") for name in ((c.get("resources") or {}).get(kind) or {})}  # fmt: skip
        if any(name.startswith(f"{EXCLUSIVE_DOMAIN}/") for name in asked) or asked & set(self.handover.plugins.resources):
            return True
        pod_id = (meta.get("namespace"), meta.get("name"))
        return any((h.namespace, h.pod) == pod_id for held in (self._holders() or {}).values() for h in held)

    def _holders(self) -> dict[str, tuple] | None:
        return self.moves.holders if self.moves is not None else None

    def _relevant_change(self) -> bool:
        """Our own status writes come back through the watch too; only assignments, hand-outs and
        deletions matter."""
        return self._assignment_view() != (self._assignments, self._claimed)

    def _assignment_view(self) -> tuple[dict[str, str], frozenset[str]]:
        """Object name -> the namespace it is handed out to (only those), and the names an admin assigned."""
        if node_plan.giving_back(self.node.labels):
            return {}, frozenset()  # `helm uninstall` asks for the devices back: none is handed out here now
        return report.assignment_view(self.mirror.objects)

    async def admit(self, resource: str, device_ids: list[str]) -> str:
        """The kubelet's admission question for an exclusive device (`agent.admit`)."""
        return await admit(self.session, self.node_name, self._assignments, resource)

    # -- one scan ----------------------------------------------------------------------------

    async def scan(self) -> ScanResult:
        with metrics.SCAN_SECONDS.time():
            return await self._scan()

    async def _scan(self) -> ScanResult:
        self.scans += 1
        result = ScanResult()
        node = await self.node.read()
        if node is None:
            return result
        if not self.mirror.synced.is_set() or self._resync:  # outside run(), or after trouble: know what is there
            await self.mirror.relist()
            self._resync = False
        discovery: Discovery = await self._discover()
        for problem in discovery.problems:
            self.reporter.log_once(problem, "%s", problem)
        result.writes += await self.node.label(node, discovery)

        self._assignments, self._claimed = self._assignment_view()
        outcome = Outcome()
        if self.moves is not None:
            self.moves.holders = None
            discovery, outcome = await self.moves.carry_out(discovery, self._assignments, self._claimed, self.node.labels)
        elif self.other_servers is not None:
            outcome.others = dict(self.other_servers())
        holders = self._holders()
        names: dict[str, str] = {}  # address -> object name, of the devices found
        jobs = []
        for device in discovery.devices:
            if not device.reported:
                continue
            name = names[device.address] = report.object_name(device, self.node_name)
            held = holders.get(device.address, ()) if holders is not None else None
            jobs.append(self.reporter.present(name, device, node, result, outcome.problems().get(device.address), held))
        found = set(names.values())
        for name, live in list(self.mirror.objects.items()):
            if name not in found and not live["metadata"].get("deletionTimestamp"):
                jobs.append(self.reporter.missing(name, live, result))
        await asyncio.gather(*jobs)
        asked = node_plan.giving_back(self.node.labels)
        carried_out = self.handover is not None or (self.given_back_by is not None and self.given_back_by() == asked)
        if carried_out and asked != self.node.given_back and not result.failed:
            # Given back all it could, and each device that stays on vfio-pci says why in what was just written.
            self.node.given_back = asked
            result.writes += await self.node.label(node, discovery)
        self.reporter.tell(outcome, names)  # after the reports, so a device seen for the first time has its object
        result.devices = len(found)
        reported = [d for d in discovery.devices if d.reported]
        metrics.AGENT_DEVICES.labels("true").set(sum(1 for d in reported if d.eligible))
        metrics.AGENT_DEVICES.labels("false").set(sum(1 for d in reported if not d.eligible))
        metrics.AGENT_DEVICES_MISSING.set(result.missing)
        self.writes += result.writes
        if result.writes:
            log.info(
                "scan of %s: %d devices, %d missing, %d writes", self.node_name, result.devices, result.missing, result.writes
            )
        return result

    async def _discover(self) -> Discovery:
        locked = self.handover.locked() if self.handover is not None else frozenset()
        return await asyncio.to_thread(discover, self.sysfs_root, self.proc_root, self.pci_ids, locked,
                                       virtual_functions=self.virtual_functions, read_overrides=overrides.AGENT)  # fmt: skip
