"""Carries out a node's plan: binds IOMMU groups to vfio-pci, gives them back once no pod
holds them, and tells the device plugins what to serve.

The sysfs sequences are `pci.vfio`'s (blocking, so they run in a thread); which pods hold
which devices comes from the kubelet's PodResources API. When that cannot be asked, nothing
is given back: a device a pod holds must never be pulled from under its VM.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

from passthrough.agent import metrics
from passthrough.agent.plan import Plan, Served
from passthrough.deviceplugin.allocation import PluginDevice
from passthrough.pci import vfio
from passthrough.pci.vfio import BindError

log = logging.getLogger(__name__)

DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


@dataclass
class Outcome:
    writes: int = 0
    bound: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups moved to vfio-pci by this pass
    released: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups given back by this pass
    failures: dict[str, BindError] = field(default_factory=dict)  # address -> why its group could not be bound
    release_failures: dict[str, BindError] = field(default_factory=dict)
    held: dict[int, tuple[str, ...]] = field(default_factory=dict)  # groups kept on vfio-pci for a pod


class Handover:
    def __init__(
        self,
        sysfs_root: Path,
        dev_root: Path = Path("/dev"),
        plugin_dir: Path = DEVICE_PLUGIN_DIR,
        pod_resources_socket: Path = POD_RESOURCES_SOCKET,
        serve_pools: bool = True,
        bind_timeout: float = 5.0,
    ) -> None:
        self.sysfs_root, self.dev_root = Path(sysfs_root), Path(dev_root)
        self.pod_resources_socket = Path(pod_resources_socket)
        self.serve_pools = serve_pools
        self.bind_timeout = bind_timeout
        # gRPC (10 MiB of an agent's memory) is imported by an agent that serves device plugins only.
        from passthrough.deviceplugin.manager import PluginManager

        self.plugins = PluginManager(Path(plugin_dir), health=self._healthy)
        self._unavailable_logged = False

    def _healthy(self, device: PluginDevice) -> bool:
        return vfio.device_healthy(self.sysfs_root, self.dev_root, device.id, device.iommu_group)

    async def run(self) -> None:
        await self.plugins.run()

    async def close(self) -> None:
        await self.plugins.close()

    async def carry_out(self, plan: Plan) -> Outcome:
        outcome = Outcome()
        for group, members in plan.bind.items():
            try:
                writes = await asyncio.to_thread(
                    vfio.bind_group, self.sysfs_root, self.dev_root, group, list(members), self.bind_timeout
                )
            except BindError as exc:
                metrics.BIND_FAILURES.labels(exc.reason).inc()
                for address in members:
                    outcome.failures[address] = exc
                continue
            outcome.writes += writes
            if writes:  # already on vfio-pci costs nothing and is no news
                metrics.BINDS.inc()
                outcome.bound[group] = members
        if plan.release:
            held = await self._held()
            for group, members in plan.release.items():
                if held is None or held & set(members):
                    outcome.held[group] = members
                    continue
                try:
                    outcome.writes += await asyncio.to_thread(
                        vfio.release_group, self.sysfs_root, group, list(members), self.bind_timeout
                    )
                except BindError as exc:
                    metrics.GIVE_BACK_FAILURES.labels(exc.reason).inc()
                    for address in members:
                        outcome.release_failures[address] = exc
                    continue
                metrics.GIVE_BACKS.inc()
                outcome.released[group] = members
        return outcome

    async def _held(self) -> set[str] | None:
        """Every device id any pod holds, of any resource; None when the kubelet cannot say."""
        from passthrough.deviceplugin.podresources import PodResourcesUnavailable, held_devices

        try:
            held = await held_devices(self.pod_resources_socket)
        except PodResourcesUnavailable as exc:
            if not self._unavailable_logged:
                self._unavailable_logged = True
                log.warning("cannot tell which devices pods hold (%s); giving nothing back until the kubelet answers", exc)
            return None
        self._unavailable_logged = False
        return set().union(*held.values()) if held else set()

    async def serve(self, resources: dict[str, tuple[Served, ...]]) -> None:
        await self.plugins.set_resources(
            {
                name: [
                    PluginDevice(id=s.address, iommu_group=s.iommu_group, numa_node=s.numa_node,
                                 healthy=vfio.device_healthy(self.sysfs_root, self.dev_root, s.address, s.iommu_group))
                    for s in served
                ]
                for name, served in resources.items()
            }
        )
