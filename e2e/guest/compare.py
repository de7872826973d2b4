"""One scenario of the vfio bind sequence, run unchanged on a real kernel (in the guest's command
server) and on the simulated one (e2e/fakekernel.py over a FakeHost): what each kernel answers,
as plain values to compare. Where they differ, the real kernel is right.

`observe` makes the system calls itself (no project code between the test and the kernel):
1. a single-function group onto vfio-pci: its driver, and /dev/vfio/<group>;
2. that group node opened twice: the second open's errno;
3. one function of a two-function group onto vfio-pci: the group opens, but a VMM's
   VFIO_GROUP_SET_CONTAINER gets an errno (the group is not viable); then that function back;
4. the single device held (`hold`: a VMM on the real kernel, FakeHost.hold on the simulation):
   its unbind blocks, a driver_override read blocks meanwhile; after `let_go` both return, and
   the device has no driver;
5. a driver_override naming a driver that is not loaded: drivers_probe succeeds, no driver.
Timings (how long the held unbind blocked, how long after the holder let go it returned) come
back apart from the observations: they are measured, not compared.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

VFIO_GROUP_SET_CONTAINER = 0x3B68
BLOCKED = 0.5  # s a call must still be in the kernel after, to count as blocked
MISSING_DRIVER = "rk-no-such-driver"


class _Call(threading.Thread):
    """A system call in a thread of its own, so the caller can see it block."""

    def __init__(self, call: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.call, self.result, self.errno, self.took = call, None, 0, 0.0
        self.started = time.monotonic()
        self.start()

    def run(self) -> None:
        try:
            self.result = self.call()
        except OSError as e:
            self.errno = e.errno or -1
        self.took = time.monotonic() - self.started


def _errno(call: Callable[[], Any]) -> str:
    """The errno's name a call ends with; "ok" when it succeeds."""
    try:
        call()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e.errno))
    return "ok"


def observe(sysfs: Path, dev: Path, single: str, pair: tuple[str, str], hold: Callable[[], None],
            let_go: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    sysfs, dev = Path(sysfs), Path(dev)
    devices = sysfs / "bus" / "pci" / "devices"

    def write(relative: str, text: str) -> None:
        fd = os.open(sysfs / "bus" / "pci" / relative, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def driver(address: str) -> str:
        try:
            return os.path.basename(os.readlink(devices / address / "driver"))
        except OSError:
            return ""

    def group(address: str) -> int:
        return int(os.path.basename(os.readlink(devices / address / "iommu_group")))

    def to(address: str, override: str) -> None:
        """driver_override, unbind, drivers_probe: what the agent's bind and give-back do."""
        write(f"devices/{address}/driver_override", override or "\n")
        if driver(address):
            write(f"drivers/{driver(address)}/unbind", address)
        write("drivers_probe", address)

    seen: dict[str, Any] = {}
    timings: dict[str, float] = {}
    original = {a: driver(a) for a in (single, *pair)}

    # 1. A single-function group onto vfio-pci.
    to(single, "vfio-pci")
    node = dev / "vfio" / str(group(single))
    seen["1 bind: driver"] = driver(single)
    seen["1 bind: group node"] = node.exists()

    # 2. The group node opens once.
    first = os.open(node, os.O_RDWR)
    seen["2 second open"] = _errno(lambda: os.close(os.open(node, os.O_RDWR)))
    os.close(first)
    time.sleep(0.3)  # the simulation takes a group back when FUSE's release arrives, a moment after close
    seen["2 open after close"] = _errno(lambda: os.close(os.open(node, os.O_RDWR)))

    # 3. Half a group: it opens, and a VMM cannot use it.
    to(pair[0], "vfio-pci")
    seen["3 half: drivers"] = [driver(pair[0]), driver(pair[1])]
    half = dev / "vfio" / str(group(pair[0]))
    seen["3 half: group node"] = half.exists()
    fd = os.open(half, os.O_RDWR)
    container = os.open(dev / "vfio" / "vfio", os.O_RDWR)
    try:
        seen["3 half: SET_CONTAINER"] = _errno(lambda: fcntl.ioctl(fd, VFIO_GROUP_SET_CONTAINER, struct.pack("i", container)))
    finally:
        os.close(container)
        os.close(fd)
    to(pair[0], "")
    seen["3 half: given back"] = driver(pair[0]) == original[pair[0]]

    # 4. The unbind of a held device blocks until the holder lets go; driver_override reads wait too.
    hold()
    try:
        unbind = _Call(lambda: write("drivers/vfio-pci/unbind", single))
        unbind.join(BLOCKED)
        seen["4 held unbind: blocked"] = unbind.is_alive()
        read = _Call(lambda: (devices / single / "driver_override").read_text().strip())
        read.join(BLOCKED)
        seen["4 override read meanwhile: blocked"] = read.is_alive()
        seen["4 driver while blocked"] = driver(single)
        timings["unbind blocked before the holder let go"] = time.monotonic() - unbind.started
    finally:
        released = time.monotonic()
        let_go()
    unbind.join(120)
    read.join(120)
    timings["unbind returned after the holder let go"] = time.monotonic() - released
    seen["4 held unbind: returned"] = (not unbind.is_alive(), unbind.errno)
    seen["4 override read: returned"] = (not read.is_alive(), read.result)
    seen["4 driver after"] = driver(single)

    # 5. A driver_override naming a driver that is not loaded: the probe succeeds, no driver.
    seen["5 missing driver: probe"] = _errno(lambda: to(pair[0], MISSING_DRIVER))
    seen["5 missing driver: driver"] = driver(pair[0])
    to(pair[0], "")
    to(single, "")
    seen["5 all back"] = {a: driver(a) for a in original} == original
    return {"seen": seen, "timings": timings}
