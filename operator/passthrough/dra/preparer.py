"""Which claim may have which device here, and each device's whole IOMMU group on vfio-pci for
it: the DRA driver's preparing and unpreparing of claims (the CDI spec and metadata files they
leave, `dra.prepared`'s checkpoint), the judge every claim meets (the device's namespace, its
health, no adminAccess, one claim per group), the binds it asks of the binder (each recorded as
intended first) and the give-back of what nothing needs any more."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from passthrough.agent.bound import Bound
from passthrough.dra import cdi
from passthrough.dra import slice as dra_slice
from passthrough.dra.elsewhere import OtherServers
from passthrough.dra.healthwatch import HealthWatch
from passthrough.dra.kubeletapi.dra_v1 import api_pb2 as dra
from passthrough.dra.prepared import PreparedClaim, holder, load_checkpoint, remove_files, save_checkpoint, write_files
from passthrough.kube.client import ApiError
from passthrough.pci import vfio
from passthrough.pci.binder import Binder
from passthrough.pci.discovery import BRIDGE_CLASS, Discovery
from passthrough.pci.vfio import BindError

log = logging.getLogger(__name__)

DRIVER = dra_slice.DRIVER
# Seconds a device whose group would not go to vfio-pci stays tainted VFIOBindFailed:NoSchedule:
# long enough for the scheduler's next try to take another device, then it is offered again.
BIND_FAILED_HOLD = 300.0


class Preparer:
    def __init__(self, session: Any, node_name: str, sysfs_root: Path, dev_root: Path, plugin_dir: Path, cdi_dir: Path,
                 binder: Binder, health: HealthWatch, others: OtherServers, bind_timeout: float,
                 trigger: Callable[[], None]) -> None:  # fmt: skip
        self.session, self.node_name = session, node_name
        self.sysfs_root, self.dev_root, self.plugin_dir, self.cdi_dir = sysfs_root, dev_root, plugin_dir, cdi_dir
        self.binder, self.health, self.others, self.bind_timeout, self.trigger = binder, health, others, bind_timeout, trigger
        self.bound = Bound(plugin_dir)
        self.prepared: dict[str, PreparedClaim] = load_checkpoint(plugin_dir)
        self.inventory: dict[str, dra_slice.Published] = {}  # slice device name -> what it is, as last published
        self.discovery: Discovery | None = None  # the last pass's
        self.bind_failed: dict[str, float] = {}  # address -> when its group would not go to vfio-pci (monotonic)
        self.lock = asyncio.Lock()  # prepare, unprepare, binding answers and give-back one at a time
        self.on_drivers_moved: Callable[[], None] | None = None  # the agent's trigger: its report rescans

    def prepared_devices(self) -> list[dict[str, Any]]:
        return [device for claim in self.prepared.values() for device in claim.devices]

    async def elsewhere_now(self) -> dict[str, BindError]:
        """What other servers have, asked again: a plugin may have registered since the last pass."""
        return await self.others.now(self.discovery)

    async def prepare(self, namespace: str, name: str, uid: str) -> list[dra.Device]:
        """The devices the kubelet hands the claim's containers (CDI names); PrepareError saying why not."""
        async with self.lock:
            if uid in self.prepared:  # a retry, or the kubelet restarted: the same answer
                return [_device_message(d) for d in self.prepared[uid].devices]
            claim = await self._claim(namespace, name, uid)
            results = [r for r in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
                       if r.get("driver") == DRIVER and r.get("pool") == self.node_name]  # fmt: skip
            if not results:
                raise PrepareError(f"claim {namespace}/{name} has no device of {DRIVER} on node {self.node_name} allocated")
            elsewhere = await self.elsewhere_now()
            chosen = [(result, self.judge(namespace, uid, result.get("device", ""), bool(result.get("adminAccess")), elsewhere))
                      for result in results]  # fmt: skip
            await self.bind_groups([item for _, item in chosen])
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

    def judge(self, namespace: str, uid: str, device: str, admin_access: bool, elsewhere: dict[str, BindError]) -> dra_slice.Published:
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

    async def bind_groups(self, items: Iterable[dra_slice.Published]) -> list[tuple[int, list[str]]]:
        """The whole IOMMU group of each device on vfio-pci (a no-op for a group already there);
        the groups and their members. PrepareError (with `.group`) when one would not move."""
        groups = self.groups()
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

    async def _claim(self, namespace: str, name: str, uid: str) -> dict[str, Any]:
        try:
            claim = await self.session.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
        except ApiError as exc:
            raise PrepareError(f"cannot read claim {namespace}/{name}: {exc.status} {exc.reason}") from None
        if claim["metadata"].get("uid") != uid:
            raise PrepareError(f"claim {namespace}/{name} was replaced (uid {claim['metadata'].get('uid')}, not {uid})")
        return claim

    async def unprepare(self, uid: str) -> None:
        async with self.lock:
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

    def _cdev(self, address: str) -> str:
        return vfio.iommufd_device(self.sysfs_root, self.dev_root, address)

    async def give_back(self, published: list[dra_slice.Published], keep: list[dra_slice.Published] = ()) -> None:
        """Groups this driver bound that nothing published and no prepared claim needs: back to
        their drivers. `keep`: withdrawn for their health, left as they are (an unbind of a device
        that fell off the bus is no give-back)."""
        needed = {p.device.iommu_group for p in [*published, *keep]}
        needed |= {d["iommu_group"] for claim in self.prepared.values() for d in claim.devices}
        async with self.lock:  # no bind in flight: its members are intended, not yet settled
            self.bound.add(self.binder.take_late_moved())  # a write past its deadline that returned moved these
            self.bound.settle(self.sysfs_root)  # binds whose answer was lost (a restart mid-write), from the driver links
            if not self.bound.devices or self.discovery is None:
                return
            for group, members in sorted(self.groups().items()):
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

    def groups(self) -> dict[int, list[str]]:
        """IOMMU group -> its non-bridge members, from the last discovery."""
        groups: dict[int, list[str]] = {}
        for device in self.discovery.devices if self.discovery else ():
            if device.iommu_group >= 0 and device.class_code[:2] != BRIDGE_CLASS:
                groups.setdefault(device.iommu_group, []).append(device.address)
        return groups

    def bind_failed_now(self) -> list[str]:
        """The devices still tainted for a failed bind; those past BIND_FAILED_HOLD are offered again."""
        cutoff = time.monotonic() - BIND_FAILED_HOLD
        for address in [a for a, when in self.bind_failed.items() if when <= cutoff]:
            del self.bind_failed[address]
            log.info("%s is offered again, untainted, %.0fs after its group would not go to vfio-pci", address, BIND_FAILED_HOLD)
        return sorted(self.bind_failed)


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
