"""Whether a device handed to passthrough can be used now, beyond its `/dev/vfio` node: its IOMMU
group viable (`vfio.group_problem`), and every member of the group present on the bus, its
config space answering (not 0xffff), its link up, and no new AER errors.

Reads attributes that take no device lock (links, `config`, the AER counters, the link
status), so a poll never waits behind a write that blocks; cheap enough for every quarter second.
A config-space read still waits while the kernel holds the device's config access (a reset, as
vfio-pci does when a VM starts, and the kernel's own after a fatal AER error), so
`Health.problems` reads in threads of each device's own, never in the event loop, the AER
counters apart from the config space: a device whose config reads have not returned keeps its
last answer for `ANSWER_DEADLINE`, then counts as unhealthy until they do, and is never given a
second thread.
"""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
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
_PORT_FATAL = "aer_rootport_total_err_fatal"
_PCI_ADDRESS = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


class Health:
    """Problems of the devices a node serves; AER counters are judged against what was first seen."""

    def __init__(self, sysfs_root: Path, dev_root: Path, aer_hold: float = AER_HOLD) -> None:
        self.sysfs_root, self.dev_root = Path(sysfs_root), Path(dev_root)
        self.aer_hold = aer_hold
        self._aer: dict[str, dict[str, int]] = {}  # address -> counter file -> the last total read
        self._aer_rose: dict[str, tuple[float, str]] = {}  # address -> (when, what) the counters last rose
        # (address, "config" or "counters") -> (since, its read in flight); -> what its last read said
        self._reading: dict[tuple[str, str], tuple[float, asyncio.Future[str]]] = {}
        self._last: dict[tuple[str, str], str] = {}
        self._ports: dict[str, str] = {}  # address -> the sysfs directory of its root port ("" none)

    async def problems(self, devices: Mapping[str, int], deadline: float = ANSWER_DEADLINE,
                       binding: bool = True) -> dict[str, str]:  # fmt: skip
        """`problem` of each address (-> its IOMMU group), read in threads: address -> why it
        cannot be used now ("" when it can); with `binding` False, `hardware_problem`'s (a group
        that DRA binds only at a claim's prepare). Two reads a device: its config space and link
        (which wait while the kernel holds config access) and the rest (presence, AER counters: kernel
        memory, never waiting), so that an AER error shows even while the kernel resets the link
        it came with. Returns once every read returned, at the latest after POLL_WAIT: a read
        still in flight then answers with its device's last word until `deadline` has passed
        since it began, and with "does not answer" after (config reads)."""
        loop = asyncio.get_running_loop()
        reads = {}  # two polls at once (a scan's and the watch's) share the reads in flight
        for address, group in devices.items():
            for part, check in (("config", self._config_part if binding else self._config_hardware),
                                ("counters", self._counters_part)):  # fmt: skip
                if (address, part) not in self._reading:
                    self._reading[address, part] = (time.monotonic(), self._read(loop, check, address, group))
                reads[address, part] = self._reading[address, part]
        until = loop.time() + POLL_WAIT
        while pending := [future for key, (_, future) in reads.items() if not future.done() and not _told(reads, key)]:
            if loop.time() >= until:
                break
            await asyncio.wait(pending, timeout=until - loop.time(), return_when=asyncio.FIRST_COMPLETED)
        said = {}
        for key, (since, future) in reads.items():
            if future.done():
                if self._reading.get(key) == (since, future):
                    del self._reading[key]
                self._last[key] = said[key] = future.result()
            elif key[1] == "config" and time.monotonic() - since > deadline:
                said[key] = (f"{key[0]}'s config space has not answered for {time.monotonic() - since:.0f} s "
                             "(the kernel holds its config access: a reset that does not end, or the device hangs)")  # fmt: skip
            else:
                said[key] = self._last.get(key, "")
        for key in [k for k in self._last if k[0] not in devices]:
            del self._last[key]  # watched only while served; a read in flight is left to end
        return {address: said[address, "config"] or said[address, "counters"] for address in devices}

    def _read(self, loop: asyncio.AbstractEventLoop, check: Callable[[str, int], str], address: str, group: int) -> asyncio.Future[str]:
        future: asyncio.Future[str] = loop.create_future()

        def answer(problem: str) -> None:
            if not future.done():
                future.set_result(problem)

        def read() -> None:
            try:
                problem = check(address, group)
            except Exception as exc:  # a check that cannot say means the device cannot be trusted
                problem = f"{address}'s health cannot be read ({exc})"
            if not loop.is_closed():
                loop.call_soon_threadsafe(answer, problem)

        # A thread of its own, a daemon: one that the kernel keeps waiting stops nothing, not even the exit.
        threading.Thread(target=read, name=f"health {address} {check.__name__}", daemon=True).start()
        return future

    def problem(self, address: str, group: int) -> str:
        """Why `address` (in IOMMU group `group`) cannot be used now; "" when it can."""
        return self.hardware_problem(address, group) or group_problem(self.sysfs_root, self.dev_root, group)

    def hardware_problem(self, address: str, group: int) -> str:
        """`problem` but for the group's binding: the device or a member of its group gone, dead,
        its link down or reporting AER errors. What counts for a device not bound yet (DRA binds
        a group only when a claim is prepared)."""
        return self._members(address, group, lambda e, a: self._config_problem(e, a) or self._aer_problem(e, a))

    def _config_part(self, address: str, group: int) -> str:
        return self._members(address, group, self._config_problem) or group_problem(self.sysfs_root, self.dev_root, group)

    def _config_hardware(self, address: str, group: int) -> str:
        return self._members(address, group, self._config_problem)

    def _counters_part(self, address: str, group: int) -> str:
        return self._members(address, group, self._aer_problem)

    def _members(self, address: str, group: int, check: Callable[[Path, str], str]) -> str:
        """`check` of each member of the device's group present (entry, address): the first problem."""
        devices = self.sysfs_root / "bus" / "pci" / "devices"
        if not os.path.lexists(devices / address):
            return f"{address} vanished from the bus (surprise removal, or it was hot-unplugged)"
        try:
            members = sorted(os.listdir(self.sysfs_root / "kernel" / "iommu_groups" / str(group) / "devices"))
        except OSError:
            members = [address]
        for member in members:
            if not os.path.lexists(devices / member):
                continue  # a member that left the group: group_problem judges what is left
            found = check(devices / member, member)
            if found:
                return found
        return ""

    def _config_problem(self, entry: Path, address: str) -> str:
        vendor = _config_vendor(entry / "config")
        if vendor == 0xFFFF:
            return f"{address} reads 0xffff from its config space: it fell off the bus (link down, or the device died)"
        width = _optional_int(entry / "current_link_width")
        if width == 0:
            return f"{address}'s PCIe link is down (current_link_width 0)"
        return ""

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
        # A fatal error of an endpoint is counted at its root port only: the kernel (6.1) does not
        # read the device's own status over a link it deems unreliable ("type=Inaccessible"), and
        # resets the link below the port, so every device there was hit.
        if address not in self._ports:
            self._ports[address] = _root_port(entry)
        port = self._ports[address]
        if port:
            total = _optional_int(Path(port) / _PORT_FATAL)
            key = f"port {_PORT_FATAL}"
            if total is not None and key in seen and total > seen[key]:
                self._aer_rose[address] = (time.monotonic(), f"{total - seen[key]} new fatal AER error(s) at its root port "
                                           f"{os.path.basename(port)} ({_PORT_FATAL} {total}), whose link the kernel reset")  # fmt: skip
            if total is not None:
                seen[key] = total
        rose = self._aer_rose.get(address)
        if rose is None:
            return ""
        since, what = rose
        if time.monotonic() - since > self.aer_hold:
            del self._aer_rose[address]
            return ""
        return f"{address} reported {what}; it counts as unhealthy for {self.aer_hold:g} s after the last one"


def _told(reads: Mapping[tuple[str, str], tuple[float, asyncio.Future[str]]], key: tuple[str, str]) -> bool:
    """Whether a config read need not be waited for: the device's counters already say it is ill
    (a fatal AER error comes with a link reset, which holds config access)."""
    if key[1] != "config":
        return False
    _, counters = reads[key[0], "counters"]
    return counters.done() and bool(counters.result())


def _root_port(entry: Path) -> str:
    """The sysfs directory of the root port above a device (the first bridge up its path with
    root-port AER counters), or ""."""
    here = Path(os.path.realpath(entry)).parent
    while _PCI_ADDRESS.fullmatch(here.name):
        if os.path.exists(here / _PORT_FATAL):
            return str(here)
        here = here.parent
    return ""


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
