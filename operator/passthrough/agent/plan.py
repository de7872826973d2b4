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
- "Assigned" means handed out: the operator's `Assigned=True` for the namespace the spec
  names (the caller passes only those). A device waiting for its hand-out is neither bound
  nor served.
- The IOMMU group is the unit: while any member is claimed (`claimed`: a spec assignment,
  handed out or not), no member is pooled. A group with a member assigned but not handed out
  yet is left as it is: neither bound for it nor given back.
- Pods are holders: a device that a pod holds under another resource, or under its own
  exclusive resource for another namespace, is served by nobody until that pod ends
  (`Serving.blocked`), so the kubelet never hands it to a second pod or a second tenant.
- A device another device plugin serves (`others`) is not ours: neither bound, given back
  nor served.
- A node asked to give its devices back (`helm uninstall`'s pre-delete hook, `as_planned`) is
  in GPU passthrough mode no longer, and its agent hands nothing out: every group the agent
  bound goes back, a held one once its holder lets go.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from passthrough.api.labels import GIVE_BACK_LABEL
from passthrough.deviceplugin.holder import Holder
from passthrough.pci.discovery import BRIDGE_CLASS, Device
from passthrough.pci.naming import exclusive_resource_name
from passthrough.pci.vfio import VFIO_DRIVER

# A node is in GPU passthrough mode when it carries either label: ours, or the one NVIDIA's
# GPU Operator uses, so clusters set up for its sandbox workloads need no relabelling.
GPU_MODE_LABELS = {"passthrough.io/gpu-passthrough": "true", "nvidia.com/gpu.workload.config": "vm-passthrough"}


def gpu_mode(labels: Mapping[str, str] | None) -> bool:
    return any((labels or {}).get(key) == value for key, value in GPU_MODE_LABELS.items())


def giving_back(labels: Mapping[str, str] | None) -> str:
    """The token of the uninstall's request that this node give its devices back; "" when none."""
    return (labels or {}).get(GIVE_BACK_LABEL, "")


def as_planned(labels: Mapping[str, str] | None) -> dict[str, str]:
    """A Node's labels as the plan reads them: a node asked to give its devices back is in GPU
    passthrough mode no longer, so its pools go back as devices that leave passthrough do."""
    labels = dict(labels or {})
    if giving_back(labels):
        for key in GPU_MODE_LABELS:
            labels.pop(key, None)
    return labels


def mode(labels: Mapping[str, str] | None) -> tuple[bool, str]:
    """What of a Node's labels changes the plan: its GPU passthrough mode and a give-back request."""
    return gpu_mode(labels), giving_back(labels)


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


def _pool(device: Device, in_gpu_mode: bool, serve_pools: bool) -> str:
    """Its model's pool on this node, "" when the node serves none for it."""
    return device.resource_name if device.resource_name and in_gpu_mode and serve_pools else ""


def wanted(device: Device, assigned: str, in_gpu_mode: bool, serve_pools: bool) -> bool:
    """Whether the device is for passthrough, its IOMMU group left aside: assigned, or a GPU of a pool."""
    return device.reported and device.eligible and bool(assigned or _pool(device, in_gpu_mode, serve_pools))


@dataclass(frozen=True)
class Role:
    """One device the plan may move and serve (reported, eligible, served by no other plugin),
    and what it is for: the one reading of the rules that binding and serving share."""

    device: Device
    name: str  # its NodePCIDevice's name
    assigned: str  # the namespace it is handed out to; "" none
    pool: str  # its model's pool on this node ("" none): served even when every device of it is elsewhere
    resource: str  # what it is served as, and so what it goes to vfio-pci for; "" neither


def roles(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    serve_pools: bool,
    claimed: Container[str],
    others: Container[str],
) -> list[Role]:
    """The devices the plan may move, in the order given, each with what it is for (see the
    module's rules: an assigned device is its own resource; a pool GPU is in its pool unless a
    member of its IOMMU group is claimed)."""
    devices = list(devices)
    unpooled = _claimed_groups(devices, names, claimed)
    found = []
    for device in devices:
        if not (device.reported and device.eligible) or device.address in others:
            continue
        name = names.get(device.address, "")
        assigned = assignments.get(name, "")
        pool = _pool(device, in_gpu_mode, serve_pools)
        resource = exclusive_resource_name(name) if assigned else (pool if device.iommu_group not in unpooled else "")
        found.append(Role(device, name, assigned, pool, resource))
    return found


def plan(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    serve_pools: bool = True,
    ours: Container[str] = frozenset(),
    locked: Container[str] = frozenset(),
    claimed: Container[str] = frozenset(),
    others: Mapping[str, str] | None = None,
) -> Plan:
    """`assignments`: object name -> assigned namespace; `names`: address -> object name;
    `ours`: the addresses the agent moved to vfio-pci itself; `locked`: those with a write in flight."""
    devices = list(devices)
    others = others or {}
    want = frozenset(r.device.address for r in roles(devices, assignments, names, in_gpu_mode, serve_pools, claimed, others)
                     if r.resource)  # fmt: skip
    bind: dict[int, tuple[str, ...]] = {}
    release: dict[int, tuple[str, ...]] = {}
    waiting = {d.iommu_group for d in devices
               if names.get(d.address, "") in claimed and not assignments.get(names.get(d.address, ""), "")}  # fmt: skip
    for group, members in sorted(_members(devices).items()):
        if any(m.address in locked or m.address in others for m in members):
            continue
        if group in waiting and not any(m.address in want for m in members):
            # Assigned, not handed out yet: left as it is, bound or not, until the operator
            # decides (a give-back now would make it not Ready, and the hand-out waits for Ready).
            continue
        if any(m.address in want for m in members):
            # A group already on vfio-pci needs no job: the binder would write nothing, and a
            # binder away for a while (its container restarting) must not unserve what is bound.
            if any(m.driver != VFIO_DRIVER for m in members):
                bind[group] = tuple(sorted(m.address for m in members))
            continue
        mine = tuple(sorted(m.address for m in members if m.address in ours and m.driver == VFIO_DRIVER))
        if mine:
            release[group] = mine
    return Plan(bind=bind, release=release, wanted=want)


@dataclass(frozen=True)
class Serving:
    resources: dict[str, tuple[Served, ...]]  # resource name -> the devices its plugin serves
    blocked: dict[str, tuple[Holder, ...]]  # address -> the pods that keep it from its new resource


def serving(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    serve_pools: bool = True,
    failed: Iterable[str] = (),
    *,
    claimed: Container[str] = frozenset(),
    holders: Mapping[str, tuple[Holder, ...]] | None = None,
    others: Mapping[str, str] | None = None,
) -> Serving:
    """What the device plugins serve, from a scan made after binding.

    `failed`: addresses whose group could not be bound; `holders`: address -> the pods holding
    it (the kubelet's PodResources); `others`: address -> the resource another plugin serves it
    under. Devices in any of these ways unfit are served by nobody.
    """
    devices = sorted(devices, key=lambda d: d.address)
    failed, holders = set(failed), holders or {}
    served: dict[str, list[Served]] = {}
    blocked: dict[str, tuple[Holder, ...]] = {}
    for role in roles(devices, assignments, names, in_gpu_mode, serve_pools, claimed, others or {}):
        device, resource, assigned = role.device, role.resource, role.assigned
        if role.pool:
            served.setdefault(role.pool, [])  # the pool exists even when all are assigned
        if device.driver != VFIO_DRIVER or device.address in failed or not resource:
            continue
        served.setdefault(resource, [])
        elsewhere = tuple(h for h in holders.get(device.address, ()) if h.resource != resource or (assigned and h.namespace != assigned))
        if elsewhere:
            blocked[device.address] = elsewhere
            continue
        served[resource].append(_served(device))
    return Serving({resource: tuple(items) for resource, items in served.items()}, blocked)


def resources(*args, **kwargs) -> dict[str, tuple[Served, ...]]:
    """Resource name -> the devices its plugin serves (`serving`'s resources)."""
    return serving(*args, **kwargs).resources


def _claimed_groups(devices: Iterable[Device], names: Mapping[str, str], claimed: Container[str]) -> set[int]:
    """IOMMU groups with a member an admin assigned: none of their members is pooled."""
    return {d.iommu_group for d in devices if d.iommu_group >= 0 and names.get(d.address, "") in claimed}


def _served(device: Device) -> Served:
    return Served(address=device.address, iommu_group=device.iommu_group, numa_node=device.numa_node)
