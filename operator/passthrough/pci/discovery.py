"""Discovery: the PCI devices of a host, and which of them can be passed through, and why not.

`discover` is a pure function of a sysfs root, a procfs root and pci.ids; the eligibility
rules of DESIGN.md are all here, each with the sentence an admin reads when it fails.

Reported or left out (a deliberate choice): a device that can never be passed through -
on bus 00 (integrated into the root complex) or of base class 05 (memory controller),
06 (bridge) or 08 (system peripheral) - is not reported (`reported=False`), so admins are
not drowned in bridges; `passthrough discover --all` still lists it. A device whose
vendor, device or class file cannot be read is not reported either: it has no identity
to name an object by, and its problem is in `Discovery.problems`. Every other device is
reported, eligible or not, with a reason when not.

Two choices beyond the letter of DESIGN.md: an interface that is up or a block device
in use keeps any device from passthrough, not only network (02) and storage (01)
controllers (a USB controller with the root disk on it is in use just the same); and the
node having no `vfio-pci` is node state (`NodeState.vfio_available`), not a reason on
each device, since loading the module fixes it for all.

A disk whose use cannot be told (an unreadable mount table, a garbled `dev`, a partition on a
host with an imported ZFS pool: see `disks.Usage`) keeps its device back, as a disk in use does.

SR-IOV: a physical function with virtual functions enabled stays with the host (unbinding it
destroys every VF, and with them whatever pods and VMs use). A virtual function (it has a
`physfn` link) is left out like a bridge unless the admin opts in (`virtual_functions`: the
agent's --sriov-virtual-functions): a NIC can have hundreds, and most belong to the SR-IOV
network operator. One whose network interface is not in the host's network namespace (the
SR-IOV CNI moved it into a pod) is in use, though nothing under /sys shows it up.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from passthrough.pci import naming, overrides, sysfs
from passthrough.pci.disks import Blocks, Usage, block_in_use
from passthrough.pci.pciids import PciIds
from passthrough.pci.sysfs import SysfsError

# Base classes that are never passed through, as the admin would read them.
NEVER_PASSED = {
    "05": ("it is a memory controller, class 05", "it stays with the host"),
    "06": ("it is a bridge, class 06", "pass through the devices behind it instead"),
    "08": ("it is a system peripheral, class 08", "it belongs to the platform and stays with the host"),
}
BRIDGE_CLASS = "06"
# Domains wider than 4 digits exist (devices behind Intel VMD); the API's addresses do not.
ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
API_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
IFF_UP = 0x1

T = TypeVar("T")


@dataclass(frozen=True)
class Device:
    address: str  # "0000:3b:00.0"
    vendor_id: str  # 4 lowercase hex; "" when unreadable (then not reported)
    device_id: str
    subsystem_vendor_id: str  # "" when unreadable
    subsystem_device_id: str
    class_code: str  # 6 lowercase hex, e.g. "030200"
    driver: str  # "" when none
    iommu_group: int  # -1 when none
    numa_node: int  # -1 when none
    vendor_name: str  # pci.ids vendor name, the hex ID when unknown
    name: str  # pci.ids device name, the hex ID when unknown
    resource_name: str  # pool resource name for GPUs, "" otherwise
    eligible: bool
    reason: str  # "" when eligible
    reported: bool  # False: left out by the agent (bus 00, class 05/06/08, no identity)
    driver_override: str = ""  # `driver_override`; "" when unset ("(null)") or unreadable

    def to_json(self) -> dict:
        return {
            "pciAddress": self.address,
            "vendorID": self.vendor_id,
            "deviceID": self.device_id,
            "subsystemVendorID": self.subsystem_vendor_id,
            "subsystemDeviceID": self.subsystem_device_id,
            "class": self.class_code,
            "driver": self.driver,
            "iommuGroup": self.iommu_group,
            "numaNode": self.numa_node,
            "vendorName": self.vendor_name,
            "name": self.name,
            "resourceName": self.resource_name,
            "eligible": self.eligible,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class NodeState:
    iommu_enabled: bool
    vfio_available: bool


@dataclass(frozen=True)
class Discovery:
    node: NodeState
    devices: tuple[Device, ...]  # sorted by address
    problems: tuple[str, ...]

    def to_json(self, include_unreported: bool = False) -> dict:
        return {
            "node": {"iommuEnabled": self.node.iommu_enabled, "vfioAvailable": self.node.vfio_available},
            "devices": [d.to_json() for d in self.devices if d.reported or include_unreported],
            "problems": list(self.problems),
        }


@dataclass
class _Found:
    """What was read of one device, and the verdict on it as the rules are applied."""

    address: str
    entry: Path  # <sysfs>/bus/pci/devices/<address>, the path an admin would look at
    path: Path  # the device's directory in the device tree
    vendor_id: str = ""
    device_id: str = ""
    subsystem_vendor_id: str = ""
    subsystem_device_id: str = ""
    class_code: str = ""
    driver: str = ""
    driver_override: str = ""
    iommu_group: int = -1
    physical_function: str = ""  # a VF's PF (its `physfn` link); "" for any other device
    virtual_functions: int = 0  # a PF's `sriov_numvfs`
    boot_vga: bool = False  # the display the firmware used: the host's console
    numa_node: int = -1
    problems: list[str] = field(default_factory=list)
    netdevs: dict[str, Path] = field(default_factory=dict)
    blocks: dict[str, Path] = field(default_factory=dict)
    why: str = ""  # empty while eligible
    todo: str = ""
    reported: bool = True
    held_by_group: bool = False

    @property
    def identified(self) -> bool:
        return bool(self.vendor_id and self.device_id and self.class_code)

    def rule_out(self, why: str, todo: str, reported: bool = True) -> None:
        self.why, self.todo, self.reported = why, todo, reported

    def attempt(self, read: Callable[..., T], *args: object, default: T) -> T:
        try:
            return read(*args)
        except SysfsError as e:
            self.problems.append(str(e))
            return default


def discover(
    sysfs_root: Path, proc_root: Path, pci_ids: PciIds, locked: Container[str] = (), *, virtual_functions: bool = False,
    read_overrides: Callable[[Mapping[str, Path]], Mapping[str, str]] = overrides.in_process,
    only: Container[str] | None = None,
) -> Discovery:  # fmt: skip
    """`locked`: devices with a sysfs write in flight, whose `driver_override` is not read (a read
    waits for the device lock that write holds). `read_overrides`: how the overrides of devices
    without a driver are read (the agent's `overrides.Isolated` leaves out a device whose read
    blocks, for a write it did not know of). `virtual_functions`: SR-IOV VFs are reported and
    may be eligible (the admin's opt-in); otherwise they are left out. `only`: the devices to
    read, the rest left out (the binder judges one IOMMU group: name all of its members)."""
    sysfs_root, proc_root = Path(sysfs_root), Path(proc_root)
    problems: list[str] = []
    node = NodeState(iommu_enabled=_iommu_enabled(sysfs_root), vfio_available=vfio_available(sysfs_root))

    devices_dir = sysfs_root / "bus" / "pci" / "devices"
    found: dict[str, _Found] = {}
    try:
        names = sysfs.entries(devices_dir)
    except SysfsError as e:
        names = []
        problems.append(str(e))
    for address in names if only is None else [n for n in names if n in only]:
        if not ADDRESS.fullmatch(address):
            problems.append(f"{devices_dir / address} is not named like a PCI address (0000:3b:00.0); ignored")
            continue
        device = _read_device(devices_dir / address, address)
        if device is not None:
            found[address] = device
    # All a driver_override tells is why a device has no driver.
    unread = {a: d.entry for a, d in found.items() if not d.driver and d.path.is_dir() and a not in locked}
    for address, override in read_overrides(unread).items():
        found[address].driver_override = override
    blocks = _attach(found, sysfs_root, problems)

    usage = Usage.read(proc_root, sysfs_root, blocks, problems)
    for device in found.values():
        _judge(device, node, sysfs_root, blocks, usage, virtual_functions)
    _judge_groups(found, sysfs_root)

    devices = []
    for device in found.values():
        problems.extend(device.problems)  # each names its file, and so the device
        devices.append(_device(device, pci_ids))
    return Discovery(node=node, devices=tuple(devices), problems=tuple(problems))


# --- Node state -------------------------------------------------------------------------


def _iommu_enabled(sysfs_root: Path) -> bool:
    try:
        return bool(sysfs.entries(sysfs_root / "kernel" / "iommu_groups"))
    except SysfsError:
        return False


def vfio_available(sysfs_root: Path) -> bool:
    """vfio-pci is loaded: its driver is registered, or its module is (built in or not)."""
    return (sysfs_root / "bus" / "pci" / "drivers" / "vfio-pci").exists() or (
        sysfs_root / "module" / "vfio_pci"
    ).exists()


# --- Reading ----------------------------------------------------------------------------


def _read_device(entry: Path, address: str) -> _Found | None:
    """One device's attributes; None when it vanished while being read (hot-unplug)."""
    if not os.path.lexists(entry):
        return None
    device = _Found(address=address, entry=entry, path=Path(os.path.realpath(entry)))
    if not device.path.is_dir():
        device.problems.append(f"{entry} points to {device.path}, which is not a device directory")
        return device
    device.vendor_id = device.attempt(sysfs.read_hex, entry / "vendor", 4, default="")
    device.device_id = device.attempt(sysfs.read_hex, entry / "device", 4, default="")
    device.class_code = device.attempt(sysfs.read_hex, entry / "class", 6, default="")
    device.subsystem_vendor_id = device.attempt(sysfs.read_hex, entry / "subsystem_vendor", 4, default="")
    device.subsystem_device_id = device.attempt(sysfs.read_hex, entry / "subsystem_device", 4, default="")
    device.driver = device.attempt(sysfs.link_name, entry / "driver", default="")
    # Without CONFIG_NUMA the kernel has no numa_node file at all.
    device.numa_node = device.attempt(sysfs.read_int, entry / "numa_node", -1, default=-1)
    if device.numa_node < -1:
        device.problems.append(f"{entry / 'numa_node'} holds {device.numa_node}, not a NUMA node or -1")
        device.numa_node = -1
    # SR-IOV: a VF links to its PF; a PF says how many VFs are on. Neither file exists elsewhere.
    device.physical_function = device.attempt(sysfs.link_name, entry / "physfn", default="")
    device.virtual_functions = device.attempt(sysfs.read_int, entry / "sriov_numvfs", 0, default=0)
    device.boot_vga = device.attempt(sysfs.read_int, entry / "boot_vga", 0, default=0) == 1
    group = device.attempt(sysfs.link_name, entry / "iommu_group", default="")
    # A group number is the kernel's int; isdigit() would take "²", and length no bound.
    if group and not (re.fullmatch(r"[0-9]{1,10}", group) and int(group) < 2**31):
        device.problems.append(f"{entry / 'iommu_group'} points to group {group!r}, not a group number")
    elif group:
        device.iommu_group = int(group)
    if device.problems and not os.path.lexists(entry):
        return None
    return device


def _attach(found: dict[str, _Found], sysfs_root: Path, problems: list[str]) -> Blocks:
    """Give each device the network interfaces and block devices that live below it, and
    return the host's block devices.

    Found through class/net and class/block, whose entries point into the device tree: a
    virtio NIC's interface is under virtioN/net, an NVMe disk under nvme/nvmeN, a
    partition under its disk; each goes to the nearest PCI device above it.
    """
    by_path = {str(d.path): d for d in found.values()}
    blocks = Blocks(sysfs_root, {})
    for cls, attr in (("net", "netdevs"), ("block", "blocks")):
        try:
            members = sysfs.class_devices(sysfs_root, cls)
        except SysfsError as e:
            problems.append(str(e))
            if cls == "block":
                blocks.error = str(e)
            continue
        if cls == "block":
            blocks = Blocks(sysfs_root, members)
        for name, path in members.items():
            for parent in path.parents:
                owner = by_path.get(str(parent))
                if owner is not None:
                    getattr(owner, attr)[name] = path
                    break
    for device in found.values():
        net = device.path / "net"
        for name in device.attempt(sysfs.entries, net, default=[]):
            device.netdevs.setdefault(name, net / name)
    return blocks


# --- The rules --------------------------------------------------------------------------


def _judge(
    device: _Found, node: NodeState, sysfs_root: Path, blocks: Blocks, usage: Usage, virtual_functions: bool = False,
) -> None:  # fmt: skip
    """The rules about the device alone, most permanent first; the group comes after."""
    check = f"check the device (lspci -vvs {device.address}, dmesg) and rescan"
    if not device.identified:
        device.rule_out(device.problems[0], check, reported=False)
    elif not API_ADDRESS.fullmatch(device.address):
        device.rule_out(
            "its PCI domain is wider than 4 digits (a device behind Intel VMD)",
            "turn VMD off in firmware to pass it through",
            reported=False,
        )
    elif device.address.split(":")[1] == "00":
        device.rule_out(
            "it sits on bus 00, integrated into the root complex", "such a device stays with the host", reported=False
        )
    elif device.class_code[:2] in NEVER_PASSED:
        device.rule_out(*NEVER_PASSED[device.class_code[:2]], reported=False)
    elif device.physical_function and not virtual_functions:
        device.rule_out(
            f"it is an SR-IOV virtual function of {device.physical_function}",
            "virtual functions are passed through only when an admin opts in "
            "(PassthroughConfig spec.discovery.sriovVirtualFunctions, the agent's --sriov-virtual-functions)",
            reported=False,
        )
    elif device.problems:
        device.rule_out(device.problems[0], check)
    elif not node.iommu_enabled:
        groups = sysfs_root / "kernel" / "iommu_groups"
        state = f"{groups} is empty" if groups.is_dir() else f"no {groups}"
        device.rule_out(
            f"IOMMU is not enabled on this node ({state})",
            "enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on or amd_iommu=on",
        )
    elif device.iommu_group < 0:
        device.rule_out(
            "the device has no IOMMU group although the IOMMU is on",
            "check that the firmware's DMAR/IVRS tables cover its slot, or move the card to another slot",
        )
    else:
        in_use = (_host_owned(device) or block_in_use(device.blocks, device.class_code, blocks, usage) or _interface_up(device)
                  or _interface_elsewhere(device))  # fmt: skip
        if in_use:
            device.rule_out(*in_use)


# Drivers that hold a device for passthrough: a VF on one has no network interface anywhere.
PASSTHROUGH_DRIVERS = frozenset({"vfio-pci", "pci-stub"})
NETWORK_CLASS = "02"


def _host_owned(device: _Found) -> tuple[str, str] | None:
    """What the host keeps whatever its state: the boot display, a PF carrying VFs."""
    if device.boot_vga:
        return (
            "it is the boot display (boot_vga is 1): the host's console, which the firmware and kernel draw on",
            "it stays with the host; pass through another GPU",
        )
    if device.virtual_functions > 0:
        plural = "s are" if device.virtual_functions > 1 else " is"
        return (
            f"SR-IOV is on: {device.virtual_functions} virtual function{plural} enabled, and unbinding this "
            "physical function would destroy them and cut off whatever uses them",
            f"pass its virtual functions through instead, or disable them "
            f"(echo 0 > /sys/bus/pci/devices/{device.address}/sriov_numvfs) to pass the whole device through",
        )
    return None


def _interface_elsewhere(device: _Found) -> tuple[str, str] | None:
    """A VF on its network driver whose interface this host's network namespace does not show:
    the SR-IOV CNI (or anything else) moved it into a pod's or container's namespace. sysfs
    lists a device's interfaces only in the namespace that mounted it (the host's, for the
    agent's hostPath /sys)."""
    if (not device.physical_function or device.class_code[:2] != NETWORK_CLASS or not device.driver
            or device.driver in PASSTHROUGH_DRIVERS or device.netdevs):  # fmt: skip
        return None
    return (
        f"its network interface (driver {device.driver}) is not in the host's network namespace: it was "
        "moved into a pod or container, which uses it",
        "end what uses it (the pod the SR-IOV CNI gave it to) and rescan",
    )


def _interface_up(device: _Found) -> tuple[str, str] | None:
    for name, path in sorted(device.netdevs.items()):
        try:
            up = _is_up(path)
        except SysfsError as e:
            return (
                f"whether network interface {name} is up cannot be told ({e})",
                f"bring it down (ip link set {name} down) and rescan",
            )
        if up:
            return (
                f"network interface {name} is up",
                f"bring it down (ip link set {name} down) to pass this device through",
            )
    return None


def _is_up(interface: Path) -> bool:
    """Administratively up: IFF_UP in `flags`; `operstate` only where there are no flags."""
    flags = interface / "flags"
    if os.path.lexists(flags):
        return bool(int(sysfs.read_hex(flags), 16) & IFF_UP)
    return sysfs.read_text(interface / "operstate") == "up"


def _judge_groups(found: dict[str, _Found], sysfs_root: Path) -> None:
    """An IOMMU group is passed through whole: a device is eligible only while every other
    member of its group is a bridge or eligible itself. Applied until nothing changes."""
    members: dict[int, set[str]] = {}
    for device in found.values():
        if device.iommu_group >= 0:
            members.setdefault(device.iommu_group, set()).add(device.address)
    # The kernel's own list can hold members that are not PCI devices this scan found.
    for group, addresses in members.items():
        listing = sysfs_root / "kernel" / "iommu_groups" / str(group) / "devices"
        try:
            addresses.update(sysfs.entries(listing))
        except SysfsError:
            pass

    def passes(address: str) -> bool:
        member = found.get(address)
        return member is not None and (member.class_code[:2] == BRIDGE_CLASS or not member.why)

    changed = True
    while changed:
        changed = False
        for device in found.values():
            if device.why:
                continue
            blockers = [a for a in members.get(device.iommu_group, ()) if a != device.address and not passes(a)]
            if not blockers:
                continue
            # Name a member that is out for a reason of its own, not one held by the group.
            blocker = min(blockers, key=lambda a: (a in found and found[a].held_by_group, a))
            member = found.get(blocker)
            why = member.why if member else "not a PCI device the agent can see"
            device.rule_out(
                f"IOMMU group {device.iommu_group} also holds {blocker} ({why})",
                "the group is passed through whole, so free that device too",
            )
            device.held_by_group = True
            changed = True


# --- Result -----------------------------------------------------------------------------


def _device(found: _Found, pci_ids: PciIds) -> Device:
    vendor, device, klass = found.vendor_id, found.device_id, found.class_code
    resource = naming.pool_resource_name(vendor, device, klass, pci_ids) if found.identified else ""
    return Device(
        address=found.address,
        vendor_id=vendor,
        device_id=device,
        subsystem_vendor_id=found.subsystem_vendor_id,
        subsystem_device_id=found.subsystem_device_id,
        class_code=klass,
        driver=found.driver,
        iommu_group=found.iommu_group,
        numa_node=found.numa_node,
        vendor_name=(pci_ids.vendor_name(vendor) if vendor else None) or vendor,
        name=(pci_ids.device_name(vendor, device) if vendor and device else None) or device,
        resource_name=resource,
        eligible=not found.why,
        reason=f"{found.why}; {found.todo}" if found.why else "",
        reported=found.reported,
        driver_override=found.driver_override,
    )
