"""What the agent itself moved to vfio-pci, kept on the node, so that it gives back only that:
never a device an admin pinned to vfio-pci (driverctl, `vfio-pci.ids=`), which looks the same
in sysfs. The file lives under the agent's state directory, on the host's /run by default:
gone at reboot, as the binds are.

A bind's answer says what it moved; an answer can be lost (the agent restarts while the write
is blocked in the kernel, and the binder finishes it for nobody). So each bind is recorded as
intended first (`binding.json` beside it), for the members not on vfio-pci then, and settled
from the driver links later (`settle`): a member that reached vfio-pci is the agent's, one back
on another driver or gone was not moved, one without a driver is still on its way.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from passthrough.pci import sysfs

log = logging.getLogger(__name__)

FILE = "bound.json"
INTENDED = "binding.json"
VFIO_DRIVER = "vfio-pci"


class Bound:
    """Address -> the `driver_override` the device had before the agent bound it."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.path = Path(state_dir) / FILE if state_dir is not None else None
        self.devices: dict[str, str] = _load(self.path)
        # Address -> its driver_override then, for the members of binds whose answer is not in.
        self.intended: dict[str, str] = _load(self.path.with_name(INTENDED) if self.path is not None else None)

    def __contains__(self, address: object) -> bool:
        return address in self.devices

    def add(self, moved: dict[str, str]) -> None:
        """What a bind's answer says it moved, each with the override it found. An intended member
        found with vfio-pci's override was left so by the agent's own bind, cut short (a restart
        mid-write): what it had before that is the intent's."""
        moved = {a: self.intended[a] if o == VFIO_DRIVER and a in self.intended else o for a, o in moved.items()}
        if moved and any(self.devices.get(a) != o for a, o in moved.items()):
            self.devices.update(moved)
            self._save()

    def remove(self, addresses: list[str] | tuple[str, ...]) -> None:
        if any(a in self.devices for a in addresses):
            for address in addresses:
                self.devices.pop(address, None)
            self._save()

    def intend(self, sysfs_root: Path, addresses: list[str] | tuple[str, ...]) -> None:
        """Before a bind: its members not on vfio-pci now (an admin's pin stays the admin's), with
        their driver_override as the agent knows it: unset (what a bind leaves behind is
        vfio-pci's; the binder's answer, when it comes, says what it was)."""
        new = {a: "" for a in addresses if a not in self.intended and sysfs.driver_of(_entry(sysfs_root, a)) != VFIO_DRIVER}
        if new:
            self.intended.update(new)
            self._save()

    def settle(self, sysfs_root: Path) -> None:
        """Intended members whose bind is over, read from their driver links: on vfio-pci, the
        agent's (what its answer said, or the intent); on another driver, or gone, not moved.
        One without a driver is mid-way (an unbind blocked in the kernel) and stays intended."""
        settled = {}
        for address, override in self.intended.items():
            driver = sysfs.driver_of(_entry(sysfs_root, address))
            if driver == "":
                continue
            settled[address] = override
            if driver == VFIO_DRIVER:
                self.devices.setdefault(address, override)
        if settled:
            for address in settled:
                del self.intended[address]
            self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        _write(self.path, self.devices)
        _write(self.path.with_name(INTENDED), self.intended)


def _entry(sysfs_root: Path, address: str) -> Path:
    return Path(sysfs_root) / "bus" / "pci" / "devices" / address


def _load(path: Path | None) -> dict[str, str]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            raise ValueError("not an object of addresses to strings")
    except (OSError, ValueError) as exc:
        # Losing the record costs only give-backs (a device stays on vfio-pci); say how to mend it.
        log.warning("%s is unreadable (%s): devices bound before this start stay on vfio-pci until an admin "
                    "gives them back (driverctl unset-override, or a reboot); delete the file to silence this",
                    path, exc)  # fmt: skip
        return {}
    return data


def _write(path: Path, record: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, sort_keys=True))
    os.replace(temporary, path)
