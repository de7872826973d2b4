"""The node agent: scan the node's PCI devices and keep one NodePCIDevice per device current.

Scans run at start, every rescan interval, on SIGHUP, on kernel hotplug events, when an
admin (re)assigns one of the node's devices and when the node enters or leaves GPU
passthrough mode. Each scan diffs against a watched mirror of the node's NodePCIDevices and
applies only what changed. With a `Handover`, a scan also binds what the plan asks for to
vfio-pci, gives back what it no longer needs, and tells the device plugins what to serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from passthrough.agent import metrics
from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.agent.handover import WAITING, Handover, Outcome, held_elsewhere, other_plugin, served_elsewhere
from passthrough.api.names import NODE_PCI_DEVICE_PLURAL
from passthrough.api.labels import GIVEN_BACK_LABEL, NODE_LABEL
from passthrough.kube.cache import Mirror, jittered
from passthrough.kube.client import APPLY_PATCH as APPLY, ApiError, session_of
from passthrough.kube.connect import CannotStart
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.kube.events import EventRecorder
from passthrough.kube.preflight import require_crds
from passthrough.kube.watch import watch_events
from passthrough.pci import overrides, preflight
from passthrough.pci.discovery import Discovery, discover
from passthrough.pci.naming import EXCLUSIVE_DOMAIN
from passthrough.pci.pciids import PciIds
from passthrough.pci.vfio import BindError

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
HELD_RECHECK = 5.0  # seconds between asking the kubelet whether a device to give back is still held
# A pod's end, seen on the watch of the node's pods, is a scan then and these seconds after (the
# kubelet drops a pod from PodResources a moment after the API server does).
POD_END_RESCANS = (0.3, 1.0, 2.5)
# A DaemonSet's agents start together (a cluster's restart, an upgrade's rollout): each waits
# up to this long, at random, before its first request, so the API server meets them spread out
# (`passthrough agent --start-jitter`; an Agent made in a test starts at once).
START_JITTER = 10.0
# A scan that failed (timed out, refused, a write that did not land) is tried again after
# RETRY_FIRST, doubling with each failure in a row up to RETRY_MAX, each wait between that and
# twice it at random: a thousand agents whose first scans time out together (an API server
# they overload at once) back off apart instead of coming back in step and feeding the lag.
RETRY_FIRST, RETRY_MAX = 2.5, 60.0


def extended_resources(node: Mapping[str, Any]) -> dict[str, str]:
    """A Node's extended resources (the names with a domain) and their counts: a plugin's
    devices may reach the node's capacity a status update after its name does."""
    capacity = (node.get("status") or {}).get("capacity") or {}
    return {name: count for name, count in capacity.items() if "/" in name}


