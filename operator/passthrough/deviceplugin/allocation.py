"""What a device plugin answers, as pure functions: Allocate's environment and device nodes, and
the preferred allocation (one NUMA node where possible). No gRPC here; `server` wraps these.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from passthrough.pci.naming import resource_env_name

VFIO_DIR = "/dev/vfio"


@dataclass(frozen=True)
class PluginDevice:
    """One device as a plugin serves it; `id` is its PCI address, the ID the kubelet hands back."""

    id: str  # "0000:3b:00.0"
    iommu_group: int
    numa_node: int = -1  # -1: the kernel knows no NUMA node for it
    healthy: bool = True
    cdev: str = ""  # its iommufd device (`vfio3` for /dev/vfio/devices/vfio3); "" when the kernel has none


@dataclass(frozen=True)
class DeviceNode:
    """A device node the container gets (the kubelet's DeviceSpec)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Allocation:
    """One container's share of Allocate: environment variables and device nodes."""

    envs: dict[str, str]
    devices: tuple[DeviceNode, ...]


class AllocationError(ValueError):
    """The kubelet asked for something this plugin cannot give; the message names what and why."""


def allocate_response(
    resource_name: str,
    requested_ids: Iterable[str],
    devices: Mapping[str, PluginDevice],
    vfio_dir: str = VFIO_DIR,
) -> Allocation:
    """The environment and device nodes for one container asking for `requested_ids`.

    `PCI_RESOURCE_<NAME>` lists exactly the requested addresses, in the order asked: virt-
    launcher hands them to the VM's host devices by position, so nothing else (a sibling
    function of the same IOMMU group, say) may take a slot. The container gets the vfio
    container device and each requested device's group node once; where the kernel has iommufd,
    each device's own node under `devices/` and `/dev/iommu` too (KubeVirt's IOMMUFD gate).
    """
    requested = list(requested_ids)
    if not requested:
        raise AllocationError(f"no device IDs asked for {resource_name}")
    groups: list[int] = []
    cdevs: list[str] = []
    seen: set[str] = set()
    for device_id in requested:
        if device_id in seen:
            raise AllocationError(f"device {device_id} is asked for twice in one container of {resource_name}")
        seen.add(device_id)
        device = devices.get(device_id)
        if device is None:
            raise AllocationError(f"unknown device {device_id} for {resource_name}: this plugin does not serve it")
        if not device.healthy:
            raise AllocationError(
                f"device {device_id} of {resource_name} is unhealthy: IOMMU group {device.iommu_group} cannot be passed through now"
            )
        if device.iommu_group not in groups:
            groups.append(device.iommu_group)
        if device.cdev:
            cdevs.append(device.cdev)
    base = vfio_dir.rstrip("/")
    nodes = [f"{base}/vfio"] + [f"{base}/{group}" for group in groups]
    if cdevs:
        nodes += [f"{base}/devices/{cdev}" for cdev in cdevs] + [f"{base.rsplit('/', 1)[0]}/iommu"]
    return Allocation(
        envs={resource_env_name(resource_name): ",".join(requested)},
        devices=tuple(DeviceNode(path, path, "rw") for path in nodes),
    )


def preferred_allocation(
    available: Iterable[str],
    must_include: Iterable[str],
    size: int,
    devices: Mapping[str, PluginDevice],
) -> list[str]:
    """`size` device IDs from `available`, `must_include` first, kept on one NUMA node where possible.

    The NUMA node filled first is the one holding most of `must_include`, then most of what
    is available, then the lowest number; the rest follow node by node in that order.
    Within a node, devices go by address, so equal inputs give equal answers. A device of
    unknown NUMA node (-1) counts as its own node, ranked after real ones on a tie.
    """
    must = sorted(dict.fromkeys(must_include))
    chosen = set(must)
    rest = sorted({d for d in available if d not in chosen})
    if size <= len(must):
        return must

    def node(device_id: str) -> int:
        device = devices.get(device_id)
        return device.numa_node if device is not None and device.numa_node >= 0 else -1

    must_on = Counter(node(d) for d in must)
    free_on = Counter(node(d) for d in rest)
    ranked = sorted(set(must_on) | set(free_on), key=lambda n: (-must_on[n], -free_on[n], n < 0, n))
    rank = {n: i for i, n in enumerate(ranked)}
    rest.sort(key=lambda d: (rank[node(d)], d))
    return must + rest[: size - len(must)]
