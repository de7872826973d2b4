"""What the agent itself moved to vfio-pci, kept on the node, so that it gives back only that:
never a device an admin pinned to vfio-pci (driverctl, `vfio-pci.ids=`), which looks the same
in sysfs. The file lives under the agent's state directory, on the host's /run by default:
gone at reboot, as the binds are.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "bound.json"


class Bound:
    """Address -> the `driver_override` the device had before the agent bound it."""

    def __init__(self, state_dir: Path | None = None) -> None:
        self.path = Path(state_dir) / FILE if state_dir is not None else None
        self.devices: dict[str, str] = self._load()

    def __contains__(self, address: object) -> bool:
        return address in self.devices

    def add(self, moved: dict[str, str]) -> None:
        if moved and any(self.devices.get(a) != o for a, o in moved.items()):
            self.devices.update(moved)
            self._save()

    def remove(self, addresses: list[str] | tuple[str, ...]) -> None:
        if any(a in self.devices for a in addresses):
            for address in addresses:
                self.devices.pop(address, None)
            self._save()

    def _load(self) -> dict[str, str]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
                raise ValueError("not an object of addresses to strings")
        except (OSError, ValueError) as exc:
            # Losing the record costs only give-backs (a device stays on vfio-pci); say how to mend it.
            log.warning("%s is unreadable (%s): devices bound before this start stay on vfio-pci until an admin "
                        "gives them back (driverctl unset-override, or a reboot); delete the file to silence this",
                        self.path, exc)  # fmt: skip
            return {}
        return data

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.devices, sort_keys=True))
        os.replace(temporary, self.path)
