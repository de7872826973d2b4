"""Kernel hotplug events reach the agent: a real uevent from this host's kernel, no cluster."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from passthrough.agent import uevent

SYSFS_PCI = Path("/sys/bus/pci/devices")


def test_a_uevent_message_is_parsed_as_the_kernel_writes_it():
    message = (b"change@/devices/pci0000:00/0000:00:03.0/0000:3b:00.0\0ACTION=change\0"
               b"DEVPATH=/devices/pci0000:00/0000:00:03.0/0000:3b:00.0\0SUBSYSTEM=pci\0PCI_SLOT_NAME=0000:3b:00.0\0SEQNUM=4242\0")
    fields = uevent.parse(message)
    assert fields["ACTION"] == "change" and fields["PCI_SLOT_NAME"] == "0000:3b:00.0"
    assert uevent.is_pci_hotplug(fields)
    assert not uevent.is_pci_hotplug(uevent.parse(b"add@/devices/virtual/net/veth0\0ACTION=add\0SUBSYSTEM=net\0"))
    assert uevent.parse(b"libudev\0\xfe\xed") == {}  # udev's re-broadcast is not ours to read


async def test_a_kernel_pci_uevent_wakes_the_listener():
    devices = sorted(SYSFS_PCI.glob("*")) if SYSFS_PCI.is_dir() else []
    if not devices or not os.access(devices[0] / "uevent", os.W_OK):
        pytest.skip("this host has no PCI device whose uevent file we may write")
    try:
        uevent.open_socket().close()
    except OSError as exc:
        pytest.skip(f"no kernel uevent socket here: {exc}")
    events: list[dict[str, str]] = []
    listener = asyncio.create_task(uevent.listen(events.append, debounce=0.2))
    try:
        await asyncio.sleep(0.2)
        # A synthetic "change" event, as `udevadm trigger --action=change` sends: nothing is
        # bound, unbound or reset.
        (devices[0] / "uevent").write_text("change")
        for _ in range(50):
            if events:
                break
            await asyncio.sleep(0.1)
        assert events, "no pci uevent arrived within 5s"
        assert events[0]["SUBSYSTEM"] == "pci" and events[0]["PCI_SLOT_NAME"] == devices[0].name
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
