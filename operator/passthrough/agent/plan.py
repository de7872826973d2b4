"""What a node should look like for passthrough: which IOMMU groups go to vfio-pci, which go
back to their drivers, and which resources the device plugins serve.

A pure function of one scan, the node's assignments and its labels; `agent.handover` carries
the plan out. The rules:

- A device goes to vfio-pci when it is eligible and either assigned to a namespace, or a GPU
  of a pool vendor on a node in GPU passthrough mode (and the agent serves pools). Its whole
  IOMMU group goes with it (VFIO hands a group to one VM), bridges excepted.
- A group goes back when no member is wanted, but only members the agent itself put on
  vfio-pci (`ours`, its record on the node): a device an admin bound statically
  (`vfio-pci.ids=` on the kernel command line, driverctl) stays where it is.
- A group with a write still in flight (`locked`: the kernel has not finished it) is left
  alone until the write returns.
- Resources: every assigned device bound to vfio-pci is `passthrough.io/<object name>`
  (count 1); every other pool GPU bound to vfio-pci is in its model's pool. A pool stays
  served with no device while the node has GPUs of that model, so the kubelet shows 0
  rather than a stale count when all of them are assigned.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from passthrough.pci.discovery import BRIDGE_CLASS, Device
from passthrough.pci.naming import exclusive_resource_name
from passthrough.pci.vfio import VFIO_DRIVER

# A node is in GPU passthrough mode when it carries either label: ours, or the one NVIDIA's
# GPU Operator uses, so clusters set up for its sandbox workloads need no relabelling.
GPU_MODE_LABELS = {"passthrough.io/gpu-passthrough": "true", "nvidia.com/gpu.workload.config": "vm-passthrough"}


def gpu_mode(labels: Mapping[str, str] | None) -> bool:
    return any((labels or {}).get(key) == value for key, value in GPU_MODE_LABELS.items())


@dataclass(frozen=True)
class Plan:
    bind: dict[int, tuple[str, ...]] = field(default_factory=dict)  # group -> members to put on vfio-pci
    release: dict[int, tuple[str, ...]] = field(default_factory=dict)  # group -> members to give back
    wanted: frozenset[str] = frozenset()  # addresses of the devices asked for (not their group siblings)


@dataclass(frozen=True)
class Served:
    """One device as a plugin serves it (health is the plugin manager's to watch)."""

    address: str
    iommu_group: int
    numa_node: int


def _members(devices: Iterable[Device]) -> dict[int, list[Device]]:
    groups: dict[int, list[Device]] = {}
    for device in devices:
        if device.iommu_group >= 0 and device.class_code[:2] != BRIDGE_CLASS:
            groups.setdefault(device.iommu_group, []).append(device)
    return groups


def wanted(device: Device, assigned: str, in_gpu_mode: bool, serve_pools: bool) -> bool:
    if not (device.reported and device.eligible):
        return False
    return bool(assigned) or bool(device.resource_name and in_gpu_mode and serve_pools)


def plan(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    serve_pools: bool = True,
    ours: Container[str] = frozenset(),
    locked: Container[str] = frozenset(),
) -> Plan:
    """`assignments`: object name -> assigned namespace; `names`: address -> object name;
    `ours`: the addresses the agent moved to vfio-pci itself; `locked`: those with a write in flight."""
    devices = list(devices)
    want = frozenset(
        d.address for d in devices if wanted(d, assignments.get(names.get(d.address, ""), ""), in_gpu_mode, serve_pools)
    )
    bind: dict[int, tuple[str, ...]] = {}
    release: dict[int, tuple[str, ...]] = {}
    for group, members in sorted(_members(devices).items()):
        if any(m.address in locked for m in members):
            continue
        if any(m.address in want for m in members):
            bind[group] = tuple(sorted(m.address for m in members))
            continue
        mine = tuple(sorted(m.address for m in members if m.address in ours and m.driver == VFIO_DRIVER))
        if mine:
            release[group] = mine
    return Plan(bind=bind, release=release, wanted=want)


def resources(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    serve_pools: bool = True,
    failed: Iterable[str] = (),
) -> dict[str, tuple[Served, ...]]:
    """Resource name -> the devices its plugin serves, from a scan made after binding.

    `failed`: addresses whose group could not be bound; they are served by nobody.
    """
    failed = set(failed)
    served: dict[str, list[Served]] = {}
    for device in sorted(devices, key=lambda d: d.address):
        if not device.reported or not device.eligible:
            continue
        name = names.get(device.address, "")
        assigned = assignments.get(name, "")
        pooled = bool(device.resource_name and in_gpu_mode and serve_pools)
        if pooled:
            served.setdefault(device.resource_name, [])  # the pool exists even when all are assigned
        if device.driver != VFIO_DRIVER or device.address in failed:
            continue
        if assigned:
            served.setdefault(exclusive_resource_name(name), []).append(_served(device))
        elif pooled:
            served[device.resource_name].append(_served(device))
    return {resource: tuple(items) for resource, items in served.items()}


def _served(device: Device) -> Served:
    return Served(address=device.address, iommu_group=device.iommu_group, numa_node=device.numa_node)
