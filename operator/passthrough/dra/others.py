"""Devices another server has, which the DRA driver leaves alone: one device, one server.

Two kinds of other server can hold a PCI address of this node: a device plugin (NVIDIA's sandbox
plugin, KubeVirt's own, SR-IOV's; the kubelet's PodResources `GetAllocatableResources` lists what
each serves, and in DRA mode no device plugin resource is ours), and another DRA driver (its
ResourceSlice of this node names the address in `resource.kubernetes.io/pciBusID`). Such a device
is not published, prepared or bound by us, and neither is the rest of its IOMMU group (a prepare
binds the whole group, and would take the other server's device with it). Pure functions; the
driver feeds them what it asked and watched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from passthrough.agent.handover import other_plugin
from passthrough.dra.slice import DRIVER, PCI_BUS_ID
from passthrough.pci.discovery import BRIDGE_CLASS, Device
from passthrough.pci.vfio import BindError

REASON = "ServedByOtherPlugin"  # a DRA driver is a kubelet plugin too: the same reason for both kinds


def by_other_drivers(slices: Iterable[Mapping[str, Any]], node_name: str) -> dict[str, str]:
    """Address -> the other DRA drivers (and their slices) that list it on `node_name`. Ours, and
    slices of other nodes or of no single node, do not count."""
    found: dict[str, set[str]] = {}
    for body in slices:
        spec = body.get("spec") or {}
        driver = spec.get("driver") or ""
        if not driver or driver == DRIVER or spec.get("nodeName") != node_name:
            continue
        name = (body.get("metadata") or {}).get("name", "")
        for device in spec.get("devices") or []:
            address = _address(device)
            if address:
                found.setdefault(address, set()).add(f"DRA driver {driver} (ResourceSlice {name}, device {device.get('name', '?')})")
    return {address: ", ".join(sorted(servers)) for address, servers in found.items()}


def merged(found: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """One address -> servers map from several (one per slice, as the driver keeps them)."""
    servers: dict[str, list[str]] = {}
    for each in found:
        for address, who in each.items():
            servers.setdefault(address, []).append(who)
    return {address: ", ".join(sorted(who)) for address, who in servers.items()}


def _address(device: Mapping[str, Any]) -> str:
    """The device's PCI address, lower case, or "" when it names none (or not as a string)."""
    value = ((device.get("attributes") or {}).get(PCI_BUS_ID) or {}).get("string")
    return value.strip().lower() if isinstance(value, str) else ""


def other_driver(address: str, servers: str) -> BindError:
    return BindError(
        REASON,
        f"{address} is published by another DRA driver: {servers}. One device, one server, so this driver neither "
        "publishes, prepares nor binds it. Leave it to that driver, or stop it publishing this device",
    )


def group_member(address: str, member: str, why: BindError) -> BindError:
    return BindError(
        REASON,
        f"{address} shares its IOMMU group with {member}, which another server has (a claim of {address} would bind "
        f"the whole group, {member} included): {why}",
    )


def elsewhere(devices: Iterable[Device], plugins: Mapping[str, str], drivers: Mapping[str, str]) -> dict[str, BindError]:
    """Address -> why it is not ours: each device a device plugin serves (`plugins`: address -> its
    resources) or another DRA driver publishes (`drivers`: address -> who), and every other member
    of its IOMMU group."""
    found: dict[str, BindError] = {}
    for address, servers in drivers.items():
        found[address] = other_driver(address, servers)
    for address, resources in plugins.items():
        found[address] = other_plugin(address, resources)  # a plugin's word first: the kubelet hands it out today
    devices = list(devices)
    taken = {d.iommu_group: d.address for d in sorted(devices, key=lambda d: d.address)
             if d.address in found and d.iommu_group >= 0}  # fmt: skip
    for device in devices:
        member = taken.get(device.iommu_group)
        if member is not None and device.address not in found and device.class_code[:2] != BRIDGE_CLASS:
            found[device.address] = group_member(device.address, member, found[member])
    return found
