"""The hotplug listener's burst window: pci events only start and extend it, and it is capped,
so a busy node's other uevents never hold a hot-added device back. The kernel's end of the
socket is a socket pair here; the framing is the kernel's (tests/integration/test_hotplug.py)."""

from __future__ import annotations

import asyncio
import socket

from passthrough.agent import uevent
from tests.integration.test_hotplug import kernel_uevent

NET = b"add@/devices/virtual/net/veth0\0ACTION=add\0SUBSYSTEM=net\0"


async def stream(kernel: socket.socket, message: bytes, until: asyncio.Event, every: float = 0.01, most: int = 300) -> int:
    """Send `message` every `every` seconds until `until` is set; how many were sent by then."""
    for sent in range(most):
        if until.is_set():
            return sent
        kernel.send(message)
        await asyncio.sleep(every)
    return most


async def listening(events: list, **kwargs):
    kernel, ours = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    called = asyncio.Event()

    def on_event(fields: dict[str, str]) -> None:
        events.append(fields)
        called.set()

    return kernel, called, asyncio.create_task(uevent.listen(on_event, sock=ours, **kwargs))


async def stop(listener: asyncio.Task, kernel: socket.socket) -> None:
    listener.cancel()
    await asyncio.gather(listener, return_exceptions=True)
    kernel.close()


async def test_other_subsystems_uevents_neither_start_nor_hold_back_a_pci_burst():
    events: list = []
    kernel, called, listener = await listening(events)
    try:
        kernel.send(NET)
        kernel.send(kernel_uevent("add", "0000:3b:00.0"))
        # Pod churn goes on: veth events every 10 ms, for 3 s at most.
        sent = await stream(kernel, NET, called)
        assert [e["PCI_SLOT_NAME"] for e in events] == ["0000:3b:00.0"]
        assert sent < 100, f"the hotplug waited for {sent} unrelated uevents"  # it answered while they went on
    finally:
        await stop(listener, kernel)


async def test_a_burst_of_pci_uevents_is_one_call_and_a_long_one_is_cut_at_the_cap():
    events: list = []
    kernel, called, listener = await listening(events, debounce=0.05, cap=0.15)
    try:
        # A GPU and its audio function together: one call, then the next burst is a call of its own.
        kernel.send(kernel_uevent("add", "0000:3b:00.0"))
        kernel.send(kernel_uevent("add", "0000:3b:00.1"))
        await called.wait()
        called.clear()
        kernel.send(kernel_uevent("bind", "0000:5e:00.0"))
        await called.wait()
        assert [(e["ACTION"], e["PCI_SLOT_NAME"]) for e in events] == [("add", "0000:3b:00.0"), ("bind", "0000:5e:00.0")]
        # pci events that never stop (a storm): each cap's worth is one call, not a wait for silence.
        called.clear()
        sent = await stream(kernel, kernel_uevent("change", "0000:af:00.0"), called)
        assert sent < 100 and len(events) == 3
    finally:
        await stop(listener, kernel)
