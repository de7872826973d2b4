"""Kernel hotplug events reach the agent: datagrams in the kernel's format, on a socket the test owns.

Nothing is written to this machine's /sys: the listener reads one end of a socket pair, the
test writes the other, exactly as the kernel frames a uevent.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from passthrough.agent import uevent
from passthrough.agent.loop import Agent
from passthrough.agent.main import supervised
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import Custom
from passthrough.pci.pciids import PciIds

REPO = Path(__file__).resolve().parents[2]


def kernel_uevent(action: str, address: str, subsystem: str = "pci") -> bytes:
    devpath = f"/devices/pci0000:00/0000:00:03.0/{address}"
    return (f"{action}@{devpath}\0ACTION={action}\0DEVPATH={devpath}\0SUBSYSTEM={subsystem}\0"
            f"PCI_SLOT_NAME={address}\0SEQNUM=4242\0").encode()  # fmt: skip


def test_a_uevent_message_is_parsed_as_the_kernel_writes_it():
    fields = uevent.parse(kernel_uevent("change", "0000:3b:00.0"))
    assert fields["ACTION"] == "change" and fields["PCI_SLOT_NAME"] == "0000:3b:00.0"
    assert uevent.is_pci_hotplug(fields)
    assert not uevent.is_pci_hotplug(uevent.parse(b"add@/devices/virtual/net/veth0\0ACTION=add\0SUBSYSTEM=net\0"))
    assert uevent.parse(b"libudev\0\xfe\xed") == {}  # udev's re-broadcast is not ours to read


async def test_a_burst_of_pci_uevents_wakes_the_listener_once():
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    events: list[dict[str, str]] = []
    listener = asyncio.create_task(uevent.listen(events.append, debounce=0.2, sock=ours))
    try:
        kernel.send(b"add@/devices/virtual/net/veth0\0ACTION=add\0SUBSYSTEM=net\0")  # not ours
        # A GPU and its audio function arrive together.
        kernel.send(kernel_uevent("add", "0000:3b:00.0"))
        kernel.send(kernel_uevent("add", "0000:3b:00.1"))
        await support.wait_for(lambda: asyncio.sleep(0, events), 5, what="the listener's callback")
        # A later event as the marker: everything before it has been read, so what was called
        # by then is all there is (no sleeping to show that nothing else comes).
        kernel.send(kernel_uevent("remove", "0000:5e:00.0"))
        await support.wait_for(lambda: asyncio.sleep(0, len(events) >= 2), 5, what="the marker's callback")
        assert [(e["ACTION"], e["PCI_SLOT_NAME"]) for e in events] == [("add", "0000:3b:00.0"), ("remove", "0000:5e:00.0")]
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        kernel.close()


class _Overflowing(socket.socket):
    """A receive that fails with ENOBUFS once, as the netlink socket does after a uevent storm."""

    overflowed = False

    def recv(self, *args):
        if not self.overflowed:
            self.overflowed = True
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return super().recv(*args)


async def test_events_lost_to_a_full_buffer_make_a_rescan_not_a_dead_listener():
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    overflowing = _Overflowing(socket.AF_UNIX, socket.SOCK_DGRAM, fileno=ours.detach())
    events: list[dict[str, str]] = []
    listener = asyncio.create_task(uevent.listen(events.append, debounce=0.1, sock=overflowing))
    try:
        kernel.send(kernel_uevent("add", "0000:af:00.0"))
        await support.wait_for(lambda: asyncio.sleep(0, len(events) >= 2), 5, what="a rescan, then the event")
        assert events[0] == {"ACTION": "overflow"} and events[1]["PCI_SLOT_NAME"] == "0000:af:00.0"
        assert not listener.done()
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        kernel.close()


async def test_a_helper_task_that_fails_is_started_again_and_said(caplog):
    runs = []

    async def flaky():
        runs.append(1)
        if len(runs) < 3:
            raise OSError(errno.ENOBUFS, "No buffer space available")

    await asyncio.wait_for(supervised("hotplug listener", flaky, backoff=0.01), 5)
    assert len(runs) == 3
    assert "hotplug listener failed (OSError" in caplog.text


@pytest.mark.cluster
async def test_a_uevent_leads_to_a_scan_that_reports_the_new_device(api, unique, tmp_path):
    node = await support.ensure_node(api, f"hotplug-{unique}")
    host = fakesysfs.gpu_node(tmp_path / "host")
    agent = Agent(api, node.name, host.sysfs, host.proc, PciIds.load(REPO / "e2e/data/pci.ids.2025-07-11"),
                  rescan_interval=3600)  # fmt: skip
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    running = [asyncio.create_task(agent.run()), asyncio.create_task(uevent.listen(agent.trigger, debounce=0.1, sock=ours))]
    kind = Custom(api, "nodepcidevices")

    async def addresses():
        items = (await kind.list(f"{NODE_LABEL}={node.name}"))["items"]
        return {o["status"]["attributes"]["pciAddress"] for o in items if o.get("status")}

    try:
        await support.wait_for(lambda: addresses(), 20, what="the first report")
        host.add_root_port("0000:00:09.0", "d8", iommu_group=12)
        host.add_device("0000:d8:00.0", "10de", "2236", "030200", driver="nvidia", iommu_group=22)
        scans = agent.scans
        kernel.send(kernel_uevent("add", "0000:d8:00.0"))
        await support.wait_for(lambda: asyncio.sleep(0, agent.scans > scans), 10, what="a scan woken by the uevent")
        assert "0000:d8:00.0" in await support.wait_for(
            lambda: _with(addresses(), "0000:d8:00.0"), 10, what="the new device reported")
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        kernel.close()
        with contextlib.suppress(client.exceptions.ApiException):
            await support.remove_node(api, node.name)


async def _with(found, address):
    got = await found
    return got if address in got else None
