"""What the DRA driver publishes: one ResourceSlice per node (resource.k8s.io/v1) listing the
devices a claim may be allocated, each with its attributes. Pure functions, as `agent.report` is
for NodePCIDevices: the driver writes only when `changed()` says so, so a rescan of unchanged
hardware and assignments costs no API write.

Which devices: the same rule as the device plugins' (`agent.plan.wanted`): a device handed out
to a namespace (the operator's Assigned=True; `passthrough.io/namespace` names it), and, on a
node in GPU passthrough mode, every other eligible GPU of a pool vendor (`passthrough.io/namespace`
empty), except in an IOMMU group with a member an admin assigned. An eligible device nobody
handed out is not published: publishing it would let any claim have a device the operator never
gave anyone, and NodePrepareResources would bind it.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from passthrough.agent.plan import wanted
from passthrough.api.labels import NODE_LABEL
from passthrough.pci.discovery import Device

DRIVER = "pci.passthrough.io"
DOMAIN = "passthrough.io"  # our attributes: passthrough.io/namespace, ...
# The standard attributes (Kubernetes' deviceattribute package): a claim aligns devices of
# several drivers by them (`matchAttribute`), KubeVirt reads the address from pciBusID.
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"  # `pci<domain>:<bus>`, the root complex
NUMA_NODE = "resource.kubernetes.io/numaNode"  # an int; left out for a device with no NUMA node (-1)
API_VERSION = "resource.k8s.io/v1"
PLURAL = "resourceslices"
STRING_MAX = 64  # a string attribute's value, at most (the API server refuses longer)
NAME_MAX = 253
MAX_DEVICES = 128  # devices in one ResourceSlice, at most (resource.k8s.io/v1 refuses more)
# Binding conditions (`dra.binding`): the scheduler binds a pod allocated a device only once the
# claim's status says its IOMMU group is on vfio-pci, and allocates again when it says it failed.
BOUND = "VFIOBound"
BIND_FAILED = "VFIOBindFailed"


@dataclass(frozen=True)
class Published:
    """One device in the slice: what it is, and whom it is for ("" = the pool, any namespace)."""

    device: Device
    object_name: str  # its NodePCIDevice
    namespace: str
    pcie_root: str = ""  # `pcie_root`'s answer; "" when unknown (then not published)
    taint: tuple[str, str, str] | None = None  # (key, value, effect) while it is ill (`dra.health.taint`)

    @property
    def name(self) -> str:
        return device_name(self.device.address)


def device_name(address: str) -> str:
    """The device's name in the slice (a DNS label): `pci-0000-3b-00-0` for 0000:3b:00.0."""
    return "pci-" + address.lower().replace(":", "-").replace(".", "-")


def pcie_root(link: str, address: str) -> str:
    """The PCIe root complex of the device at `address` (`pci0000:3a`), as Kubernetes' deviceattribute
    package reads it: `link` is where `/sys/bus/pci/devices/<address>` points, and the root is
    the first directory under `/sys/devices` on the way to the device. "" where the link leads
    anywhere else (upstream refuses such a device the attribute too)."""
    if link.startswith("/"):
        return ""
    target = posixpath.normpath(posixpath.join("bus/pci/devices", link))
    parts = target.split("/")
    if len(parts) < 3 or parts[0] != "devices" or not parts[1].startswith("pci") or parts[-1] != address:
        return ""
    return parts[1]


def slice_name(node_name: str, index: int = 0) -> str:
    """The node's slices, named for it and the driver (a hash where that would be too long): the
    first `<node>-pci.passthrough.io`, the others (a node with more than MAX_DEVICES to offer)
    with `-<index>` after it."""
    suffix = f"-{index}" if index else ""
    name = f"{node_name}-{DRIVER}{suffix}"
    if len(name) <= NAME_MAX:
        return name
    return f"{DRIVER}-{hashlib.sha1(node_name.encode()).hexdigest()}{suffix}"


