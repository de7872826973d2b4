"""Carries out a node's plan: binds IOMMU groups to vfio-pci, gives them back once nothing holds
them, and tells the device plugins what to serve.

The sysfs sequences are `pci.vfio`'s, run by `pci.binder` in a child process under a deadline,
since a write the kernel cannot finish blocks. So nothing is unbound while it is held: a group
to give back is first withdrawn from the kubelet (the caller serves without it), then the
kubelet's PodResources is asked which pods hold it, then the binder looks whether a process holds
it (a member's sysfs `enable` count, or `/dev/vfio/<group>` taken: `vfio.held_by_process`), and
only then unbinds; what the binder cannot tell is kept too. When PodResources cannot be asked,
nothing is given back: a device a pod holds must never be pulled from under its VM.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from passthrough.agent import metrics
from passthrough.agent.bound import Bound
from passthrough.agent.plan import Plan, Served
from passthrough.deviceplugin.allocation import PluginDevice
from passthrough.deviceplugin.holder import Holder
from passthrough.pci.binder import DEADLINE, Binder
from passthrough.pci.discovery import Device
from passthrough.pci.health import Health
from passthrough.pci import vfio
from passthrough.pci.vfio import BindError

if TYPE_CHECKING:  # the module itself loads gRPC, for an agent that serves device plugins only
    from passthrough.deviceplugin.podresources import KubeletView

log = logging.getLogger(__name__)

# Reasons that mean "waiting for someone else", not "something failed": Normal Events.
WAITING = frozenset({"HeldByPod", "HeldByProcess"})
# Give-backs refused before any write: the group stays on vfio-pci and is looked at again.
# HeldUnknown (the binder cannot tell whether something holds it) is a Warning: the node's
# shape is wrong, and nothing is given back until it is right.
KEPT = frozenset({"HeldByProcess", "HeldUnknown"})

HEALTH_INTERVAL = 0.25  # seconds between reads of the served devices' health: Unhealthy within a second
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass
class Outcome:
    writes: int = 0
    bound: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups moved to vfio-pci by this pass
    released: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups given back by this pass
    failures: dict[str, BindError] = field(default_factory=dict)  # address -> why its group could not be bound
    release_failures: dict[str, BindError] = field(default_factory=dict)
    held: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups kept on vfio-pci for their holder
    waiting: dict[str, BindError] = field(default_factory=dict)  # address -> who holds it (HeldByPod/Process)
    overrides: dict[str, BindError] = field(default_factory=dict)  # address -> its override names a missing driver
    others: dict[str, BindError] = field(default_factory=dict)  # address -> another plugin serves it
    unhealthy: dict[str, str] = field(default_factory=dict)  # address -> why a served device cannot be used now

    def problems(self) -> dict[str, BindError]:
        """Address -> what keeps it from being served, the most pressing when there are several."""
        found = {**self.overrides, **self.others, **self.release_failures, **self.waiting}
        found.update((a, BindError("Unhealthy", why)) for a, why in self.unhealthy.items())
        found.update(self.failures)
        return found


class Handover:
    def __init__(
        self,
        sysfs_root: Path,
        dev_root: Path = Path("/dev"),
        plugin_dir: Path = DEVICE_PLUGIN_DIR,
        pod_resources_socket: Path = POD_RESOURCES_SOCKET,
        serve_pools: bool = True,
        bind_timeout: float = 5.0,
        state_dir: Path | None = None,
        write_deadline: float = DEADLINE,
        binder_sockets: Sequence[Path] = (),
    ) -> None:
        self.sysfs_root, self.dev_root = Path(sysfs_root), Path(dev_root)
        self.pod_resources_socket = Path(pod_resources_socket)
        self.serve_pools = serve_pools
        self.bind_timeout = bind_timeout
        self.bound = Bound(state_dir)
        self.binder = Binder(write_deadline, on_finished=self._wake, sockets=binder_sockets)
        self.health = Health(self.sysfs_root, self.dev_root)
        self.unhealthy: dict[str, str] = {}  # address -> why, as the plugins last reported it
        self.on_change = None  # called when a late write returns or a served device's health flips
        # gRPC (10 MiB of an agent's memory) is imported by an agent that serves device plugins only.
        from passthrough.deviceplugin.manager import PluginManager

        self.plugins = PluginManager(Path(plugin_dir), health=self._healthy, admit=self._admit)
        self.admit = None  # the agent's judge of who asks for a device (`Agent.admit`)
        self._pod_resources: Any = None  # podresources.Asker, made at the first look (gRPC imported then)

    def _wake(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def _healthy(self, device: PluginDevice) -> bool:
        return device.id not in self.unhealthy  # as `_watch_health` last read it: no read in the event loop

    async def _check(self, served: dict[str, int]) -> bool:
        """Read the health of the served devices (address -> IOMMU group); whether any changed.
        A change asks for a scan, which reports it on the device's object."""
        problems = await self.health.problems(served)
        changed = False
        for address, problem in problems.items():
            if problem != self.unhealthy.get(address, ""):
                changed = True
                if problem:
                    self.unhealthy[address] = problem
                else:
                    self.unhealthy.pop(address, None)
        if changed:
            self._wake()
        return changed

    async def _watch_health(self) -> None:
        while True:
            served = {d.id: d.iommu_group for name in self.plugins.resources for d in self.plugins.declared(name)}
            try:
                if await self._check(served):
                    self.plugins.refresh()  # to the kubelet now, not at the plugins' next health poll
            except Exception:  # never let one surprise end the health watch of the node
                log.exception("device health: unexpected error; reading again")
            await asyncio.sleep(HEALTH_INTERVAL)

    async def _admit(self, resource: str, device_ids: list[str]) -> str:
        return await self.admit(resource, device_ids) if self.admit is not None else ""

    def locked(self) -> frozenset[str]:
        """Devices with a write in flight: reading what takes their lock would wait with it."""
        return self.binder.overdue_addresses()

    async def run(self) -> None:
        watch = asyncio.create_task(self._watch_health(), name="device-health")
        try:
            await self.plugins.run()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def close(self) -> None:
        await self.plugins.close()
        await self.binder.close()

    async def carry_out(self, plan: Plan, view: KubeletView | None = None) -> Outcome:
        """`view`: the kubelet's answer of this scan (`look`); None when it could not be asked."""
        outcome = Outcome()
        self.bound.add(self.binder.take_late_moved())  # a write past its deadline that returned moved these
        self.bound.settle(self.sysfs_root)  # binds whose answer was lost (a restart mid-write), from the driver links
        for group, late in self.binder.overdue.items():
            for address in late.members:
                outcome.failures[address] = BindError("WriteBlocked", late.message(self.binder.deadline))
        for group, members in plan.bind.items():
            self.bound.intend(self.sysfs_root, members)
            try:
                writes, moved = await self.binder.bind(self.sysfs_root, self.dev_root, group, list(members), self.bind_timeout)
            except BindError as exc:
                self.bound.add(getattr(exc, "moved", {}))  # a rollback that failed left these on vfio-pci
                metrics.BIND_FAILURES.labels(exc.reason).inc()
                for address in members:
                    outcome.failures[address] = exc
                continue
            self.bound.add(moved)
            outcome.writes += writes
            if writes:  # already on vfio-pci costs nothing and is no news
                metrics.BINDS.inc()
                outcome.bound[group] = members
        if plan.release:
            await self._release(plan, outcome, view.holders if view is not None else None)
        return outcome

    async def _release(self, plan: Plan, outcome: Outcome, holders: dict[str, tuple[Holder, ...]] | None) -> None:
        for group, members in plan.release.items():
            held = _held_by_pods(members, holders)
            if held is not None:
                outcome.held[group] = members
                for address in members:
                    outcome.waiting[address] = held
                continue
            try:
                overrides = {a: self.bound.devices.get(a, "") for a in members}
                outcome.writes += await self.binder.release(
                    self.sysfs_root, self.dev_root, group, list(members), self.bind_timeout, overrides
                )
            except BindError as exc:
                if exc.reason in KEPT:
                    outcome.held[group] = members
                    for address in members:
                        outcome.waiting[address] = exc
                    continue
                metrics.GIVE_BACK_FAILURES.labels(exc.reason).inc()
                for address in members:
                    outcome.release_failures[address] = exc
                continue
            self.bound.remove(members)
            metrics.GIVE_BACKS.inc()
            outcome.released[group] = members

    async def look(self) -> KubeletView | None:
        """Which pods hold which device, and what every plugin serves; None when the kubelet cannot say."""
        if self._pod_resources is None:
            from passthrough.deviceplugin.podresources import Asker

            self._pod_resources = Asker(self.pod_resources_socket, "giving nothing back until the kubelet answers")
        return await self._pod_resources.ask()

    def override_problems(self, devices: tuple[Device, ...]) -> dict[str, BindError]:
        """Devices left without a driver because their `driver_override` names one that is not
        loaded (the kernel's probe succeeds and binds nothing): say so, with what to do."""
        drivers = self.sysfs_root / "bus" / "pci" / "drivers"
        found = {}
        for device in devices:
            override = device.driver_override
            if device.reported and not device.driver and override and not os.path.isdir(drivers / override):
                found[device.address] = BindError(
                    "OverrideDriverMissing",
                    f"{device.address} has no driver: its driver_override names {override}, which is not loaded. "
                    f"Load it (modprobe {override}) or clear the override (echo > /sys/bus/pci/devices/{device.address}"
                    "/driver_override, or driverctl unset-override)",
                )
        return found

    async def serve(self, resources: dict[str, tuple[Served, ...]]) -> None:
        served = {s.address: s.iommu_group for devices in resources.values() for s in devices}
        for address in set(self.unhealthy) - set(served):
            del self.unhealthy[address]  # health is watched only while a device is served
        await self._check(served)
        await self.plugins.set_resources(
            {
                name: [
                    PluginDevice(id=s.address, iommu_group=s.iommu_group, numa_node=s.numa_node,
                                 healthy=s.address not in self.unhealthy, cdev=self._cdev(s.address))
                    for s in served
                ]
                for name, served in resources.items()
            }
        )

    def _cdev(self, address: str) -> str:
        return vfio.iommufd_device(self.sysfs_root, self.dev_root, address)


