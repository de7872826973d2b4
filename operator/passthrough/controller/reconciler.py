"""Carries out `lifecycle.decide` for one device name at a time.

Kopf's handlers and the informers only enqueue names; workers here build the device's
`World` from the indexes, decide, write, and wait until the indexes have seen their own
writes, so the next decision for that name never acts on a state older than what it just wrote.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import aiohttp

from passthrough.api.models import API_VERSION, CONFIG_NAME, MAX_GRACE_SECONDS, NODE_PCI_DEVICE, PASSTHROUGH_CONFIG, PCI_DEVICE
from passthrough.api.views import NodeDevice
from passthrough.controller import allocations, deviceclasses, kubevirt_sync, lifecycle, metrics
from passthrough.controller.workqueue import WorkQueue, run_workers
from passthrough.controller.world import (ApplyDevice, ApplyDeviceStatus, ApplyNodeDeviceFinalizer, ApplyNodeDeviceStatus,
                                          DeleteDevice, DeleteNodeDevice, Event, World)
from passthrough.kube.custom import OPERATOR_MANAGER, Custom
from passthrough.kube.events import EventRecorder
from passthrough.kube.client import MERGE_PATCH, ApiError
from passthrough.kubevirt.render import Rendered
from passthrough.pci.naming import exclusive_resource_name

log = logging.getLogger(__name__)

# Index names, as the handlers module registers them.
NODE_DEVICES = "node_devices"
DEVICES = "devices"
VM_REFERENCES = "vm_references"
NAMESPACES = "namespaces"
CONFIGS = "configs"
KUBEVIRTS = "kubevirts"
GROUPS = "iommu_groups"
NODES = "nodes"
DEVICES_BY_NAMESPACE = "devices_by_namespace"
DEVICES_BY_NODE = "devices_by_node"
DEVICE_CLASSES = "device_classes"  # DRA mode only (controller/handlers.py register_device_classes)
CLAIMS = "claims"  # DRA mode only: (pool, device) -> the claims allocated it (register_claims)

# Events in flight at once, posted as their transitions happen, beside the writes. Holding them
# until the work queue ran dry (as before) left a burst's 1,000 Events for the end, at 16 at a
# time on an API server no longer busy: 1 s of tail (bench_operator.py).
EVENTS_AT_ONCE = 16

# The work-queue key of the KubeVirt CR's sync (device keys are NodePCIDevice names).
KUBEVIRT = ("kubevirt",)
# The work-queue key of the per-namespace DeviceClasses' sync (DRA mode).
CLASSES = ("deviceclasses",)


def _values(index: Mapping[Any, Any] | None, key: Any) -> list[Any]:
    if index is None:
        return []
    store = index.get(key)
    return list(store) if store is not None else []


def _kind(key: Hashable) -> str:
    """What a work-queue key is, for the metrics."""
    return "kubevirt" if key == KUBEVIRT else "deviceclasses" if key == CLASSES else "device"


def _rv(value: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _expect(what: str, namespace: str, written: dict[str, Any]) -> tuple[str, str, str]:
    # Dropping the last finalizer of an object being deleted deletes it: the answer then
    # carries no resourceVersion, and what to wait for is its disappearance.
    rv = written.get("metadata", {}).get("resourceVersion")
    return (what, namespace, rv) if rv else (f"{what}-gone", namespace, "")


class Reconciler:
    def __init__(self, api, indices: Mapping[str, Any], default_grace: datetime.timedelta, workers: int = 16) -> None:
        self.indices = indices
        self.default_grace = default_grace
        self.node_devices = Custom(api, NODE_PCI_DEVICE.plural)
        self.devices = Custom(api, PCI_DEVICE.plural, namespaced=True)
        self.configs = Custom(api, PASSTHROUGH_CONFIG.plural)
        self.kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
        # DRA mode: the per-namespace DeviceClasses, kept when their index is there.
        self.classes = Custom(api, deviceclasses.PLURAL, group="resource.k8s.io", version="v1") if DEVICE_CLASSES in indices else None
        self.last_good: Rendered | None = None
        self.unapplied: dict[str, str] = {}  # assigned device -> why KubeVirt lacks its entry
        self._problems_logged: list[str] = []
        self.queue = WorkQueue()
        self.events = EventRecorder(api, OPERATOR_MANAGER, concurrency=EVENTS_AT_ONCE)
        self.workers = workers
        self._waiters: dict[Hashable, list[asyncio.Future]] = {}  # key -> reconciles waiting to see their writes
        self._sync_cost = 0.0  # seconds the last KubeVirt sync held the event loop
        self.writes = 0
        self._bad_grace: Any = None
        self._kubevirt_served: tuple[Any, dict[str, str]] = (None, {})  # (what it was made of, models)
        self._device_settings: Any = None  # what devices were last decided with (settings_changed)

    # -- inputs ----------------------------------------------------------------------------

    def enqueue(self, name: str) -> None:
        self.queue.add(name)

    def changed(self, key: Hashable) -> None:
        """What the indexes hold for `key` (a device name, or KUBEVIRT for the config and the CR)
        changed: wake the reconciles waiting there to see their own writes, and only those."""
        for waiter in self._waiters.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    def sync_kubevirt_soon(self) -> None:
        # Bursts (hundreds of assignments, a node's first report) fold into one sync.
        self.queue.add_after(KUBEVIRT, kubevirt_sync.next_sync_delay(self._sync_cost))

    def sync_device_classes_soon(self) -> None:
        if self.classes is not None:
            self.queue.add_after(CLASSES, 0.1)

    def config(self) -> kubevirt_sync.ConfigView | None:
        found = _values(self.indices.get(CONFIGS), CONFIG_NAME)
        return found[0] if found else None

    def grace(self) -> datetime.timedelta:
        config = self.config()
        seconds = ((config.spec.get("devices") or {}).get("notFoundGracePeriodSeconds")) if config else None
        if seconds is None:
            return self.default_grace
        # The CRD bounds it; an object stored before that bound (or odd) keeps the default.
        if not isinstance(seconds, int) or isinstance(seconds, bool) or not 0 <= seconds <= MAX_GRACE_SECONDS:
            if seconds != self._bad_grace:
                self._bad_grace = seconds
                log.warning("devices.notFoundGracePeriodSeconds %r is not a number of seconds from 0 to %d; using %s",
                            seconds, MAX_GRACE_SECONDS, self.default_grace)
            return self.default_grace
        return datetime.timedelta(seconds=seconds)

    def confirm_new_namespaces(self) -> bool:
        config = self.config()
        return bool(config and (config.spec.get("devices") or {}).get("confirmNewNamespaces") is True)

    def served_by_kubevirt(self) -> dict[str, str]:
        """The models KubeVirt's own plugin serves (kept until the config or the render changes)."""
        config = self.config()
        made_of = (config.resource_version if config else None, id(self.last_good))
        if self._kubevirt_served[0] != made_of:
            self._kubevirt_served = (made_of, kubevirt_sync.served_by_kubevirt(config, self.last_good))
        return self._kubevirt_served[1]

    def settings_changed(self) -> None:
        """The config's device settings (confirmNewNamespaces, the models KubeVirt serves) changed:
        every assigned device decides again. The config's status writes change neither."""
        settings = (self.confirm_new_namespaces(), self.served_by_kubevirt())
        if settings != self._device_settings:
            first, self._device_settings = self._device_settings is None, settings
            if not first:
                for names in list(self.assignments().values()):
                    for name in names:
                        self.enqueue(name)

    def group_of(self, npci: NodeDevice) -> dict[str, str]:
        """The other members of the device's IOMMU group on its node: name -> assigned namespace."""
        group = npci.attributes.get("iommuGroup", -1)
        if not isinstance(group, int) or group < 0:
            return {}
        return {
            other: "" if member.deleting else member.assigned_namespace
            for other in _values(self.indices.get(GROUPS), (npci.node_name, group)) if other != npci.name
            for member in _values(self.indices[NODE_DEVICES], other)[:1]
        }

    def node_present(self, npci: NodeDevice | None) -> bool:
        """Whether the device's Node exists (a device that names none is not judged by it)."""
        nodes = self.indices.get(NODES)
        if npci is None or not npci.node_name or nodes is None:
            return True
        return bool(_values(nodes, npci.node_name))

    def claims_of(self, npci: NodeDevice | None) -> tuple[allocations.Allocation, ...]:
        """The claims whose allocation names the device, found by its node and address (DRA mode)."""
        address = npci.attributes.get("pciAddress") if npci is not None else None
        if not isinstance(address, str) or not address or CLAIMS not in self.indices:
            return ()
        found = _values(self.indices[CLAIMS], allocations.key(npci.node_name, address))
        return tuple(sorted(set(found), key=lambda c: (c.namespace, c.name)))

    def device_class(self, npci: NodeDevice | None) -> str:
        """DRA mode: the DeviceClass of the device's namespace (controller/deviceclasses.py), where its
        node serves through DRA ("" on a device-plugin node of a cluster whose nodes choose)."""
        if CLAIMS not in self.indices or npci is None or not npci.assigned_namespace or not self.through_dra(npci.node_name):
            return ""
        return deviceclasses.class_name(npci.assigned_namespace)

    def through_dra(self, node: str) -> bool:
        """Whether `node` serves through DRA: its agent's word on its Node, the cluster's default until then."""
        config = self.config()
        spec = config.spec if config else {"dra": {"enabled": True}}  # the operator runs --dra: DRA is the default
        found = _values(self.indices.get(NODES), node)
        return deviceclasses.through_dra(found[0][1] if found and isinstance(found[0], tuple) else "", spec)

    def devices_at(self, pool: str, device: str) -> list[str]:
        """The NodePCIDevices an allocation result of (pool, device) names: those of that node at
        that address (one, unless the node reported the address twice with other IDs)."""
        return [
            d.name for name in _values(self.indices.get(DEVICES_BY_NODE), pool)
            for d in _values(self.indices[NODE_DEVICES], name)
            if isinstance(address := d.attributes.get("pciAddress"), str) and allocations.key(pool, address) == (pool, device)
        ]  # fmt: skip

    def node_devices_known(self) -> Iterator[NodeDevice]:
        """Every NodePCIDevice the indexes hold (for the metrics, at scrape time)."""
        return (store[0] for store in self.indices[NODE_DEVICES].values() if store)

    def assignments(self) -> Mapping[str, Any]:
        """Namespace -> the names of the devices assigned to it."""
        return self.indices[DEVICES_BY_NAMESPACE]

    def world(self, name: str) -> World:
        node_devices = _values(self.indices[NODE_DEVICES], name)
        devices = tuple(sorted(_values(self.indices[DEVICES], name), key=lambda d: d.namespace))
        resource = exclusive_resource_name(name)
        namespaces = {ns for ns in [d.namespace for d in devices]}
        if node_devices and node_devices[0].assigned_namespace:
            namespaces.add(node_devices[0].assigned_namespace)
        vm_index = self.indices.get(VM_REFERENCES)
        referencing = {ns: tuple(sorted(set(_values(vm_index, (ns, resource))))) for ns in namespaces}
        found = {ns: seen for ns in namespaces for seen in _values(self.indices[NAMESPACES], ns)[:1]}
        npci = node_devices[0] if node_devices else None
        return World(
            name=name,
            node_device=npci,
            group=self.group_of(npci) if npci else {},
            allow_list_problem=self.unapplied.get(name, ""),
            devices=devices,
            namespaces={ns: seen[0] for ns, seen in found.items()},
            namespace_uids={ns: seen[1] for ns, seen in found.items()},
            namespace_created={ns: seen[2] for ns, seen in found.items() if len(seen) > 2},
            confirm_new_namespaces=self.confirm_new_namespaces(),
            served_by_kubevirt=self.served_by_kubevirt(),
            node_present=self.node_present(npci),
            referencing_vms={ns: vms for ns, vms in referencing.items() if vms},
            claims=self.claims_of(npci),
            device_class=self.device_class(npci),
            now=datetime.datetime.now(datetime.UTC),
            grace=self.grace(),
        )

    # -- work ------------------------------------------------------------------------------

    async def run(self) -> None:
        workers = asyncio.create_task(run_workers(self.queue, self.reconcile, self.workers, self._retry_delay))
        empty = asyncio.create_task(self.queue.wait_empty())
        try:
            # Everything listed at start-up is queued by now: the first time the queue runs dry,
            # every device has been decided once. An admin (and the benchmark) reads this line.
            started = time.monotonic()
            await asyncio.wait([workers, empty], return_when=asyncio.FIRST_COMPLETED)
            if not workers.done():
                log.info("start-up done: every device decided in %.1fs, %d writes; the work queue is empty",
                         time.monotonic() - started, self.writes)
            await workers
        finally:
            for task in (workers, empty):
                task.cancel()
            await asyncio.gather(workers, empty, return_exceptions=True)

    def _retry_delay(self, name: Any, exc: BaseException, failures: int) -> float:
        metrics.RECONCILE_FAILURES.labels(_kind(name)).inc()
        delay = min(0.5 * 2 ** (failures - 1), 60.0)
        if isinstance(exc, ApiError):
            log.warning("reconciling %s failed (%s %s); retry %d in %.1fs", name, exc.status, exc.reason, failures, delay)
        elif isinstance(exc, (aiohttp.ClientError, OSError, TimeoutError)):
            # The API server away (restarting, a connection cut): the weather, not a bug.
            log.warning("reconciling %s failed (%s: %s); retry %d in %.1fs", name, type(exc).__name__, exc, failures, delay)
        else:  # a bug, not the weather: keep the traceback
            log.warning("reconciling %s failed; retry %d in %.1fs", name, failures, delay, exc_info=exc)
        return delay

    async def reconcile(self, key) -> None:
        with metrics.RECONCILE_SECONDS.labels(_kind(key)).time():
            if key == KUBEVIRT:
                await self.sync_kubevirt()
            elif key == CLASSES:
                await self.sync_device_classes()
            else:
                await self._reconcile_device(key)

    async def _reconcile_device(self, name: str) -> None:
        world = self.world(name)
        plan = lifecycle.decide(world)
        # Writes to one object keep their order (a finalizer before the delete it guards);
        # writes to different objects (the PCIDevices, the NodePCIDevice) go out together,
        # except the NodePCIDevice's status, which reports on the PCIDevice: it follows their
        # writes, so that "Assigned" or "Not assigned" is never read before it is true.
        sequences: dict[tuple[str, str], list[Any]] = {}
        reports: list[Any] = []
        for write in plan.writes:
            namespace = getattr(write, "namespace", None)
            if namespace is None and (reports or isinstance(write, ApplyNodeDeviceStatus)):
                reports.append(write)
            else:
                sequences.setdefault(("device", namespace) if namespace is not None else ("node-device", ""), []).append(write)

        made: dict[str, str] = {}  # namespace -> uid of a PCIDevice these writes made or changed

        async def carry_out(writes: list[Any]) -> list[tuple[str, str, str]]:
            done = []
            for write in writes:
                expectation = await self._execute(name, write, made)
                self.writes += 1
                if expectation is not None:
                    done.append(expectation)
            return done

        expectations = [e for done in await asyncio.gather(*(carry_out(w) for w in sequences.values())) for e in done]
        if reports:
            expectations += await carry_out(reports)
        for event in plan.events:
            self._post(name, world, event, made)
        if plan.requeue_after is not None:
            self.queue.add_after(name, plan.requeue_after)
        if expectations:
            await self._wait_until_seen(name, expectations)

    async def _execute(self, name: str, write: Any, made: dict[str, str] | None = None):
        """One write; returns what the indexes must show before the name is decided again.
        `made` gets the uid of each PCIDevice written, by namespace."""
        # A write with a namespace is to a PCIDevice; one without, to the NodePCIDevice.
        namespace = getattr(write, "namespace", None)
        kind, what = (self.devices, "device") if namespace is not None else (self.node_devices, "node-device")
        if isinstance(write, DeleteDevice | DeleteNodeDevice):
            return await self._delete(kind, what, name, namespace, write)
        if isinstance(write, ApplyDevice | ApplyDeviceStatus | ApplyNodeDeviceFinalizer
                      | ApplyNodeDeviceStatus):  # fmt: skip
            status = isinstance(write, ApplyDeviceStatus | ApplyNodeDeviceStatus)
            try:
                with metrics.write(f"{kind.plural}/status" if status else kind.plural, "apply"):
                    obj = await kind.apply(write.body, OPERATOR_MANAGER, status=status)
            except ApiError as exc:
                # Deleted (404), or deleted and made anew (409: the uid differs) since the decision:
                # decide again. A status write, or one that names the uid, never makes the object.
                if exc.status in (404, 409) and (status or write.body["metadata"].get("uid")):
                    return (f"{what}-gone", namespace or "", "") if exc.status == 404 else None
                raise
            if made is not None and namespace is not None and obj.get("metadata", {}).get("uid"):
                made[namespace] = obj["metadata"]["uid"]
            return _expect(what, namespace or "", obj)
        raise TypeError(f"unknown write {write!r}")

    async def _delete(self, kind: Custom, what: str, name: str, namespace: str | None, write: Any):
        with metrics.write(kind.plural, "delete") as counted:
            answer = await kind.delete(name, namespace, uid=write.uid, resource_version=write.resource_version)
            counted.status(answer)
        if answer == 409:
            # It changed since the decision (a node that came back), or was made anew: decide again, no waiting.
            return None
        if namespace is not None:
            log.info("deleting PCIDevice %s/%s", namespace, name)
        else:
            log.info("deleted NodePCIDevice %s: gone from its node, or its node gone past the grace period", name)
        return (f"{what}-gone", namespace or "", "")

    async def sync_device_classes(self) -> None:
        """The DeviceClass of each namespace with devices handed out, and none of the others;
        no write when they are as they should be."""
        if self.classes is None:
            return
        wanted = deviceclasses.namespaces_with_devices(d for store in self.indices[NODE_DEVICES].values() for d in store)
        live = deviceclasses.live_classes(self.indices[DEVICE_CLASSES])
        apply, delete = deviceclasses.plan(wanted, live)
        for namespace in apply:
            with metrics.write(deviceclasses.PLURAL, "apply"):
                await self.classes.apply(deviceclasses.body(namespace), OPERATOR_MANAGER)
            self.writes += 1
            log.info("applied DeviceClass %s: %s", deviceclasses.class_name(namespace), deviceclasses.selects(namespace))
        for name in delete:
            with metrics.write(deviceclasses.PLURAL, "delete") as counted:
                counted.status(await self.classes.delete(name))
            self.writes += 1
            log.info("deleted DeviceClass %s: its namespace has no device handed out any more", name)

    async def sync_kubevirt(self) -> None:
        config = self.config()
        if config is None:
            metrics.allow_list(valid=False)
            return  # without the platform values, KubeVirt is not ours to manage
        started = time.perf_counter()
        found = _values(self.indices.get(KUBEVIRTS), kubevirt_sync.kubevirt_target(config.spec))
        kubevirt = found[0] if found else None
        node_devices = {d.name: d for store in self.indices[NODE_DEVICES].values() for d in store}
        assigned = kubevirt_sync.assigned_devices((d for store in self.indices[DEVICES].values() for d in store), node_devices)
        advertised = kubevirt_sync.advertised(node_devices.values())
        if (config.spec.get("dra") or {}).get("perNode") is True:
            assigned, advertised = kubevirt_sync.on_device_plugin_nodes(assigned, advertised, node_devices, self.through_dra)
        plan = kubevirt_sync.plan_sync(config, kubevirt, assigned, advertised,
                                       self.last_good, datetime.datetime.now(datetime.UTC))
        self._sync_cost = time.perf_counter() - started
        if plan.rendered is not None:
            self.last_good = plan.rendered
        self.settings_changed()  # the models KubeVirt serves itself may have changed
        if plan.problems and plan.problems != self._problems_logged:
            log.warning("the PassthroughConfig is invalid, KubeVirt keeps the last good configuration: %s", "; ".join(plan.problems))
        self._problems_logged = plan.problems
        metrics.allow_list(not plan.problems, plan.not_permitted, plan.not_advertised, len(plan.left_out))
        # Devices whose allow-list entry came or went, or is missing for another reason now, decide
        # again: their Assigned condition says so.
        for name in set(plan.unapplied) | set(self.unapplied):
            if plan.unapplied.get(name) == self.unapplied.get(name):
                continue
            if name in plan.left_out:
                log.warning("KubeVirt's allow-list leaves out assigned device %s, the rest is applied: %s", name, plan.left_out[name])
            self.enqueue(name)
        self.unapplied = plan.unapplied
        expectations = []
        if plan.apply is not None:
            with metrics.write("kubevirts", "apply"):  # applies and failures: by code
                written = await self.kubevirts.apply(plan.apply, OPERATOR_MANAGER)
            self.writes += 1
            log.info("applied permittedHostDevices and feature gates to KubeVirt %s/%s",
                     written["metadata"]["namespace"], written["metadata"]["name"])
            expectations.append(("kubevirt", written["metadata"]["namespace"], written["metadata"]["name"],
                                  written["metadata"]["resourceVersion"]))
        if plan.remove_block and kubevirt is not None:
            # Another manager's block: a merge patch that removes it, whoever owns it (an apply
            # lets go only of what this manager owns).
            with metrics.write("kubevirts", "patch"):
                # As of the version decided on: a block changed since is decided on again (409, retried).
                precondition = {"resourceVersion": kubevirt.resource_version} if kubevirt.resource_version else {}
                written = await self.kubevirts.session.request(
                    "PATCH", self.kubevirts.path(kubevirt.name, kubevirt.namespace), content_type=MERGE_PATCH,
                    body={"metadata": precondition, "spec": {"configuration": {"permittedHostDevices": None}}})  # fmt: skip
            self.writes += 1
            log.info("removed the permittedHostDevices block another manager wrote to KubeVirt %s/%s (%s): the values' "
                     "allow-list is empty", kubevirt.namespace, kubevirt.name, plan.remove_block)  # fmt: skip
            expectations.append(("kubevirt", kubevirt.namespace, kubevirt.name, written["metadata"]["resourceVersion"]))
        if plan.status is not None:
            with metrics.write("passthroughconfigs/status", "apply"):
                written = await self.configs.apply(plan.status, OPERATOR_MANAGER, status=True)
            self.writes += 1
            expectations.append(("config", "", CONFIG_NAME, written["metadata"]["resourceVersion"]))
        involved = {"api_version": API_VERSION, "kind": PASSTHROUGH_CONFIG.kind, "name": config.name, "uid": config.uid}
        expectations += await self._release_others(config, plan)
        for type_, reason, message in plan.events:
            self.events.post(involved, type_, reason, message)
        if expectations:
            await self._wait_for(KUBEVIRT, lambda: all(self._config_seen(*e) for e in expectations))

    async def _release_others(self, config: kubevirt_sync.ConfigView, plan: kubevirt_sync.SyncPlan) -> list[tuple[str, str, str, str]]:
        """Let go of the KubeVirt CRs the values no longer name (spec.kubevirt pointed elsewhere):
        our allow-lists, our gates and their record go from them (see kubevirt_sync.release)."""
        target = kubevirt_sync.kubevirt_target(config.spec)
        recorded = list(config.status.get("featureGates") or [])
        expectations = []
        for key, store in list((self.indices.get(KUBEVIRTS) or {}).items()):
            for view in list(store)[:1]:
                body = kubevirt_sync.release(view, recorded) if key != target else None
                if body is None:
                    continue
                with metrics.write("kubevirts", "apply"):
                    written = await self.kubevirts.apply(body, OPERATOR_MANAGER)
                self.writes += 1
                log.info("let go of KubeVirt %s/%s: the PassthroughConfig names %s/%s now", view.namespace, view.name, *target)
                plan.events.append(("Normal", "Released", f"Let go of KubeVirt {view.namespace}/{view.name} (its allow-list and "
                                    f"our feature gates): spec.kubevirt names {'/'.join(target)} now."))  # fmt: skip
                expectations.append(("kubevirt", view.namespace, view.name, written["metadata"]["resourceVersion"]))
        return expectations

    def _config_seen(self, what: str, namespace: str, name: str, rv: str) -> bool:
        if what == "kubevirt":
            found = _values(self.indices.get(KUBEVIRTS), (namespace, name))
        else:
            found = _values(self.indices.get(CONFIGS), name)
        return bool(found) and _rv(found[0].resource_version) >= _rv(rv)

    def _satisfied(self, name: str, expectation: tuple[str, str, str]) -> bool:
        what, namespace, rv = expectation
        if what.startswith("node-device"):
            found = _values(self.indices[NODE_DEVICES], name)
            if what == "node-device-gone":
                return not found or found[0].deleting
            return bool(found) and _rv(found[0].resource_version) >= _rv(rv)
        found = [d for d in _values(self.indices[DEVICES], name) if d.namespace == namespace]
        if what == "device-gone":
            return not found or found[0].deleting
        return bool(found) and _rv(found[0].resource_version) >= _rv(rv)

    async def _wait_until_seen(self, name: str, expectations: list) -> None:
        await self._wait_for(name, lambda: all(self._satisfied(name, e) for e in expectations))

    async def _wait_for(self, key: Hashable, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            waiter = loop.create_future()
            waiting = self._waiters.setdefault(key, [])
            waiting.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                log.debug("the watch has not shown our writes after %.0fs; deciding again anyway", timeout)
                return
            finally:
                if waiter in waiting:
                    waiting.remove(waiter)
                    if not waiting and self._waiters.get(key) is waiting:
                        del self._waiters[key]

    def _post(self, name: str, world: World, event: Event, made: Mapping[str, str] | None = None) -> None:
        if event.kind == NODE_PCI_DEVICE.kind:
            uid = world.node_device.uid if world.node_device else ""
            involved = {"api_version": API_VERSION, "kind": event.kind, "name": name, "uid": uid}
        else:
            # A PCIDevice this reconcile made has its uid only in the write's answer: without
            # it, `kubectl describe pci` would not show the Event that says it was made.
            devices = [d for d in world.devices if d.namespace == event.namespace]
            involved = {"api_version": API_VERSION, "kind": event.kind, "name": name, "namespace": event.namespace}
            uid = (made or {}).get(event.namespace) or (devices[0].uid if devices else "")
            if uid:
                involved["uid"] = uid
        self.events.post(involved, event.type, event.reason, event.message)
