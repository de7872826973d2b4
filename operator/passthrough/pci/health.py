"""Whether a device handed to passthrough can be used now, beyond its `/dev/vfio` node: its IOMMU
group viable (`vfio.group_problem`), and every member of the group present on the bus, its
config space answering (not 0xffff), its link up, and no new AER errors.

Reads attributes that take no device lock (links, `config`, the AER counters, the link
status), so a poll never waits behind a write that blocks; cheap enough for every quarter second.
A config-space read still waits while the kernel holds the device's config access (a reset, as
vfio-pci does when a VM starts), so `Health.problems` reads in a thread of each device's own,
never in the event loop: a device whose reads have not returned keeps its last answer for
`ANSWER_DEADLINE`, then counts as unhealthy until they do, and is never given a second thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from passthrough.pci import sysfs
from passthrough.pci.sysfs import SysfsError
from passthrough.pci.vfio import group_problem

AER_HOLD = 300.0  # seconds a device stays unhealthy after its AER error counters last rose
# A reset holds config access for up to about a second (a bus reset's settle time); past this, the
# device does not answer.
ANSWER_DEADLINE = 5.0
POLL_WAIT = 0.5  # seconds a poll waits for its reads before it answers with what it has
_AER_FILES = ("aer_dev_fatal", "aer_dev_nonfatal")


class Health:
    """Problems of the devices a node serves; AER counters are judged against what was first seen."""

    def __init__(self, sysfs_root: Path, dev_root: Path, aer_hold: float = AER_HOLD) -> None:
        self.sysfs_root, self.dev_root = Path(sysfs_root), Path(dev_root)
        self.aer_hold = aer_hold
        self._aer: dict[str, dict[str, int]] = {}  # address -> counter file -> the last total read
        self._aer_rose: dict[str, tuple[float, str]] = {}  # address -> (when, what) the counters last rose
        self._reading: dict[str, tuple[float, asyncio.Future[str]]] = {}  # address -> (since, its read in flight)
        self._last: dict[str, str] = {}  # address -> what its last read that returned said

    async def problems(self, devices: Mapping[str, int], deadline: float = ANSWER_DEADLINE) -> dict[str, str]:
        """`problem` of each address (-> its IOMMU group), read in threads: address -> why it
        cannot be used now ("" when it can). Returns once every read returned, at the latest after
        POLL_WAIT: a read still in flight then answers with its device's last word until
        `deadline` has passed since it began, and with "does not answer" after."""
        loop = asyncio.get_running_loop()
        reads = {}  # two polls at once (a scan's and the watch's) share the reads in flight
        for address, group in devices.items():
            if address not in self._reading:
                self._reading[address] = (time.monotonic(), self._read(loop, address, group))
            reads[address] = self._reading[address]
        if reads:
            await asyncio.wait([future for _, future in reads.values()], timeout=POLL_WAIT)
        found = {}
        for address, (since, future) in reads.items():
            if future.done():
                if self._reading.get(address) == (since, future):
                    del self._reading[address]
                self._last[address] = found[address] = future.result()
            elif time.monotonic() - since > deadline:
                found[address] = (f"{address}'s config space has not answered for {time.monotonic() - since:.0f} s "
                                  "(the kernel holds its config access: a reset that does not end, or the device hangs)")  # fmt: skip
            else:
                found[address] = self._last.get(address, "")
        for address in set(self._last) - set(devices):
            del self._last[address]  # watched only while served; a read in flight is left to end
        return found

    def _read(self, loop: asyncio.AbstractEventLoop, address: str, group: int) -> asyncio.Future[str]:
        future: asyncio.Future[str] = loop.create_future()

        def answer(problem: str) -> None:
            if not future.done():
                future.set_result(problem)

        def read() -> None:
            try:
                problem = self.problem(address, group)
            except Exception as exc:  # a check that cannot say means the device cannot be trusted
                problem = f"{address}'s health cannot be read ({exc})"
            if not loop.is_closed():
                loop.call_soon_threadsafe(answer, problem)

        # A thread of its own, a daemon: one that the kernel keeps waiting stops nothing, not even the exit.
        threading.Thread(target=read, name=f"health {address}", daemon=True).start()
        return future

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