def retry_delay(failures: int) -> float:
    """Seconds before trying again after `failures` failed scans in a row (1 or more)."""
    return jittered(min(RETRY_FIRST * 2 ** (failures - 1), RETRY_MAX))


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
        self.devices = Custom(api, NODE_PCI_DEVICE_PLURAL)
        self.mirror = Mirror(self.devices, label_selector=f"{NODE_LABEL}={node_name}")
        self.session = session_of(api)
        self._wake = asyncio.Event()
        self._resync = False  # list the objects again before the next scan (set after trouble)
        self._attributes: dict[str, dict[str, Any]] = {}  # object name -> attributes last reported
        self._limit = asyncio.Semaphore(concurrency)
        self._logged: set[str] = set()
        self._assignments: dict[str, str] = {}  # object name -> namespace it is handed out to
        self._claimed: frozenset[str] = frozenset()  # object names an admin assigned, handed out or not
        self._holders: dict[str, tuple] | None = None  # address -> the pods holding it, this scan (None: unknown)
        self._node_labels: dict[str, str] = {}  # as the plan reads them (`plan.as_planned`)
        self._given_back = ""  # the give-back request this agent has answered on its Node
        self._node_resources: dict[str, str] | None = None  # the Node's extended resources, as a scan last read them
        self.handover = handover
        self.virtual_functions = virtual_functions  # SR-IOV VFs reported too (an admin's opt-in)
        self.start_jitter = start_jitter
        # DRA mode (no handover): the DRA driver's answer of which devices other servers have
        # (`Driver.elsewhere`), reported as the device-plugin mode's `others` are, and whom to
        # tell when the node changes what it publishes: its GPU passthrough mode, or its extended
        # resources (another device plugin came or went).
        self.other_servers: Callable[[], Mapping[str, BindError]] | None = None
        self.on_node_change: Callable[[], None] | None = None
        if handover is not None:
            handover.on_change = self.trigger  # a late write returned, or a served device's health flipped
            handover.admit = self.admit
        self.events = EventRecorder(api, "passthrough-agent")
        self._bind_failures: dict[str, str] = {}  # address -> message of the last failure reported
        self._retry = 0  # consecutive scans whose bind or give-back failed
        self._again: asyncio.TimerHandle | None = None  # the next scan that handover work asks for
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
            background.append(asyncio.create_task(self._watch_pods(), name=f"pods-{self.node_name}"))
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
            await self.events.drain()

    def _start_watches(self) -> list[asyncio.Task]:
        """The watches of the node's NodePCIDevices and of its Node, started once the first scan
        is done (or failed), not before it.

        Their connections are then the ones the scan opened and left idle: a TLS handshake fewer
        each, on both sides, at every agent's start. Nothing is missed meanwhile: the mirror's
        watch begins at the resourceVersion of the scan's own listing (the API server replays
        what came since), and the Node's is held against what the scan read of the Node.
        """
        return [
            asyncio.create_task(self.mirror.run(), name=f"mirror-{self.node_name}"),
            asyncio.create_task(self._watch_node(), name=f"node-{self.node_name}"),
        ]

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

    async def _watch_node(self) -> None:
        """Wake a scan when the node enters or leaves GPU passthrough mode (a label an admin sets),
        or its extended resources change (another device plugin registered, went or changed: one
        server per device, so the agent looks at what the kubelet now serves)."""
        # What the last scan read: a change between that read and this watch's start (its first
        # event) wakes a scan as one seen later does.
        served: dict[str, str] | None = self._node_resources

        def seen(kind: str, node: dict[str, Any]) -> None:
            nonlocal served
            labels = node_plan.as_planned((node.get("metadata") or {}).get("labels"))
            names = extended_resources(node)
            if node_plan.mode(labels) != node_plan.mode(self._node_labels):
                self._node_labels = labels
                self.trigger()
                if self.on_node_change is not None:
                    self.on_node_change()
            elif served is not None and names != served:
                if self.handover is not None:
                    self.trigger()
                if self.on_node_change is not None:
                    self.on_node_change()
            served = names

        await self._keep_watching(f"Node {self.node_name}", "/api/v1/nodes", f"metadata.name={self.node_name}", seen)

    async def _watch_pods(self) -> None:
        """Wake a scan when a pod of this node that asks for one of our resources starts running,
        ends or goes. The kubelet tells a device plugin nothing when a pod ends, and a device its
        pod held waits for that (to be given back, pooled, or served to its new namespace), as
        status.holders does to say who holds it; without this, the held recheck finds it."""
        states: dict[str, str] = {}  # pod uid -> its state last looked at
        loop = asyncio.get_running_loop()

        def seen(kind: str, pod: dict[str, Any]) -> None:
            uid = (pod.get("metadata") or {}).get("uid", "")
            state = "Gone" if kind == "DELETED" else (pod.get("status") or {}).get("phase", "")
            before = states.pop(uid, None) if kind == "DELETED" else states.get(uid)
            if kind != "DELETED":
                states[uid] = state
            if state == before or state not in ("Running", "Succeeded", "Failed", "Gone") or not self._asks_ours(pod):
                return
            self.trigger()
            for delay in POD_END_RESCANS if state != "Running" else ():
                loop.call_later(delay, self.trigger)

        await self._keep_watching(f"the pods of {self.node_name}", "/api/v1/pods", f"spec.nodeName={self.node_name}", seen)

    async def _keep_watching(self, what: str, path: str, selector: str, seen) -> None:
        """Calls `seen(type, object)` for each event of a watch of `path`, watching again (with
        backoff) when a watch ends."""
        backoff = 1.0
        while True:
            try:
                async for kind, obj in watch_events(self.session, path, fieldSelector=selector):
                    if kind != "BOOKMARK":
                        seen(kind, obj)
                backoff = 1.0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a dropped connection: the next watch starts over
                log.debug("watch of %s ended (%s); again in %.0fs", what, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)

    def _asks_ours(self, pod: dict[str, Any]) -> bool:
        """Whether the pod asks for a resource we serve or served (any exclusive one), or holds a device of ours."""
        assert self.handover is not None
        spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
        asked = {name for c in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
                 for kind in ("limits", "requests") for name in ((c.get("resources") or {}).get(kind) or {})}  # fmt: skip
        if any(name.startswith(f"{EXCLUSIVE_DOMAIN}/") for name in asked) or asked & set(self.handover.plugins.resources):
            return True
        pod_id = (meta.get("namespace"), meta.get("name"))
        return any((h.namespace, h.pod) == pod_id for held in (self._holders or {}).values() for h in held)

    def _relevant_change(self) -> bool:
        """Our own status writes come back through the watch too; only assignments, hand-outs and
        deletions matter."""
        return self._assignment_view() != (self._assignments, self._claimed)

    def _assignment_view(self) -> tuple[dict[str, str], frozenset[str]]:
        """Object name -> the namespace it is handed out to (only those), and the names an admin assigned."""
        if node_plan.giving_back(self._node_labels):
            return {}, frozenset()  # `helm uninstall` asks for the devices back: none is handed out here now
        return report.assignment_view(self.mirror.objects)

    # -- one scan ----------------------------------------------------------------------------

    async def scan(self) -> ScanResult:
        with metrics.SCAN_SECONDS.time():
            return await self._scan()

    async def _scan(self) -> ScanResult:
        self.scans += 1
        result = ScanResult()
        node = await self._node()
        if node is None:
            return result
        if not self.mirror.synced.is_set() or self._resync:  # outside run(), or after trouble: know what is there
            await self.mirror.relist()
            self._resync = False
        discovery: Discovery = await self._discover()
        for problem in discovery.problems:
            self._log_once(problem, "%s", problem)
        result.writes += await self._label_node(node, discovery)

        self._assignments, self._claimed = self._assignment_view()
        self._holders = None
        outcome = Outcome()
        if self.handover is not None:
            discovery, outcome = await self._hand_over(discovery)
        elif self.other_servers is not None:
            outcome.others = dict(self.other_servers())
        names: dict[str, str] = {}  # address -> object name, of the devices found
        jobs = []
        for device in discovery.devices:
            if not device.reported:
                continue
            name = names[device.address] = report.object_name(device, self.node_name)
            jobs.append(self._report_present(name, device, node, result, outcome.problems().get(device.address)))
        found = set(names.values())
        for name, live in list(self.mirror.objects.items()):
            if name not in found and not live["metadata"].get("deletionTimestamp"):
                jobs.append(self._report_missing(name, live, result))
        await asyncio.gather(*jobs)
        asked = node_plan.giving_back(self._node_labels)
        if self.handover is not None and asked != self._given_back and not result.failed:
            # Given back all it could, and each device that stays on vfio-pci says why in what was just written.
            self._given_back = asked
            result.writes += await self._label_node(node, discovery)
        self._tell(outcome, names)  # after the reports, so a device seen for the first time has its object
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

    async def _hand_over(self, discovery: Discovery) -> tuple[Discovery, Outcome]:
        """Bind and give back as the plan says, then serve what is bound; returns the scan after."""
        assert self.handover is not None
        names = {d.address: report.object_name(d, self.node_name) for d in discovery.devices if d.reported}
        in_gpu_mode = node_plan.gpu_mode(self._node_labels)
        serve_pools = self.handover.serve_pools
        view = await self.handover.look()
        self._holders = view.holders if view is not None else None  # reported in status.holders
        others = served_elsewhere(view, self.handover.plugins.resources)
        context = {"claimed": self._claimed, "holders": view.holders if view else None, "others": others}
        wanted = node_plan.plan(discovery.devices, self._assignments, names, in_gpu_mode, serve_pools,
                                ours=self.handover.bound, locked=self.handover.locked(), claimed=self._claimed,
                                others=others)  # fmt: skip
        if wanted.release:
            # Withdrawn from the kubelet, then the kubelet is asked again who holds it: a pod given
            # the device after the first answer is in this one, and no pod gets it from now on.
            # Released on the first answer, a pod admitted in between would lose it under its VM.
            await self.handover.serve(node_plan.resources(discovery.devices, self._assignments, names, in_gpu_mode,
                                                          serve_pools, self.handover.locked(), **context))  # fmt: skip
            view = await self.handover.look()
            self._holders = context["holders"] = view.holders if view is not None else None
        outcome = await self.handover.carry_out(wanted, view)
        if outcome.writes:
            # Drivers moved: report what the kernel says now, not what it said before.
            discovery = await self._discover()
        outcome.overrides = self.handover.override_problems(discovery.devices)
        outcome.unhealthy = dict(self.handover.unhealthy)
        outcome.others = {a: other_plugin(a, r) for a, r in others.items()}
        serving = node_plan.serving(discovery.devices, self._assignments, names, in_gpu_mode, serve_pools,
                                    outcome.failures, **context)  # fmt: skip
        for address, holders in serving.blocked.items():
            outcome.waiting[address] = held_elsewhere(address, holders)
        await self.handover.serve(serving.resources)
        if self._again is not None:
            self._again.cancel()
            self._again = None
        if outcome.failures or outcome.release_failures:
            # A refusing driver, vfio-pci not loaded: try again, backing off to the rescan interval.
            delay = min(5 * 2**self._retry, self.rescan_interval)
            self._retry += 1
            self._again = asyncio.get_running_loop().call_later(delay, self._wake.set)
        else:
            self._retry = 0
            if outcome.held or serving.blocked:
                # Given back once the pod that holds it is gone; the kubelet tells no one, so ask again.
                self._again = asyncio.get_running_loop().call_later(HELD_RECHECK, self._wake.set)
        return discovery, outcome

    async def admit(self, resource: str, device_ids: list[str]) -> str:
        """Whether the kubelet may hand an exclusive device to the pod it is admitting now: only to
        a pod of the namespace the device is handed out to. The kubelet does not say which pod
        asks; it admits a node's pods oldest first, so the one asking is the oldest pending pod
        here that requests the resource. A pod of the namespace the device left (pending since
        then) is refused, and the kubelet fails it. "" allows; a pool is any namespace's."""
        prefix = f"{EXCLUSIVE_DOMAIN}/"
        if not resource.startswith(prefix):
            return ""
        namespace = self._assignments.get(resource[len(prefix):], "")
        if not namespace:
            return f"{resource} is handed out to no namespace now, so no pod may have it"
        try:
            pods = await self.session.request("GET", "/api/v1/pods", query={
                "fieldSelector": f"spec.nodeName={self.node_name},status.phase=Pending"})  # fmt: skip
        except (ApiError, OSError, aiohttp.ClientError) as exc:
            return f"cannot tell which pod asks for {resource} ({exc}); refused rather than risk another namespace's pod"
        asking = sorted((p for p in pods.get("items", []) if report.requests(p, resource)),
                        key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))  # fmt: skip
        if not asking or asking[0]["metadata"]["namespace"] == namespace:
            return ""
        pod = asking[0]["metadata"]
        return (f"pod {pod['namespace']}/{pod['name']} asks for {resource}, which belongs to namespace {namespace} now: "
                f"a pod of {pod['namespace']} never gets it")  # fmt: skip

    async def _discover(self) -> Discovery:
        locked = self.handover.locked() if self.handover is not None else frozenset()
        return await asyncio.to_thread(discover, self.sysfs_root, self.proc_root, self.pci_ids, locked,
                                       virtual_functions=self.virtual_functions, read_overrides=overrides.AGENT)  # fmt: skip

    def _tell(self, outcome: Outcome, names: dict[str, str]) -> None:
        """Log and post an Event for every move and every new failure; repeats stay quiet."""
        for group, members in outcome.bound.items():
            log.info("bound IOMMU group %d (%s) to vfio-pci", group, ", ".join(members))
            for address in members:
                self._event(names.get(address), "Normal", "BoundToVfio",
                            f"{address} (IOMMU group {group}) is bound to vfio-pci, ready for a VM")
        for group, members in outcome.released.items():
            log.info("gave IOMMU group %d (%s) back to its drivers", group, ", ".join(members))
            for address in members:
                self._event(names.get(address), "Normal", "GivenBack",
                            f"{address} (IOMMU group {group}) left passthrough and is back with its default driver")
        problems = outcome.problems()
        for address, exc in problems.items():
            message = str(exc)
            if self._bind_failures.get(address) != message:
                self._bind_failures[address] = message
                log.warning("%s: %s", address, message)
                kind = "Normal" if exc.reason in WAITING else "Warning"
                self._event(names.get(address), kind, exc.reason, message)
        for address in list(self._bind_failures):
            if address not in problems:
                del self._bind_failures[address]

    def _event(self, name: str | None, type_: str, reason: str, message: str) -> None:
        live = self.mirror.objects.get(name or "")
        if live is None:
            return
        involved = {"api_version": live["apiVersion"], "kind": live["kind"], "name": name, "uid": live["metadata"]["uid"]}
        self.events.post(involved, type_, reason, message)

    async def _report_present(
        self, name: str, device, node: report.Node, result: ScanResult, failure: Exception | None = None
    ) -> None:
        live = self.mirror.objects.get(name)
        assigned = ((live or {}).get("spec") or {}).get("assignedNamespace", "")
        held = self._holders.get(device.address, ()) if self._holders is not None else None
        desired = report.present_status(device, name, self.node_name, assigned, failure, held)
        self._attributes[name] = desired["attributes"]  # for a NotFound write, should this status never land
        if not device.eligible:
            self._log_once(f"{name}:{device.reason}", "%s (%s) is not eligible: %s", device.address, name, device.reason)
        try:
            if live is None or not report.has_identity(live, node):
                live = await self._apply(report.identity(name, node), status=False)
                result.writes += 1
            if report.changed(desired, live):
                await self._apply(report.status_body(name, desired, live), status=True)
                result.writes += 1
        except ApiError as exc:
            result.failed.append(name)
            self._log_once(f"{name}:write:{exc.status}", "writing %s (%s) failed: %s %s %s", name, device.address,
                           exc.status, exc.reason, exc.message)

    async def _report_missing(self, name: str, live: dict[str, Any], result: ScanResult) -> None:
        result.missing += 1
        desired = report.missing_status(live, self.node_name, self._attributes.get(name))
        if desired is None:
            self._log_once(f"{name}:no-status", "%s is gone from %s before its first status was written; nothing is known "
                           "to report about it (it is not assigned to anyone yet, unless an admin did so meanwhile)",
                           name, self.node_name)  # fmt: skip
            return
        if not report.changed(desired, live):
            return
        try:
            await self._apply(report.status_body(name, desired, live), status=True)
            result.writes += 1
            log.info("%s (%s) is gone from %s", name, live.get("status", {}).get("attributes", {}).get("pciAddress"), self.node_name)
            self._event(name, "Warning", "NotFound", desired["conditions"][0]["message"])  # a surprise removal says so at once
        except ApiError as exc:
            if exc.status != 404:  # already deleted by the operator or the garbage collector
                result.failed.append(name)
                self._log_once(f"{name}:write:{exc.status}", "marking %s NotFound failed: %s %s %s", name, exc.status,
                               exc.reason, exc.message)

    async def _apply(self, body: dict[str, Any], status: bool) -> dict[str, Any]:
        async with self._limit:
            with metrics.write("nodepcidevices/status" if status else "nodepcidevices", "apply"):
                written = await self.devices.apply(body, AGENT_MANAGER, status=status)
        self.mirror.store(written)
        return written

    async def _node(self) -> report.Node | None:
        # Plain JSON, not the client's V1Node model: a real Node's status (its images, its
        # conditions) would cost more CPU to build than the request itself, at every scan.
        try:
            body = await self.session.request("GET", f"/api/v1/nodes/{self.node_name}")
        except ApiError as exc:
            if exc.status == 404:
                self._log_once("node-missing", "Node %s does not exist; not reporting until it does", self.node_name)
                return None
            raise
        self._logged.discard("node-missing")
        metadata = body["metadata"]
        self._node_labels = node_plan.as_planned(metadata.get("labels"))
        self._node_resources = extended_resources(body)
        return report.Node(name=self.node_name, uid=metadata["uid"])

    async def _label_node(self, node: report.Node, discovery: Discovery) -> int:
        labels = preflight.node_labels(discovery.node)  # what `passthrough discover --check` says, in labels
        answer = self._given_back if self._given_back == node_plan.giving_back(self._node_labels) else ""
        if answer:
            labels[GIVEN_BACK_LABEL] = answer
        stale = GIVEN_BACK_LABEL in self._node_labels and not answer  # an answer to a request withdrawn
        if all(self._node_labels.get(k) == v for k, v in labels.items()) and not stale:
            return 0
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": labels}}
        with metrics.write("nodes", "apply"):
            await self.session.request("PATCH", f"/api/v1/nodes/{node.name}", query={"fieldManager": AGENT_MANAGER, "force": True},
                                       body=body, content_type=APPLY)  # fmt: skip
        log.info("labelled Node %s %s", node.name, " ".join(f"{k}={v}" for k, v in labels.items()))
        return 1

    def _log_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args)