def served_elsewhere(view: KubeletView | None, ours: list[str]) -> dict[str, str]:
    """Address -> the resource another device plugin serves it under (NVIDIA's sandbox plugin,
    KubeVirt's own, SR-IOV's): not ours to bind or serve."""
    if view is None:
        return {}
    found: dict[str, str] = {}
    for device, resources in view.allocatable.items():
        theirs = sorted(r for r in resources if r not in ours)
        if theirs:
            found[device] = ", ".join(theirs)
    return found


def held_elsewhere(address: str, holders: tuple[Holder, ...]) -> BindError:
    pods = ", ".join(sorted(str(h) for h in holders))
    return BindError("HeldByPod", f"{pods} still holds {address} under its previous resource or namespace: nobody else "
                     "gets it until that pod ends, then it is served where it now belongs")  # fmt: skip


def other_plugin(address: str, resource: str) -> BindError:
    return BindError(
        "ServedByOtherPlugin",
        f"{address} is served by another device plugin as {resource} (NVIDIA's sandbox plugin, KubeVirt's own, SR-IOV's): "
        "one device, one server, so this agent neither binds nor serves it. Leave it to that plugin, or stop it serving "
        "this device (for NVIDIA's plugin: --no-pool-resources here is the coexistence mode; the GPU pools page of the "
        "manual, docs/tasks/gpu-pools.md, says how)",
    )


def _held_by_pods(members: tuple[str, ...], holders: dict[str, tuple[Holder, ...]] | None) -> BindError | None:
    if holders is None:
        return BindError("HeldByPod", "the kubelet's PodResources API cannot be asked which pods hold it, so it is "
                         "kept on vfio-pci; it is given back once the kubelet answers and no pod holds it")  # fmt: skip
    pods = sorted({str(h) for a in members for h in holders.get(a, ())})
    if not pods:
        return None
    return BindError("HeldByPod", f"{', '.join(pods)} holds it: it is given back once that pod ends")
