"""`driver_override` is read in a child process under a timeout: a read that waits for the
device lock (held by a sysfs write that blocks: an unbind whose driver waits for its holder)
leaves that device out and never holds up a scan, whoever started the write.

The blocking read here is real: the device's `driver_override` is a FIFO nobody writes, so a
read's open(2) blocks in the kernel until the test opens the other end.
"""

from __future__ import annotations

import os
import threading
import time

from e2e.fakesysfs import FakeHost
from passthrough.pci import overrides
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds

FREE, STUCK = "0000:3b:00.0", "0000:af:00.0"


def host_with_a_stuck_override(tmp_path):
    """Two devices without a driver, one override pinned to vfio-pci; the other's read blocks."""
    host = FakeHost(tmp_path)
    for address, bus, group in ((FREE, "3b", 20), (STUCK, "af", 21)):
        host.add_root_port(f"0000:00:0{group - 17}.0", bus, iommu_group=group - 10)
        host.add_device(address, "10de", "2236", "030200", iommu_group=group)
    (host.sysfs / "bus" / "pci" / "devices" / FREE / "driver_override").write_text("vfio-pci\n")
    fifo = host.sysfs / "bus" / "pci" / "devices" / STUCK / "driver_override"
    fifo.unlink(missing_ok=True)
    os.mkfifo(fifo)
    return host, fifo


def let_go(fifo) -> None:
    """The write that held the device returns: the read gets its answer (an unset override)."""
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"(null)\n")
    os.close(fd)


def test_a_read_that_blocks_leaves_its_device_out_until_it_returns(tmp_path):
    host, fifo = host_with_a_stuck_override(tmp_path)
    reader = overrides.Isolated(timeout=0.5)
    # The stuck one first: the devices after it are read all the same, by a fresh child.
    entries = {a: host.sysfs / "bus" / "pci" / "devices" / a for a in (STUCK, FREE)}
    try:
        started = time.monotonic()
        assert reader(entries) == {FREE: "vfio-pci"}
        assert time.monotonic() - started < 30  # one child's start and the timeout, never the write
        assert reader.blocked() == {str(entries[STUCK])}
        # Asked again: the stuck device is not read again (no second child stuck), the other is.
        assert reader(entries) == {FREE: "vfio-pci"}
        let_go(fifo)
        deadline = time.monotonic() + 10
        while reader.blocked() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reader.blocked() == frozenset()
        os.unlink(fifo)
        (entries[STUCK] / "driver_override").write_text("(null)\n")
        assert reader(entries) == {FREE: "vfio-pci", STUCK: ""}
    finally:
        reader.close()


def test_discovery_goes_on_behind_a_write_it_did_not_start(tmp_path):
    """No `locked` device names the stuck one (the agent restarted, or its job was cancelled):
    the scan still ends, and reports both devices."""
    host, fifo = host_with_a_stuck_override(tmp_path)
    reader = overrides.Isolated(timeout=0.5)
    found = []
    scan = threading.Thread(target=lambda: found.append(discover(host.sysfs, host.proc, PciIds(), read_overrides=reader)),
                            daemon=True)  # fmt: skip
    try:
        scan.start()
        scan.join(60)
        assert not scan.is_alive(), "the scan waits behind the blocked read"
        devices = {d.address: d for d in found[0].devices}
        assert devices[FREE].driver_override == "vfio-pci" and devices[STUCK].driver_override == ""
        assert devices[STUCK].reported
    finally:
        let_go(fifo)
        scan.join(10)
        reader.close()
