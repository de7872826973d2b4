"""Kernel hotplug events for the pci subsystem, read from the kobject-uevent netlink socket.

The kernel broadcasts them in the host's network namespace (the agent runs with
hostNetwork); udev is not needed. Where the socket cannot be opened the periodic rescan
remains the safety net, and the agent says so once.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

log = logging.getLogger(__name__)

NETLINK_KOBJECT_UEVENT = 15
KERNEL_GROUP = 1
INTERESTING = {"add", "remove", "bind", "unbind", "change"}


def parse(message: bytes) -> dict[str, str]:
    """`ACTION@DEVPATH\\0KEY=VALUE\\0...` into a dict; udev's own (libudev-framed) messages yield {}."""
    if message.startswith(b"libudev"):
        return {}
    fields: dict[str, str] = {}
    for part in message.split(b"\0")[1:]:
        key, sep, value = part.partition(b"=")
        if sep:
            fields[key.decode(errors="replace")] = value.decode(errors="replace")
    return fields


def is_pci_hotplug(fields: dict[str, str]) -> bool:
    return fields.get("SUBSYSTEM") == "pci" and fields.get("ACTION") in INTERESTING


def open_socket() -> socket.socket:
    """The kernel's uevent broadcast; raises OSError where it cannot be had."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_KOBJECT_UEVENT)
    try:
        sock.bind((0, KERNEL_GROUP))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


# A card's functions arrive together and their driver binds follow within milliseconds:
# QUIET seconds without another pci event end a burst, and a burst never holds a scan back
# more than CAP seconds from its first event. Only pci events count: on a busy node the socket
# never falls silent (pod churn brings veth, cgroup and block events), and a window that
# waited for silence on the whole socket held a hot-added GPU back until the periodic rescan.
QUIET = 0.05
CAP = 0.15


async def listen(on_event: Callable[[dict[str, str]], None], debounce: float = QUIET, sock: socket.socket | None = None,
                 cap: float = CAP) -> None:  # fmt: skip
    """Call `on_event` once per burst of pci events (a GPU and its audio function arrive together).

    A burst ends after `debounce` seconds without another pci event, or `cap` seconds after its
    first, whichever comes first; events of other subsystems neither start nor extend one.
    `sock`: where the kernel's datagrams come from (the netlink socket when None; a test
    hands in one end of a socket pair). Events lost to a full receive buffer (ENOBUFS, in a
    uevent storm) are a reason to rescan, not to stop listening.
    """
    if sock is None:
        try:
            sock = open_socket()
        except OSError as exc:
            log.warning("kernel hotplug events are not available (%s); relying on the periodic rescan", exc)
            return
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    overflowed = False

    def lost() -> None:
        nonlocal overflowed
        if not overflowed:
            log.warning("kernel hotplug events were lost (receive buffer full); rescanning instead")
            overflowed = True
        on_event({"ACTION": "overflow"})

    try:
        while True:
            try:
                data = await loop.sock_recv(sock, 65536)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                lost()
                continue
            fields = parse(data)
            if not is_pci_hotplug(fields):
                continue
            # Collect the rest of the burst (pci events only) before reacting, within the cap.
            first = loop.time()
            quiet_until, give_up = first + debounce, first + cap
            while (wait := min(quiet_until, give_up) - loop.time()) > 0:
                try:
                    async with asyncio.timeout(wait):
                        data = await loop.sock_recv(sock, 65536)
                except TimeoutError:
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOBUFS:
                        raise
                    break  # some of the burst was lost: the scan below looks at everything anyway
                if is_pci_hotplug(parse(data)):
                    quiet_until = loop.time() + debounce
            log.info("pci hotplug event: %s %s", fields.get("ACTION"), fields.get("PCI_SLOT_NAME", fields.get("DEVPATH", "")))
            on_event(fields)
    finally:
        sock.close()
