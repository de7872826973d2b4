"""Faults of a device on the guest's real kernel, as a node meets them, for health.

- Off the bus: the device stops answering while the kernel still has it (a link that went down,
  a device that died): every config read returns all ones. Done in QEMU's own routing: the
  device's root port gets a secondary bus number nothing is on, so QEMU routes the guest's
  config cycles for the device's bus to no device, exactly as a dead link answers (all ones),
  and neither the kernel nor the device's driver hears of it. `back_on_the_bus` restores the
  numbers, and the device answers again as it was.
- Surprise removal: the device gone from the bus first, and only then removed from the kernel
  (its sysfs `remove`), as the kernel's hotplug driver handles a surprise removal: the driver's
  remove runs against a device already gone, with no chance to prepare. (QEMU's `device_del`
  is the orderly kind: the guest is asked first, through ACPI hotplug on this q35, and its
  driver is unbound before the device leaves.)

Each returns the guest's time.monotonic() right after the fault took effect, the clock
`node.PluginWatch` stamps the kubelet's view with.
"""

from __future__ import annotations

from e2e.guest.machine import Guest

NOWHERE = 0xFE  # a bus number no bridge of the rig's topology routes to

_OFF = """
import os, time
port = os.path.realpath(f"/sys/bus/pci/devices/{args['address']}/..") + "/config"
fd = os.open(port, os.O_RDWR)
try:
    numbers = list(os.pread(fd, 2, 0x19))  # secondary, subordinate
    os.pwrite(fd, bytes([args['nowhere'], args['nowhere']]), 0x19)
    at = time.monotonic()
    if args['remove']:
        with open(f"/sys/bus/pci/devices/{args['address']}/remove", "w") as remove:
            remove.write("1")
finally:
    os.close(fd)
config = f"/sys/bus/pci/devices/{args['address']}/config"
vendor = open(config, "rb").read(2).hex() if os.path.exists(config) else ""
result = {'at': at, 'numbers': numbers, 'port': port, 'vendor': vendor}
"""
_BACK = """
import os
fd = os.open(args['port'], os.O_RDWR)
try:
    os.pwrite(fd, bytes(args['numbers']), 0x19)
finally:
    os.close(fd)
result = open(f"/sys/bus/pci/devices/{args['address']}/config", "rb").read(2).hex()
"""


class OffTheBus:
    """A device taken off the bus (config reads all ones) until `back()`."""

    def __init__(self, guest: Guest, address: str, remove: bool = False) -> None:
        self.guest, self.address = guest, address
        found = guest.python(_OFF, address=address, nowhere=NOWHERE, remove=remove)
        self.at: float = found["at"]
        self.vendor: str = found["vendor"]  # its config space's first two bytes as read right after ("ffff")
        self._port, self._numbers = found["port"], found["numbers"]

    def back(self) -> str:
        """The root port's bus numbers as they were; the device's vendor ID as it reads now."""
        return self.guest.python(_BACK, address=self.address, port=self._port, numbers=self._numbers)


def surprise_removal(guest: Guest, address: str) -> OffTheBus:
    """The device gone from the bus, then removed from the kernel: its driver unbinds from a
    device that is already gone."""
    return OffTheBus(guest, address, remove=True)


_COUNTER_START = """
import threading, time
path = args['path']
seen = []
# The value before the fault is read here, before this returns and the fault is made: read in the
# thread, it could come after the kernel had counted, and the change would never be seen.
first = open(path).read()
state['stop:' + path] = False  # an earlier watch of the same file stopped it
def read(last=first):
    while not state.get('stop:' + path):
        now = open(path).read()
        if now != last:
            seen.append((time.monotonic(), now))
            last = now
        time.sleep(0.005)
threading.Thread(target=read, daemon=True).start()
state['counter:' + path] = seen
result = first
"""
_COUNTER_READ = """
result = list(state['counter:' + args['path']])
state['stop:' + args['path']] = True
"""


class CounterWatch:
    """A sysfs file in the guest (an AER counter), read every 5 ms from `start`: when the kernel
    first changed it, on the guest's clock (the part of a latency that is the kernel's)."""

    def __init__(self, guest: Guest, path: str) -> None:
        self.guest, self.path = guest, path
        self.first: str = guest.python(_COUNTER_START, path=path)  # its value when the watch began

    def changes(self) -> list[tuple[float, str]]:
        """Every change seen, and the watch stopped."""
        return [(at, text) for at, text in self.guest.python(_COUNTER_READ, path=self.path)]