def publishable(
    devices: Iterable[Device],
    assignments: Mapping[str, str],
    names: Mapping[str, str],
    in_gpu_mode: bool,
    claimed: Container[str] = frozenset(),
    roots: Mapping[str, str] | None = None,
) -> list[Published]:
    """`assignments`: object name -> the namespace it is handed out to (only those); `names`:
    address -> object name; `claimed`: object names an admin assigned, handed out or not;
    `roots`: address -> its PCIe root complex (`pcie_root`)."""
    roots = roots or {}
    devices = sorted(devices, key=lambda d: d.address)
    unpooled = {d.iommu_group for d in devices if d.iommu_group >= 0 and names.get(d.address, "") in claimed}
    found = []
    for device in devices:
        name = names.get(device.address, "")
        namespace = assignments.get(name, "")
        if namespace:
            if wanted(device, namespace, in_gpu_mode, serve_pools=True):
                found.append(Published(device, name, namespace, roots.get(device.address, "")))
        elif device.iommu_group not in unpooled and wanted(device, "", in_gpu_mode, serve_pools=True):
            found.append(Published(device, name, "", roots.get(device.address, "")))
    return found


def _string(value: str) -> dict[str, str]:
    return {"string": value[:STRING_MAX]}


def attributes(item: Published) -> dict[str, dict[str, Any]]:
    """A device's attributes, by qualified name, as a ResourceSlice holds them."""
    d = item.device
    standard: dict[str, dict[str, Any]] = {PCI_BUS_ID: _string(d.address)}
    if item.pcie_root:
        standard[PCIE_ROOT] = _string(item.pcie_root)
    if d.numa_node >= 0:
        standard[NUMA_NODE] = {"int": d.numa_node}
    return {
        **standard,
        f"{DOMAIN}/vendorID": _string(d.vendor_id),
        f"{DOMAIN}/deviceID": _string(d.device_id),
        f"{DOMAIN}/class": _string(d.class_code),
        f"{DOMAIN}/iommuGroup": {"int": d.iommu_group},
        f"{DOMAIN}/numaNode": {"int": d.numa_node},
        f"{DOMAIN}/model": _string(d.name),
        f"{DOMAIN}/resourceName": _string(d.resource_name),  # the pool's name (nvidia.com/GA102GL_A10), "" when none
        f"{DOMAIN}/namespace": _string(item.namespace),
        f"{DOMAIN}/nodePCIDevice": _string(item.object_name),
    }


def spec(node_name: str, published: Iterable[Published]) -> dict[str, Any]:
    """The slice's spec without the pool's generation (which counts our changes)."""
    return {
        "driver": DRIVER,
        "nodeName": node_name,
        "pool": {"name": node_name, "resourceSliceCount": 1},
        "devices": [_device(item) for item in sorted(published, key=lambda p: p.name)],
    }


def _device(item: Published) -> dict[str, Any]:
    found: dict[str, Any] = {"name": item.name, "attributes": attributes(item), **_binding()}
    if item.taint:
        key, value, effect = item.taint
        found["taints"] = [{"key": key, "value": value, "effect": effect}]
    return found


def _binding() -> dict[str, list[str]]:
    return {"bindingConditions": [BOUND], "bindingFailureConditions": [BIND_FAILED]}


