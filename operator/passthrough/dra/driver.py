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

Rooms: the pass, the slice and the gRPC services here; `dra.preparer` (claims prepared and
unprepared, the judge, binds and give-back), `dra.answers` (binding conditions),
`dra.healthwatch`, `dra.elsewhere` (other servers), `dra.registration` (how the kubelet finds it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.api.labels import NODE_LABEL
from passthrough.api.names import NODE_PCI_DEVICE_PLURAL
from passthrough.dra import binding as dra_binding
from passthrough.dra import health as dra_health
from passthrough.dra.healthwatch import HEALTH_POLL, HealthWatch, first as _first
from passthrough.dra import slice as dra_slice
from passthrough.dra.elsewhere import OtherServers
from passthrough.dra.registration import Registration, serve_on
from passthrough.dra.answers import BindingAnswers
from passthrough.dra.preparer import PrepareError, Preparer
from passthrough.dra.kubeletapi.dra_v1 import api_pb2 as dra
from passthrough.dra.kubeletapi.dra_v1 import api_pb2_grpc as dra_grpc
from passthrough.dra.kubeletapi.drahealth_v1 import api_pb2_grpc as health_grpc
from passthrough.dra.kubeletapi.pluginregistration_v1 import api_pb2_grpc as reg_grpc
from passthrough.kube.cache import Informer, Mirror
from passthrough.kube.client import APPLY_PATCH, ApiError, session_of
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.pci.binder import DEADLINE, Binder
from passthrough.pci.discovery import discover
from passthrough.pci.health import Health
from passthrough.pci.pciids import PciIds
from passthrough.pci import overrides

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
        binder_sockets: Sequence[Path] = (),
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
        self.binder = Binder(write_deadline, on_finished=self.trigger, sockets=binder_sockets)
        self.devices = Mirror(Custom(api, NODE_PCI_DEVICE_PLURAL), label_selector=f"{NODE_LABEL}={node_name}")
        self.slices = Mirror(Custom(api, dra_slice.PLURAL, group="resource.k8s.io", version="v1"),
                             label_selector=f"{NODE_LABEL}={node_name}")  # fmt: skip
        # Every claim, as little as the binding conditions need (`dra.binding.waiting`): the
        # allocation names the pool, and no selector can.
        self.claims = Informer(api, "resourceclaims", functools.partial(dra_binding.waiting, node_name),
                               on_change=lambda old, new: self.answers.claim_changed(old, new), group="resource.k8s.io", version="v1",
                               resource_version=operator.attrgetter("resource_version"))  # fmt: skip
        self.health = HealthWatch(node_name, Health(self.sysfs_root, self.dev_root))
        self._candidates: dict[str, int] = {}  # address -> IOMMU group, of what the last pass would publish
        self.registration = Registration(DRIVER, self.endpoint, SERVICES)
        self.registered = self.registration.registered
        self.published = asyncio.Event()  # set after the first pass wrote or confirmed the slice
        self.passes = 0
        self.writes = 0  # ResourceSlice writes
        self._wake = asyncio.Event()
        self._servers: list[grpc.aio.Server] = []
        self._seen: tuple[dict[str, str], frozenset[str]] | None = None  # the hand-outs the last pass saw
        self._desired: list[dict[str, Any]] | None = None  # the pool's slice specs the last pass wanted
        self._node_uid = ""
        # The uninstall's give-back request (`plan.giving_back`) this driver has carried out: the
        # agent answers it on the Node once this says so (`on_given_back` tells it).
        self.given_back = ""
        self.on_given_back: Callable[[], None] | None = None
        self.others = OtherServers(self.session, node_name, Path(kubelet_dir) / "pod-resources" / "kubelet.sock", self.trigger)
        # Claims prepared, devices judged and bound, groups given back (`dra.preparer`); the
        # binding conditions answered from the same judge and binds (`dra.answers`).
        self.preparer = Preparer(self.session, node_name, self.sysfs_root, self.dev_root, self.plugin_dir, self.cdi_dir,
                                 self.binder, self.health, self.others, bind_timeout, self.trigger)  # fmt: skip
        self.answers = BindingAnswers(self.session, node_name, self.preparer, self.published, self.trigger)

    def trigger(self, *_: Any) -> None:
        self._wake.set()

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
                      asyncio.create_task(self.answers.run(), name="dra-binding")]  # fmt: skip
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
        self.preparer.discovery = discovery
        names = {d.address: report.object_name(d, self.node_name) for d in discovery.devices if d.reported}
        self._seen = handed, claimed = self._assignments()
        asked = node_plan.giving_back(meta.get("labels"))
        if asked:
            handed, claimed = {}, frozenset()  # asked for the devices back: nothing is offered, the bound go back
        self.others.judge(discovery, await self.others.served_by_plugins())
        roots = {address: self._pcie_root(address) for address in names}
        published = [p for p in dra_slice.publishable(discovery.devices, handed, names, node_plan.gpu_mode(node_plan.as_planned(meta.get("labels"))),
                                                      claimed, roots)
                     if p.device.address not in self.others.elsewhere]  # fmt: skip
        self._candidates = {p.device.address: p.device.iommu_group for p in published}
        await self.health.judge(self._candidates, self.preparer.prepared_devices())
        # An ill device stays, tainted (the scheduler and the pods say why); one gone leaves.
        marks = {address: dra_health.taint(why) for address, why in self.health.unhealthy.items()}
        marks = {**{a: dra_health.BIND_FAILED_TAINT for a in self.preparer.bind_failed_now()}, **marks}
        withdrawn = [p for p in published if p.device.address in marks and marks[p.device.address] is None]
        published = [dataclasses.replace(p, taint=marks.get(p.device.address)) for p in published if p not in withdrawn]
        self.preparer.inventory = dra_slice.by_name(published)
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
        theirs = [dra_slice.Published(d, "", "") for d in discovery.devices if d.address in self.others.elsewhere]
        await self.preparer.give_back(published, keep=[*withdrawn, *theirs])
        if asked != self.given_back:
            # Given back what nothing holds (a prepared claim's group stays, its device says why).
            self.given_back = asked
            if self.on_given_back is not None:
                self.on_given_back()
        log.debug("%s %d: %d ResourceSlice writes", PASS_LOGGED, self.passes, writes)
        return writes

    async def _watch_health(self) -> None:
        """Between passes: a device that falls ill (or recovers) asks for a pass at once."""
        while True:
            await asyncio.sleep(HEALTH_POLL)
            if await self.health.judge(self._candidates, self.preparer.prepared_devices()):
                self.trigger()

    # -- the DRAResourceHealth service -----------------------------------------------------------

    async def NodeWatchResources(self, request, context):
        """The kubelet's health stream (`HealthWatch.stream`); ends with OK when the driver shuts down."""
        async for said in self.health.stream():
            yield said

    # -- the DRAPlugin service -------------------------------------------------------------------

    async def NodePrepareResources(self, request, context) -> dra.NodePrepareResourcesResponse:
        response = dra.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                devices = await self.preparer.prepare(claim.namespace, claim.name, claim.uid)
                response.claims[claim.uid].devices.extend(devices)
            except PrepareError as exc:
                log.warning("preparing claim %s/%s failed: %s", claim.namespace, claim.name, exc)
                response.claims[claim.uid].error = str(exc)
        return response

    async def NodeUnprepareResources(self, request, context) -> dra.NodeUnprepareResourcesResponse:
        response = dra.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                await self.preparer.unprepare(claim.uid)
                response.claims[claim.uid].CopyFrom(dra.NodeUnprepareResourceResponse())
            except PrepareError as exc:
                log.warning("unpreparing claim %s/%s failed: %s", claim.namespace, claim.name, exc)
                response.claims[claim.uid].error = str(exc)
        return response

    def _pcie_root(self, address: str) -> str:
        try:
            return dra_slice.pcie_root(os.readlink(self.sysfs_root / "bus" / "pci" / "devices" / address), address)
        except OSError:
            return ""
