"""Whether a device handed to passthrough can be used now, beyond its `/dev/vfio` node: its IOMMU
group viable (`vfio.group_problem`), and every member of the group present on the bus, its
config space answering (not 0xffff), its link up, and no new AER errors.

Reads attributes that take no device lock (links, `config`, the AER counters, the link
status), so a poll never waits behind a write that blocks; cheap enough for every half second.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from passthrough.pci import sysfs
from passthrough.pci.sysfs import SysfsError
from passthrough.pci.vfio import group_problem

AER_HOLD = 300.0  # seconds a device stays unhealthy after its AER error counters last rose
_AER_FILES = ("aer_dev_fatal", "aer_dev_nonfatal")


class Health:
    """Problems of the devices a node serves; AER counters are judged against what was first seen."""

    def __init__(self, sysfs_root: Path, dev_root: Path, aer_hold: float = AER_HOLD) -> None:
        self.sysfs_root, self.dev_root = Path(sysfs_root), Path(dev_root)
        self.aer_hold = aer_hold
        self._aer: dict[str, dict[str, int]] = {}  # address -> counter file -> the last total read
        self._aer_rose: dict[str, tuple[float, str]] = {}  # address -> (when, what) the counters last rose

    def problem(self, address: str, group: int) -> str:
        """Why `address` (in IOMMU group `group`) cannot be used now; "" when it can."""
        return self.hardware_problem(address, group) or group_problem(self.sysfs_root, self.dev_root, group)

    def hardware_problem(self, address: str, group: int) -> str:
        """`problem` but for the group's binding: the device or a member of its group gone, dead,
        its link down or reporting AER errors. What counts for a device not bound yet (DRA binds
        a group only when a claim is prepared)."""
        devices = self.sysfs_root / "bus" / "pci" / "devices"
        if not os.path.lexists(devices / address):
            return f"{address} vanished from the bus (surprise removal, or it was hot-unplugged)"
        try:
            members = sorted(os.listdir(self.sysfs_root / "kernel" / "iommu_groups" / str(group) / "devices"))
        except OSError:
            members = [address]
        for member in members:
            found = self._device_problem(devices / member, member)
            if found:
                return found
        return ""

    def _device_problem(self, entry: Path, address: str) -> str:
        if not os.path.lexists(entry):
            return ""  # a member that left the group: group_problem judges what is left
        vendor = _config_vendor(entry / "config")
        if vendor == 0xFFFF:
            return f"{address} reads 0xffff from its config space: it fell off the bus (link down, or the device died)"
        width = _optional_int(entry / "current_link_width")
        if width == 0:
            return f"{address}'s PCIe link is down (current_link_width 0)"
        return self._aer_problem(entry, address)

    def _aer_problem(self, entry: Path, address: str) -> str:
        seen = self._aer.setdefault(address, {})
        for name in _AER_FILES:
            total = _aer_total(entry / name)
            if total is None:
                continue
            if name in seen and total > seen[name]:
                kind = "fatal" if name == "aer_dev_fatal" else "non-fatal"
                self._aer_rose[address] = (time.monotonic(), f"{total - seen[name]} new {kind} AER error(s) ({name} {total})")
            seen[name] = total
        rose = self._aer_rose.get(address)
        if rose is None:
            return ""
        since, what = rose
        if time.monotonic() - since > self.aer_hold:
            del self._aer_rose[address]
            return ""
        return f"{address} reported {what}; it counts as unhealthy for {self.aer_hold:g} s after the last one"


def _config_vendor(path: Path) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, 2, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(data, "little") if len(data) == 2 else None


def _optional_int(path: Path) -> int | None:
    try:
        return sysfs.read_int(path)
    except SysfsError:
        return None


def _aer_total(path: Path) -> int | None:
    """The TOTAL_ERR_* line of an AER counter file (one `NAME count` per line)."""
    try:
        text = sysfs.read_text(path)
    except SysfsError:
        return None
    for line in text.splitlines():
        name, _, count = line.partition(" ")
        if name.startswith("TOTAL_ERR") and count.strip().isdigit():
            return int(count)
    return None
