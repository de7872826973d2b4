"""What a node needs before any of its devices can be passed through, checked the way the agent
sees it: `passthrough discover --check` prints it (with an exit code a script can use), and the
agent says the same on its Node (`node_labels`), so that an admin reads it before and after the
install with the same words.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from passthrough.api.labels import IOMMU_LABEL, VFIO_LABEL, VFIO_PCI_LABEL
from passthrough.pci.discovery import Discovery, NodeState

EXIT_NOT_READY = 3  # 0: ready; 1 and 2 are the CLI's runtime failure and bad usage

IOMMU_TODO = "enable VT-d (Intel) or AMD-Vi (AMD) in the firmware and boot with intel_iommu=on or amd_iommu=on"
VFIO_TODO = "load it (modprobe vfio-pci) and keep it loaded at boot (vfio-pci in /etc/modules-load.d/)"
SHOWN = 4  # devices named in the devices line; the rest counted


@dataclass(frozen=True)
class Check:
    name: str  # IOMMU, vfio-pci, devices
    ok: bool
    said: str  # what was found
    todo: str = ""  # what to do, when not ok


def checks(found: Discovery, sysfs_root: Path = Path("/sys")) -> list[Check]:
    node = found.node
    groups = sysfs_root / "kernel" / "iommu_groups"
    iommu = (Check("IOMMU", True, "enabled") if node.iommu_enabled
             else Check("IOMMU", False, f"not enabled ({groups} is empty)" if groups.is_dir() else f"not enabled (no {groups})",
                        IOMMU_TODO))  # fmt: skip
    vfio = Check("vfio-pci", True, "loaded") if node.vfio_available else Check("vfio-pci", False, "not loaded", VFIO_TODO)
    reported = [d for d in found.devices if d.reported]
    eligible = [d for d in reported if d.eligible]
    named = ", ".join(f"{d.address} ({d.name})" for d in eligible[:SHOWN])
    more = f" and {len(eligible) - SHOWN} more" if len(eligible) > SHOWN else ""
    devices = (Check("devices", True, f"{len(eligible)} of {len(reported)} can be passed through: {named}{more}") if eligible
               else Check("devices", False, f"none of {len(reported)} can be passed through",
                          "passthrough discover lists each device with the reason it cannot"))  # fmt: skip
    return [iommu, vfio, devices]


def ready(found: list[Check]) -> bool:
    return all(c.ok for c in found)


def render(found: list[Check]) -> str:
    width = max(len(c.name) for c in found)
    lines = [f"{c.name.ljust(width)}  {'ok  ' if c.ok else 'FAIL'}  {c.said}" + (f": {c.todo}" if c.todo else "") for c in found]
    lines.append("ready for passthrough" if ready(found) else f"not ready for passthrough (exit {EXIT_NOT_READY})")
    return "\n".join(lines) + "\n"


def render_json(found: list[Check]) -> str:
    return json.dumps({"ready": ready(found), "checks": [asdict(c) for c in found]}, indent=2) + "\n"


def node_labels(node: NodeState) -> dict[str, str]:
    """The agent's word on its Node: VFIO_LABEL ("true" when both halves hold) and each half."""
    return {
        VFIO_LABEL: "true" if node.iommu_enabled and node.vfio_available else "false",
        IOMMU_LABEL: "enabled" if node.iommu_enabled else "disabled",
        VFIO_PCI_LABEL: "loaded" if node.vfio_available else "missing",
    }
