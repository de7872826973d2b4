"""Carries out `lifecycle.decide` for one device name at a time.

Kopf's handlers only enqueue names; workers here build the device's `World` from Kopf's
indexes, decide, write, and wait until the indexes have seen their own writes, so the next
decision for that name never acts on a state older than what it just wrote.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from passthrough.api.models import API_VERSION, NODE_PCI_DEVICE, PCI_DEVICE
from passthrough.controller import lifecycle
from passthrough.controller.workqueue import WorkQueue, run_workers
from passthrough.k8s import OPERATOR_MANAGER, Custom, EventRecorder
from passthrough.pci.naming import exclusive_resource_name

log = logging.getLogger(__name__)

# Index names, as the handlers module registers them.
NODE_DEVICES = "node_devices"
DEVICES = "devices"
VM_REFERENCES = "vm_references"
NAMESPACES = "namespaces"
CONFIGS = "configs"


def _values(index: Mapping[Any, Any] | None, key: Any) -> list[Any]:
    if index is None:
        return []
    store = index.get(key)
    return list(store) if store is not None else []


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
        self.events = EventRecorder(api, OPERATOR_MANAGER)
        self.queue = WorkQueue()
        self.workers = workers
        self._seen = asyncio.Condition()
        self.writes = 0

    # -- inputs ----------------------------------------------------------------------------

    def enqueue(self, name: str) -> None:
        self.queue.add(name)

    async def observed(self) -> None:
        """An index changed: wake reconciles waiting to see their own writes."""
        async with self._seen:
            self._seen.notify_all()

    def grace(self) -> datetime.timedelta:
        for seconds in _values(self.indices.get(CONFIGS), "cluster"):
            if seconds is not None:
                return datetime.timedelta(seconds=seconds)
        return self.default_grace

    def world(self, name: str) -> lifecycle.World:
        node_devices = _values(self.indices[NODE_DEVICES], name)
        devices = tuple(sorted(_values(self.indices[DEVICES], name), key=lambda d: d.namespace))
        resource = exclusive_resource_name(name)
        namespaces = {ns for ns in [d.namespace for d in devices]}
        if node_devices and node_devices[0].assigned_namespace:
            namespaces.add(node_devices[0].assigned_namespace)
        vm_index = self.indices.get(VM_REFERENCES)
        referencing = {ns: tuple(sorted(set(_values(vm_index, (ns, resource))))) for ns in namespaces}
        phases = {ns: phase for ns in namespaces for phase in _values(self.indices[NAMESPACES], ns)[:1]}
        return lifecycle.World(
            name=name,
            node_device=node_devices[0] if node_devices else None,
            devices=devices,
            namespaces=phases,
            referencing_vms={ns: vms for ns, vms in referencing.items() if vms},
            now=datetime.datetime.now(datetime.UTC),
            grace=self.grace(),
        )

    # -- work ------------------------------------------------------------------------------

    async def run(self) -> None:
        await run_workers(self.queue, self.reconcile, self.workers, self._retry_delay)

    def _retry_delay(self, name: Any, exc: BaseException, failures: int) -> float:
        delay = min(0.5 * 2 ** (failures - 1), 60.0)
        if isinstance(exc, ApiException):
            log.warning("reconciling %s failed (%s %s); retry %d in %.1fs", name, exc.status, exc.reason, failures, delay)
        else:  # a bug, not the weather: keep the traceback
            log.warning("reconciling %s failed; retry %d in %.1fs", name, failures, delay, exc_info=exc)
        return delay

    async def reconcile(self, name: str) -> None:
        world = self.world(name)
        plan = lifecycle.decide(world)
        expectations = []
        for write in plan.writes:
            expectation = await self._execute(name, write)
            self.writes += 1
            if expectation is not None:
                expectations.append(expectation)
        for event in plan.events:
            self._post(name, world, event)
        if plan.requeue_after is not None:
            self.queue.add_after(name, plan.requeue_after)
        if expectations:
            await self._wait_until_seen(name, expectations)

    async def _execute(self, name: str, write: Any):
        """One write; returns what the indexes must show before the name is decided again."""
        if isinstance(write, lifecycle.ApplyDevice | lifecycle.ApplyDeviceStatus):
            status = isinstance(write, lifecycle.ApplyDeviceStatus)
            obj = await self.devices.apply(write.body, OPERATOR_MANAGER, status=status)
            return _expect("device", write.namespace, obj)
        if isinstance(write, lifecycle.DeleteDevice):
            await self.devices.delete(name, write.namespace, uid=write.uid)
            log.info("deleting PCIDevice %s/%s", write.namespace, name)
            return ("device-gone", write.namespace, "")
        if isinstance(write, lifecycle.ApplyNodeDeviceFinalizer | lifecycle.ApplyNodeDeviceStatus):
            status = isinstance(write, lifecycle.ApplyNodeDeviceStatus)
            try:
                obj = await self.node_devices.apply(write.body, OPERATOR_MANAGER, status=status)
            except ApiException as exc:
                if exc.status == 404:  # deleted meanwhile: nothing left to say about it
                    return None
                raise
            return _expect("node-device", "", obj)
        if isinstance(write, lifecycle.DeleteNodeDevice):
            await self.node_devices.delete(name, uid=write.uid)
            log.info("deleted NodePCIDevice %s: unassigned and gone from its node", name)
            return ("node-device-gone", "", "")
        raise TypeError(f"unknown write {write!r}")

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

    async def _wait_until_seen(self, name: str, expectations: list, timeout: float = 10.0) -> None:
        try:
            async with asyncio.timeout(timeout):
                async with self._seen:
                    await self._seen.wait_for(lambda: all(self._satisfied(name, e) for e in expectations))
        except TimeoutError:
            log.debug("%s: the watch has not shown our writes after %.0fs; deciding again anyway", name, timeout)

    def _post(self, name: str, world: lifecycle.World, event: lifecycle.Event) -> None:
        if event.kind == NODE_PCI_DEVICE.kind:
            uid = world.node_device.uid if world.node_device else ""
            involved = {"api_version": API_VERSION, "kind": event.kind, "name": name, "uid": uid}
        else:
            devices = [d for d in world.devices if d.namespace == event.namespace]
            involved = {"api_version": API_VERSION, "kind": event.kind, "name": name, "namespace": event.namespace}
            if devices:
                involved["uid"] = devices[0].uid
        self.events.post(involved, event.type, event.reason, event.message)