def _taints(device: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A live device's taints as we write them: without the time the API server stamps on each."""
    return [{k: v for k, v in t.items() if k != "timeAdded"} for t in device.get("taints") or [] if isinstance(t, Mapping)]


def specs(node_name: str, published: Iterable[Published], at_least: int = 1) -> list[dict[str, Any]]:
    """The node's pool as slices of at most MAX_DEVICES devices each, in device-name order, and at
    least `at_least` of them (the count the live pool has: the agent may not delete a slice, so a
    pool never shrinks; a slice left over is written empty). Each says how many the pool has."""
    items = sorted(published, key=lambda p: p.name)
    count = max(1, at_least, -(-len(items) // MAX_DEVICES))
    chunks = [items[i * MAX_DEVICES:(i + 1) * MAX_DEVICES] for i in range(count)]
    return [{**spec(node_name, chunk), "pool": {"name": node_name, "resourceSliceCount": count}} for chunk in chunks]


def live_count(live: dict[str, Any] | None) -> int:
    """How many slices the live pool says it has (from its first slice; 1 when unknown)."""
    count = ((((live or {}).get("spec") or {}).get("pool") or {}).get("resourceSliceCount"))
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 1


def _generation(live: dict[str, Any] | None) -> int:
    found = (((live or {}).get("spec") or {}).get("pool") or {}).get("generation")
    return found if isinstance(found, int) and not isinstance(found, bool) else 0


def pool_changed(desired: list[dict[str, Any]], live: list[dict[str, Any] | None], node_uid: str) -> bool:
    """Whether any slice of the pool differs from what we write, or the live ones disagree on the
    pool's generation (a pass that wrote some of them and not the others)."""
    return (len(live) != len(desired) or any(changed(d, l, node_uid) for d, l in zip(desired, live))
            or len({_generation(l) for l in live}) > 1)  # fmt: skip


def pool_bodies(node_name: str, node_uid: str, desired: list[dict[str, Any]], live: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Every slice of the pool to apply, all with one generation past the newest live one: the
    scheduler reads only a pool's newest generation, and only once it has all its slices."""
    generation = max((_generation(l) for l in live), default=0) + 1
    times = _times_added(live)
    return [_body(slice_name(node_name, i), node_name, node_uid, _stamped(d, times), generation) for i, d in enumerate(desired)]


def _times_added(live: list[dict[str, Any] | None]) -> dict[tuple[str, str, str, str], str]:
    """(device, taint key, value, effect) -> when the API server stamped that taint, in the live pool."""
    found = {}
    for body in live:
        for device in ((body or {}).get("spec") or {}).get("devices") or []:
            for t in device.get("taints") or []:
                if isinstance(t, Mapping) and t.get("timeAdded"):
                    found[(device.get("name"), t.get("key"), t.get("value", ""), t.get("effect"))] = t["timeAdded"]
    return found


def _stamped(desired: dict[str, Any], times: Mapping[tuple[str, str, str, str], str]) -> dict[str, Any]:
    """`desired` with each taint the live pool has already carrying its time: a taint written
    without one is stamped now, and a device ill since an hour would seem ill since this write."""
    devices = []
    for device in desired["devices"]:
        taints = [{**t, "timeAdded": times[key]} if (key := (device["name"], t["key"], t["value"], t["effect"])) in times else t
                  for t in device.get("taints") or []]  # fmt: skip
        devices.append({**device, "taints": taints} if taints else device)
    return {**desired, "devices": devices}


def _body(name: str, node_name: str, node_uid: str, desired: dict[str, Any], generation: int) -> dict[str, Any]:
    """One slice to apply: `desired` (from `specs`) at `generation`, owned by the Node (a deleted
    Node takes its slices along, as the kubelet's helper does)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": name,
            "labels": {NODE_LABEL: node_name},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}],
        },
        "spec": {**desired, "pool": {**desired["pool"], "generation": generation}},
    }


def changed(desired: dict[str, Any], live: dict[str, Any] | None, node_uid: str) -> bool:
    """Whether the live slice differs from `desired` in anything we write (or is owned by an
    earlier Node of that name)."""
    if live is None:
        return True
    owners = (live.get("metadata") or {}).get("ownerReferences") or []
    if not any(o.get("kind") == "Node" and o.get("uid") == node_uid for o in owners):
        return True
    have = live.get("spec") or {}
    pool = have.get("pool") or {}
    if (have.get("driver"), have.get("nodeName"), pool.get("name"), pool.get("resourceSliceCount")) != (
        desired["driver"], desired["nodeName"], desired["pool"]["name"], desired["pool"]["resourceSliceCount"]
    ):  # fmt: skip
        return True
    devices = [{"name": d.get("name"), "attributes": d.get("attributes") or {},
                **{key: d[key] for key in _binding() if d.get(key)}, **({"taints": _taints(d)} if _taints(d) else {})}
               for d in have.get("devices") or []]  # fmt: skip
    return devices != desired["devices"]


def by_name(published: Iterable[Published]) -> dict[str, Published]:
    return {item.name: item for item in published}
