"""The agent's DRA driver: a kubelet plugin that publishes the node's devices as a ResourceSlice
and, when the kubelet prepares a claim, binds the allocated device's IOMMU group to vfio-pci and
hands the container its /dev/vfio nodes and the KEP-5304 metadata file through CDI.

- Registration (`dra.registration`): a socket in `<kubelet dir>/plugins_registry/`, which the
  kubelet's plugin watcher finds and asks GetInfo (type DRAPlugin, our driver name, the
  endpoint, the gRPC services we serve: `v1.DRAPlugin`, `v1.DRAResourceHealth`); it survives
  kubelet restarts, which find it again.
- The DRAPlugin and DRAResourceHealth services on `<kubelet dir>/plugins/<driver>/dra.sock`. The
  kubelet opens the health stream because registration lists it; it shows what we send on the
  pods that hold a device (`status.containerStatuses[].allocatedResourcesStatus`).
- A pass (at start, every rescan interval, when an assignment or our slice changes, on trigger):
  discovery (`pci.discovery`, as the agent's scan), the hand-outs from the node's NodePCIDevices
  (`agent.report.handed_out`), the slice (`dra.slice`) written only when it differs; then the
  groups this driver bound that no published device and no prepared claim needs go back to their
  drivers.
- Health (`dra.healthwatch`): every 0.5 s, the hardware of each device offered, withdrawn or
  held by a prepared claim, read in threads (never in the event loop: a reset holds config
  access). An ill one is tainted in the slice, NoSchedule (no new claim gets it) or NoExecute
  when it fell off the bus (kube-controller-manager evicts the pods of the claims that hold it),
  and is reported Unhealthy, with why, to the kubelet (the pods that hold it show it);
  untainted and Healthy when it recovers (`dra.health`). One gone from the bus leaves the slice.
- Binding conditions (`dra.binding`): each device in the slice carries `VFIOBound` (and the
  failure condition `VFIOBindFailed`), so the scheduler binds a pod allocated it only once the
  driver has moved the whole IOMMU group to vfio-pci and said so in the claim's status.devices;
  the driver watches the claims and does it as soon as the allocation is written, before the
  pod reaches the node. A group that would not move answers VFIOBindFailed (the scheduler takes
  the allocation back and tries again) and the device is tainted VFIOBindFailed:NoSchedule for
  BIND_FAILED_HOLD seconds, so that try goes elsewhere.
- Prepare: the same binder child as the device plugins (`pci.binder.Binder`), a no-op for a group
  its binding condition already moved; what it moved is recorded (`agent.bound.Bound`, in the
  plugin directory) so only that is ever given back: each bind as intended before the job, and
  settled from the driver links at the next pass, so a bind whose answer was lost (a restart
  while the write was blocked) is given back all the same, as in device-plugin mode.
  Prepared claims are kept in `checkpoint.json` there (`dra.prepared`, with the files they
  leave): a repeated prepare (kubelet retry or restart) answers the same, an unprepare after
  our own restart finds its files.
- The node's guarantee, kept here too: a device handed out to namespace X is prepared only for a
  claim of X, whatever the scheduler allocated (the webhook and per-namespace DeviceClasses are
  the first gates; this is the last); never with adminAccess; and never for a second claim while
  one holds it or another member of its IOMMU group (an allocation the scheduler wrote twice, or
  a claim freed by a force-deleted pod before the kubelet unprepared it: the kubelet retries,
  and the second claim is prepared once the first is unprepared).
- One device, one server (`dra.elsewhere`, judged by `dra.others`): each pass asks the
  kubelet's PodResources which devices device plugins serve (in DRA mode none of theirs is
  ours) and reads the other DRA drivers' slices of this node (a watch); such a device and its IOMMU group leave the slice, are never
  prepared or bound, and the agent's report says ServedByOtherPlugin (`elsewhere`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import operator
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.agent.bound import Bound
from passthrough.api.labels import NODE_LABEL
from passthrough.api.names import NODE_PCI_DEVICE_PLURAL
from passthrough.dra import binding as dra_binding
from passthrough.dra import cdi
from passthrough.dra import health as dra_health
from passthrough.dra.healthwatch import HEALTH_POLL, HealthWatch, first as _first
from passthrough.dra import slice as dra_slice
from passthrough.dra.elsewhere import OtherServers
from passthrough.dra.registration import Registration, serve_on
from passthrough.dra.prepared import PreparedClaim, holder, load_checkpoint, remove_files, save_checkpoint, write_files
from passthrough.dra.kubeletapi.dra_v1 import api_pb2 as dra
from passthrough.dra.kubeletapi.dra_v1 import api_pb2_grpc as dra_grpc
from passthrough.dra.kubeletapi.drahealth_v1 import api_pb2_grpc as health_grpc
from passthrough.dra.kubeletapi.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from passthrough.kube.cache import Informer, Mirror
from passthrough.kube.client import APPLY_PATCH, ApiError, session_of
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.pci.binder import DEADLINE, Binder
from passthrough.pci.discovery import BRIDGE_CLASS, Discovery, discover
from passthrough.pci.health import Health
from passthrough.pci.pciids import PciIds
from passthrough.pci import overrides, vfio
from passthrough.pci.vfio import BindError

log = logging.getLogger(__name__)

DRIVER = dra_slice.DRIVER
KUBELET_DIR = Path("/var/lib/kubelet")
CDI_DIR = Path("/var/run/cdi")
# "<gRPC package's last part>.<service>", as the kubelet matches them; it streams health only
# from a plugin that lists the health service here.
SERVICES = ("v1.DRAPlugin", dra_health.SERVICE)
RETRY = 5.0  # seconds before the next pass after a failed one
# Seconds the first pass waits for the kubelet to register the driver: a claim allocated from a
# slice published before that fails its first prepare ("not registered") and waits for the
# kubelet's retry (12 s in bench_dra's run). A node whose kubelet never registers it still gets
# its slice after this.
REGISTRATION_WAIT = 10.0
PASS_LOGGED = "DRA pass"  # what the debug log says of each pass (bench_dra counts them)
# Seconds a device whose group would not go to vfio-pci stays tainted VFIOBindFailed:NoSchedule:
# long enough for the scheduler's next try to take another device, then it is offered again.
BIND_FAILED_HOLD = 300.0


class Driver(dra_grpc.DRAPluginServicer, health_grpc.DRAResourceHealthServicer):
    def __init__(
        self,
        api: Any,
        node_name: str,
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
        dev_root: Path = Path("/dev"),
        pci_ids: PciIds | None = None,
        kubelet_dir: Path = KUBELET_DIR,
        cdi_dir: Path = CDI_DIR,
        rescan_interval: float = 300,
        virtual_functions: bool = False,
        write_deadline: float = DEADLINE,
        bind_timeout: float = 5.0,
    ) -> None:
        self.session = session_of(api)
        self.node_name = node_name
        self.sysfs_root, self.proc_root, self.dev_root = Path(sysfs_root), Path(proc_root), Path(dev_root)
        self.pci_ids = pci_ids if pci_ids is not None else PciIds.load()
        self.plugin_dir = Path(kubelet_dir) / "plugins" / DRIVER
        self.registration_socket = Path(kubelet_dir) / "plugins_registry" / f"{DRIVER}-reg.sock"
        self.endpoint = self.plugin_dir / "dra.sock"
        self.cdi_dir = Path(cdi_dir)
        self.rescan_interval = rescan_interval
        self.virtual_functions = virtual_functions
        self.bind_timeout = bind_timeout
        self.binder = Binder(write_deadline, on_finished=self.trigger)
        self.on_drivers_moved: Callable[[], None] | None = None  # the agent's trigger: its report rescans
        self.bound = Bound(self.plugin_dir)
        self.devices = Mirror(Custom(api, NODE_PCI_DEVICE_PLURAL), label_selector=f"{NODE_LABEL}={node_name}")
        self.slices = Mirror(Custom(api, dra_slice.PLURAL, group="resource.k8s.io", version="v1"),
                             label_selector=f"{NODE_LABEL}={node_name}")  # fmt: skip
        # Every claim, as little as the binding conditions need (`dra.binding.waiting`): the
        # allocation names the pool, and no selector can.
        self.claims = Informer(api, "resourceclaims", functools.partial(dra_binding.waiting, node_name),
                               on_change=self._claim_changed, group="resource.k8s.io", version="v1",
                               resource_version=operator.attrgetter("resource_version"))  # fmt: skip
        self._waiting: dict[str, dra_binding.Waiting] = {}  # uid -> a claim with devices to answer
        self._waiting_changed = asyncio.Event()
        self.bind_failed: dict[str, float] = {}  # address -> when its group would not go to vfio-pci (monotonic)
        self.inventory: dict[str, dra_slice.Published] = {}  # slice device name -> what it is, as last published
        self.health = HealthWatch(node_name, Health(self.sysfs_root, self.dev_root))
        self._candidates: dict[str, int] = {}  # address -> IOMMU group, of what the last pass would publish
        self.discovery: Discovery | None = None
        self.prepared: dict[str, PreparedClaim] = load_checkpoint(self.plugin_dir)
        self.registration = Registration(DRIVER, self.endpoint, SERVICES)
        self.registered = self.registration.registered
        self.published = asyncio.Event()  # set after the first pass wrote or confirmed the slice
        self.passes = 0
        self.writes = 0  # ResourceSlice writes
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # prepare, unprepare and give-back one at a time
        self._servers: list[grpc.aio.Server] = []
        self._seen: tuple[dict[str, str], frozenset[str]] | None = None  # the hand-outs the last pass saw
        self._desired: list[dict[str, Any]] | None = None  # the pool's slice specs the last pass wanted
        self._node_uid = ""
        self.others = OtherServers(self.session, node_name, Path(kubelet_dir) / "pod-resources" / "kubelet.sock", self.trigger)

    def trigger(self, *_: Any) -> None:
        self._wake.set()

    @property
    def elsewhere(self) -> dict[str, BindError]:
        """Address -> why another server has it (`dra.elsewhere`), as the last pass or prepare judged."""
        return self.others.elsewhere

    @property
    def on_elsewhere_change(self) -> Callable[[], None] | None:
        return self.others.on_change

    @on_elsewhere_change.setter
    def on_elsewhere_change(self, call: Callable[[], None] | None) -> None:
        self.others.on_change = call

    # -- serving ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the DRAPlugin and health services, then the registration socket (the kubelet
        dials the endpoint as soon as it sees the registration)."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.registration_socket.parent.mkdir(parents=True, exist_ok=True)
        self.health.closing.clear()
        self._servers.append(await serve_on(self.endpoint, self, (dra_grpc.add_DRAPluginServicer_to_server,
                                                                  health_grpc.add_DRAResourceHealthServicer_to_server)))  # fmt: skip
        self._servers.append(await serve_on(self.registration_socket, self.registration,
                                            (reg_grpc.add_RegistrationServicer_to_server,)))  # fmt: skip
        log.info("DRA driver %s serving on %s, registration at %s", DRIVER, self.endpoint, self.registration_socket)

    async def close(self) -> None:
        self.health.closing.set()  # health streams end with OK within the grace below, not cut off
        for server in self._servers:
            await server.stop(0.2)
        self._servers.clear()
        for path in (self.registration_socket, self.endpoint):
            path.unlink(missing_ok=True)
        await self.binder.close()

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        await self.start()
        background = [asyncio.create_task(self.devices.run(), name="dra-devices"),
                      asyncio.create_task(self.slices.run(), name="dra-slices"),
                      asyncio.create_task(self._watch_health(), name="dra-health"),
                      asyncio.create_task(self.others.watch(), name="dra-neighbours"),
                      asyncio.create_task(self.claims.run(), name="dra-claims"),
                      asyncio.create_task(self._answer_claims(), name="dra-binding")]  # fmt: skip
        try:
            await self.devices.synced.wait()
            await self.slices.synced.wait()
            await self.others.listed.wait()
            await _first(self.registered, timeout=REGISTRATION_WAIT)
            if not self.registered.is_set():
                log.warning("the kubelet has not registered DRA driver %s after %.0fs (is it running, and is %s its "
                            "plugins_registry?); publishing the ResourceSlice anyway", DRIVER, REGISTRATION_WAIT,
                            self.registration_socket.parent)  # fmt: skip
            while True:
                self._wake.clear()
                self.devices.changed.clear()
                self.slices.changed.clear()
                try:
                    async with asyncio.timeout(60):
                        await self.publish()
                except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    log.warning("DRA pass failed (%s: %s); again in %.0fs", type(exc).__name__, exc, RETRY)
                    asyncio.get_running_loop().call_later(RETRY, self._wake.set)
                await self._wait()
        finally:
            for task in background:
                task.cancel()
            for task in background:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self.close()

    async def _wait(self) -> None:
        """Until the interval passes, someone triggers, an assignment changes, or our slice
        changes under us (the kubelet wipes a node's slices when it starts)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.rescan_interval
        while not self._wake.is_set() and (remaining := deadline - loop.time()) > 0:
            waits = {asyncio.create_task(e.wait()) for e in (self._wake, self.devices.changed, self.slices.changed)}
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
            if self.devices.changed.is_set():
                self.devices.changed.clear()
                if self._assignments() != self._seen:
                    return
            if self.slices.changed.is_set():
                self.slices.changed.clear()
                if self._desired is not None and dra_slice.pool_changed(self._desired, self._live(len(self._desired)), self._node_uid):
                    return

    def _live(self, count: int) -> list[dict[str, Any] | None]:
        """The node's first `count` slices as they are live (None where one is missing)."""
        return [self.slices.objects.get(dra_slice.slice_name(self.node_name, i)) for i in range(count)]

    def _assignments(self) -> tuple[dict[str, str], frozenset[str]]:
        return report.assignment_view(self.devices.objects)

    async def publish(self) -> int:
        """One pass; returns the ResourceSlice writes it made (0 at rest)."""
        self.passes += 1
        node = await self.session.request("GET", f"/api/v1/nodes/{self.node_name}")
        meta = node["metadata"]
        self._node_uid = meta["uid"]
        discovery = await asyncio.to_thread(discover, self.sysfs_root, self.proc_root, self.pci_ids,
                                            self.binder.overdue_addresses(), virtual_functions=self.virtual_functions,
                                            read_overrides=overrides.AGENT)  # fmt: skip
        self.discovery = discovery
        names = {d.address: report.object_name(d, self.node_name) for d in discovery.devices if d.reported}
        self._seen = handed, claimed = self._assignments()
        self.others.judge(discovery, await self.others.served_by_plugins())
        roots = {address: self._pcie_root(address) for address in names}
        published = [p for p in dra_slice.publishable(discovery.devices, handed, names, node_plan.gpu_mode(meta.get("labels")),
                                                      claimed, roots)
                     if p.device.address not in self.elsewhere]  # fmt: skip
        self._candidates = {p.device.address: p.device.iommu_group for p in published}
        await self.health.judge(self._candidates, self._prepared_devices())
        # An ill device stays, tainted (the scheduler and the pods say why); one gone leaves.
        marks = {address: dra_health.taint(why) for address, why in self.health.unhealthy.items()}
        marks = {**{a: dra_health.BIND_FAILED_TAINT for a in self._bind_failed_now()}, **marks}
        withdrawn = [p for p in published if p.device.address in marks and marks[p.device.address] is None]
        published = [dataclasses.replace(p, taint=marks.get(p.device.address)) for p in published if p not in withdrawn]
        self.inventory = dra_slice.by_name(published)
        # More than 128 devices are several slices; never fewer than the live pool has (no delete).
        at_least = dra_slice.live_count(self._live(1)[0])
        self._desired = desired = dra_slice.specs(self.node_name, published, at_least)
        writes = 0
        live = self._live(len(desired))
        if dra_slice.pool_changed(desired, live, self._node_uid):
            bodies = dra_slice.pool_bodies(self.node_name, self._node_uid, desired, live)
            for body in bodies:
                path = f"/apis/resource.k8s.io/v1/resourceslices/{body['metadata']['name']}"
                written = await self.session.request("PATCH", path, query={"fieldManager": AGENT_MANAGER, "force": True},
                                                     body=body, content_type=APPLY_PATCH)  # fmt: skip
                self.slices.store(written)
                writes += 1
                self.writes += 1
            log.info("published ResourceSlice %s: %d devices%s (pool generation %d)", bodies[0]["metadata"]["name"],
                     len(published), f" in {len(bodies)} slices" if len(bodies) > 1 else "",
                     bodies[0]["spec"]["pool"]["generation"])  # fmt: skip
        self.published.set()
        # A group another server has is not ours to give back either (its plugin wants it on vfio-pci).
        theirs = [dra_slice.Published(d, "", "") for d in discovery.devices if d.address in self.elsewhere]
        await self._give_back(published, keep=[*withdrawn, *theirs])
        log.debug("%s %d: %d ResourceSlice writes", PASS_LOGGED, self.passes, writes)
        return writes

    async def _watch_health(self) -> None:
        """Between passes: a device that falls ill (or recovers) asks for a pass at once."""
        while True:
            await asyncio.sleep(HEALTH_POLL)
            if await self.health.judge(self._candidates, self._prepared_devices()):
                self.trigger()

    def _prepared_devices(self) -> list[dict[str, Any]]:
        return [device for claim in self.prepared.values() for device in claim.devices]

    # -- the DRAResourceHealth service -----------------------------------------------------------

    async def NodeWatchResources(self, request, context):
        """The kubelet's health stream (`HealthWatch.stream`); ends with OK when the driver shuts down."""
        async for report in self.health.stream():
            yield report

    async def _give_back(self, published: list[dra_slice.Published], keep: list[dra_slice.Published] = ()) -> None:
        """Groups this driver bound that nothing published and no prepared claim needs: back to
        their drivers. `keep`: withdrawn for their health, left as they are (an unbind of a device
        that fell off the bus is no give-back)."""
        needed = {p.device.iommu_group for p in [*published, *keep]}
        needed |= {d["iommu_group"] for claim in self.prepared.values() for d in claim.devices}
        async with self._lock:  # no bind in flight: its members are intended, not yet settled
            self.bound.add(self.binder.take_late_moved())  # a write past its deadline that returned moved these
            self.bound.settle(self.sysfs_root)  # binds whose answer was lost (a restart mid-write), from the driver links
            if not self.bound.devices or self.discovery is None:
                return
            for group, members in sorted(self._groups().items()):
                mine = [a for a in members if a in self.bound]
                if group in needed or not mine:
                    continue
                try:
                    await self.binder.release(self.sysfs_root, self.dev_root, group, mine, self.bind_timeout,
                                              {a: self.bound.devices.get(a, "") for a in mine})  # fmt: skip
                except BindError as exc:
                    log.warning("giving IOMMU group %d (%s) back failed: %s", group, ", ".join(mine), exc)
                    continue
                self.bound.remove(mine)
                self._drivers_moved(mine)
                log.info("gave IOMMU group %d (%s) back to its drivers", group, ", ".join(mine))

    def _drivers_moved(self, addresses: Any) -> None:
        """Devices changed driver: the agent's report (its `driver` attribute) hears of it now, not
        at its next periodic rescan."""
        if addresses and self.on_drivers_moved is not None:
            self.on_drivers_moved()

    def _groups(self) -> dict[int, list[str]]:
        """IOMMU group -> its non-bridge members, from the last discovery."""
        groups: dict[int, list[str]] = {}
        for device in self.discovery.devices if self.discovery else ():
            if device.iommu_group >= 0 and device.class_code[:2] != BRIDGE_CLASS:
                groups.setdefault(device.iommu_group, []).append(device.address)
        return groups

    # -- the DRAPlugin service -------------------------------------------------------------------

    async def NodePrepareResources(self, request, context) -> dra.NodePrepareResourcesResponse:
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                devices = await self._prepare(claim.namespace, claim.name, claim.uid)
                response.claims[claim.uid].devices.extend(devices)
            except PrepareError as exc:
                log.warning("preparing claim %s/%s failed: %s", claim.namespace, claim.name, exc)
                response.claims[claim.uid].error = str(exc)
        return response

    async def NodeUnprepareResources(self, request, context) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                await self._unprepare(claim.uid)
                response.claims[claim.uid].CopyFrom(dra.NodeUnprepareResourceResponse())
            except PrepareError as exc:
                log.warning("unpreparing claim %s/%s failed: %s", claim.namespace, claim.name, exc)
                response.claims[claim.uid].error = str(exc)
        return response

    async def _prepare(self, namespace: str, name: str, uid: str) -> list[dra.Device]:
        async with self._lock:
            if uid in self.prepared:  # a retry, or the kubelet restarted: the same answer
                return [_device_message(d) for d in self.prepared[uid].devices]
            claim = await self._claim(namespace, name, uid)
            results = [r for r in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
                       if r.get("driver") == DRIVER and r.get("pool") == self.node_name]  # fmt: skip
            if not results:
                raise PrepareError(f"claim {namespace}/{name} has no device of {DRIVER} on node {self.node_name} allocated")
            elsewhere = await self.others.now(self.discovery)
            chosen = [(result, self._judge(namespace, uid, result.get("device", ""), bool(result.get("adminAccess")), elsewhere))
                      for result in results]  # fmt: skip
            await self._bind_groups([item for _, item in chosen])
            devices = [
                cdi.PreparedDevice(request=r["request"], pool=self.node_name, name=item.name, address=item.device.address,
                                   iommu_group=item.device.iommu_group, attributes=dra_slice.attributes(item),
                                   cdev=self._cdev(item.device.address))
                for r, item in chosen
            ]  # fmt: skip
            prepared = write_files(claim, devices, self.cdi_dir, self.plugin_dir)
            self.prepared[uid] = prepared
            save_checkpoint(self.plugin_dir, self.prepared)
            log.info("prepared claim %s/%s: %s", namespace, name,
                     ", ".join(f"{d.name} ({d.address}, IOMMU group {d.iommu_group})" for d in devices))  # fmt: skip
            return [_device_message(d) for d in prepared.devices]

    def _judge(self, namespace: str, uid: str, device: str, admin_access: bool, elsewhere: dict[str, BindError]) -> dra_slice.Published:
        """The published device `device` if the claim `uid` of `namespace` may have it here;
        PrepareError saying why not."""
        item = self.inventory.get(device)
        why = elsewhere.get(item.device.address if item else _address_of(device))
        if why is not None:
            raise PrepareError(f"device {device} is not this driver's to prepare: {why}")
        if item is None:
            raise PrepareError(f"device {device} is not one this node offers now (unassigned, gone, or "
                               "no longer in the pool): the claim must be allocated again")  # fmt: skip
        if item.namespace and item.namespace != namespace:
            raise PrepareError(f"device {item.name} ({item.device.address}) belongs to namespace {item.namespace}: "
                               f"a claim of {namespace} never gets it")  # fmt: skip
        if (why := self.health.unhealthy.get(item.device.address)) is not None:
            # Allocated before it fell ill (a taint keeps no claim from what it has): no
            # VM starts on it; the kubelet retries, and it is prepared once it recovers.
            raise PrepareError(f"device {item.name} ({item.device.address}) is unhealthy: {why}; the claim is "
                               "prepared once it recovers")  # fmt: skip
        if admin_access:
            raise PrepareError(f"device {item.name} ({item.device.address}) is allocated with adminAccess, which "
                               "passthrough devices do not allow: VFIO gives a device to one VM at a time")  # fmt: skip
        other = holder(self.prepared, item.device.iommu_group, uid)
        if other is not None:
            # Whatever the API says: a scheduler's race, or a pod force-deleted before the
            # kubelet unprepared its claim, can allocate one device to two claims.
            raise PrepareError(f"device {item.name} ({item.device.address}, IOMMU group {item.device.iommu_group}) "
                               f"is prepared for claim {other.namespace}/{other.name}: a device and its IOMMU group "
                               "go to one claim at a time; this claim is prepared once that one is unprepared")  # fmt: skip
        return item

    async def _bind_groups(self, items: Iterable[dra_slice.Published]) -> list[tuple[int, list[str]]]:
        """The whole IOMMU group of each device on vfio-pci (a no-op for a group already there);
        the groups and their members. PrepareError (with `.group`) when one would not move."""
        groups = self._groups()
        done = []
        for group in sorted({item.device.iommu_group for item in items}):
            members = groups.get(group, [])
            # Recorded before the job: should its answer be lost (the agent restarts while the
            # write is blocked), what it moved is still this driver's to give back.
            self.bound.intend(self.sysfs_root, members)
            try:
                _, moved = await self.binder.bind(self.sysfs_root, self.dev_root, group, members, self.bind_timeout)
            except BindError as exc:
                self.bound.add(getattr(exc, "moved", {}))
                self._drivers_moved(getattr(exc, "moved", {}))
                error = PrepareError(f"binding IOMMU group {group} ({', '.join(members)}) to vfio-pci failed: {exc}")
                error.group = group
                raise error from None
            self.bound.add(moved)
            self._drivers_moved(moved)
            for address in members:
                self.bind_failed.pop(address, None)
            done.append((group, members))
        return done

    # -- binding conditions ------------------------------------------------------------------------

    def _claim_changed(self, old: dra_binding.Waiting | None, new: dra_binding.Waiting | None) -> None:
        if new is not None and new.devices:
            self._waiting[new.uid] = new
            self._waiting_changed.set()
        elif old is not None:
            self._waiting.pop(old.uid, None)

    async def _answer_claims(self) -> None:
        """Each claim allocated a device of ours here with our binding condition gets its answer:
        the group on vfio-pci and VFIOBound, or VFIOBindFailed with why."""
        while True:
            await self._waiting_changed.wait()
            self._waiting_changed.clear()
            for uid, claim in list(self._waiting.items()):
                try:
                    async with asyncio.timeout(60):
                        await self._answer(claim)
                except (ApiError, OSError, TimeoutError, aiohttp.ClientError) as exc:
                    log.warning("answering the binding conditions of claim %s/%s failed (%s: %s); again in %.0fs",
                                claim.namespace, claim.name, type(exc).__name__, exc, RETRY)  # fmt: skip
                    asyncio.get_running_loop().call_later(RETRY, self._waiting_changed.set)
                    continue
                if self._waiting.get(uid) is claim:
                    del self._waiting[uid]  # answered; a later change of the claim comes back through the cache

    async def _answer(self, claim: dra_binding.Waiting) -> None:
        await self.published.wait()  # the inventory is the slice the scheduler allocated from
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        answers: dict[str, dict[str, Any]] = {}
        async with self._lock:
            elsewhere = await self.others.now(self.discovery)
            items = []
            for _, device, admin_access in claim.devices:
                try:
                    items.append(self._judge(claim.namespace, claim.uid, device, admin_access, elsewhere))
                except PrepareError as exc:
                    answers[device] = dra_binding.condition(False, str(exc), now, reason="Refused")
            if not answers:
                try:
                    groups = await self._bind_groups(items)
                except PrepareError as exc:
                    failed = [i for i in items if i.device.iommu_group == getattr(exc, "group", None)]
                    for item in failed:
                        self.bind_failed[item.device.address] = time.monotonic()
                    answers = {item.name: dra_binding.condition(False, str(exc), now, reason="BindFailed") for item in items}
                    asyncio.get_running_loop().call_later(BIND_FAILED_HOLD + 1, self.trigger)  # past the hold: untainted
                    self.trigger()  # tainted now, so the scheduler's next try goes elsewhere
                else:
                    on = {group: members for group, members in groups}
                    answers = {item.name: dra_binding.condition(True, f"IOMMU group {item.device.iommu_group} "
                                                                f"({', '.join(on[item.device.iommu_group])}) is on vfio-pci", now)
                               for item in items}  # fmt: skip
        path = f"/apis/resource.k8s.io/v1/namespaces/{claim.namespace}/resourceclaims/{claim.name}/status"
        try:
            await self.session.request("PATCH", path, query={"fieldManager": dra_binding.FIELD_MANAGER, "force": True},
                                       body=dra_binding.status_apply(claim, self.node_name, answers), content_type=APPLY_PATCH)  # fmt: skip
        except ApiError as exc:
            if exc.status in (404, 409):
                return  # deleted or replaced meanwhile: nobody waits for this answer
            raise
        for device, answer in sorted(answers.items()):
            log.info("claim %s/%s device %s: %s=True (%s)", claim.namespace, claim.name, device, answer["type"], answer["message"])

    def _bind_failed_now(self) -> list[str]:
        """The devices still tainted for a failed bind; those past BIND_FAILED_HOLD are offered again."""
        cutoff = time.monotonic() - BIND_FAILED_HOLD
        for address in [a for a, when in self.bind_failed.items() if when <= cutoff]:
            del self.bind_failed[address]
            log.info("%s is offered again, untainted, %.0fs after its group would not go to vfio-pci", address, BIND_FAILED_HOLD)
        return sorted(self.bind_failed)

    async def _claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        try:
            claim = await self.session.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
        except ApiError as exc:
            raise PrepareError(f"cannot read claim {namespace}/{name}: {exc.status} {exc.reason}") from None
        if claim["metadata"].get("uid") != uid:
            raise PrepareError(f"claim {namespace}/{name} was replaced (uid {claim['metadata'].get('uid')}, not {uid})")
        return claim

    async def _unprepare(self, uid: str) -> None:
        async with self._lock:
            prepared = self.prepared.get(uid)
            if prepared is None:
                return  # never prepared here, or already unprepared: nothing to undo
            remove_files(prepared)
            del self.prepared[uid]
            save_checkpoint(self.plugin_dir, self.prepared)
            log.info("unprepared claim %s/%s", prepared.namespace, prepared.name)
        # Its group stays on vfio-pci while the device is published (the next VM starts at once);
        # the next pass gives back what left passthrough.
        self.trigger()

    def _pcie_root(self, address: str) -> str:
        try:
            return dra_slice.pcie_root(os.readlink(self.sysfs_root / "bus" / "pci" / "devices" / address), address)
        except OSError:
            return ""

    def _cdev(self, address: str) -> str:
        return vfio.iommufd_device(self.sysfs_root, self.dev_root, address)

class PrepareError(RuntimeError):
    """A claim cannot be prepared (or unprepared) here; the kubelet reports the message on the pod."""


def _address_of(device_name: str) -> str:
    """The PCI address a slice device name stands for (`dra.slice.device_name` backwards), or ""."""
    parts = device_name.removeprefix("pci-").split("-")
    if not device_name.startswith("pci-") or len(parts) != 4:
        return ""
    return f"{parts[0]}:{parts[1]}:{parts[2]}.{parts[3]}"


def _device_message(device: dict[str, Any]) -> dra.Device:
    return dra.Device(request_names=[cdi.base_request(device["request"])], pool_name=device["pool"],
                      device_name=device["name"], cdi_device_ids=device["cdi_ids"])  # fmt: skip
