"""The `discover` and `resource-name` commands: the agent's view of this host, touching no cluster.

Exit codes as in cli.py: 0 done, 2 bad input (an unknown ID, an unusable --pci-ids or
--sysfs-root), and for `discover --check` 3: the node is not ready for passthrough
(pci/preflight.py); warnings go to stderr, so stdout stays parseable.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from passthrough.pci import naming, preflight
from passthrough.pci.discovery import Device, Discovery, discover as discover_devices
from passthrough.pci.pciids import PciIds

EXIT_USAGE = 2
_VENDOR_DEVICE = re.compile(r"([0-9A-Fa-f]{4}):([0-9A-Fa-f]{4})")
_COLUMNS = ("ADDRESS", "VENDOR:DEVICE", "CLASS", "DRIVER", "GROUP", "NUMA", "ELIGIBLE", "RESOURCE", "NAME")


def discover(args: argparse.Namespace) -> int:
    if not Path(args.sysfs_root).is_dir():
        return _fail("discover", f"--sysfs-root {args.sysfs_root} is not a directory")
    pci_ids = _load_pci_ids("discover", args.pci_ids)
    if pci_ids is None:
        return EXIT_USAGE
    found = discover_devices(Path(args.sysfs_root), Path(args.proc_root), pci_ids, virtual_functions=args.sriov_virtual_functions)
    for problem in found.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if args.check:
        checks = preflight.checks(found, Path(args.sysfs_root))
        _write(preflight.render_json(checks) if args.output == "json" else preflight.render(checks))
        return 0 if preflight.ready(checks) else preflight.EXIT_NOT_READY
    if args.output == "json":
        _write(json.dumps(found.to_json(include_unreported=args.all), indent=2) + "\n")
    else:
        _write(render_table(found, include_unreported=args.all))
    return 0


def resource_name(args: argparse.Namespace) -> int:
    wanted = []
    for arg in args.ids:
        m = _VENDOR_DEVICE.fullmatch(arg)
        if m is None:
            return _fail("resource-name", f"{arg!r} is not VENDOR:DEVICE, 4 hex digits each (e.g. 10de:2236)")
        vendor, device = m.groups()
        try:
            naming.gpu_domain(vendor)
        except ValueError as e:
            return _fail("resource-name", f"{arg}: {e}")
        wanted.append((vendor, device))
    pci_ids = _load_pci_ids("resource-name", args.pci_ids)
    if pci_ids is None:
        return EXIT_USAGE
    # Which database made the names, and which IDs it does not know: a name follows the edition
    # (a newer pci.ids may name a card a hex ID stood for), so an allow-list written from these
    # names must be written from the edition the nodes have.
    if pci_ids.path is not None:
        print(f"passthrough resource-name: names from {describe_database(pci_ids)}", file=sys.stderr)
    for vendor, device in wanted:
        if pci_ids.path is not None and pci_ids.device_name(vendor, device) is None:
            print(f"warning: {vendor}:{device} is not in {describe_database(pci_ids)}, so its name is its device ID; "
                  "a newer pci.ids may name it (and the nodes' agents use their own pci.ids): pass --pci-ids with the "
                  "nodes' file, or read the name a node reports (passthrough discover on it, or kubectl get npci)",
                  file=sys.stderr)  # fmt: skip
    _write("".join(naming.gpu_resource_name(v, d, pci_ids) + "\n" for v, d in wanted))
    return 0


def describe_database(pci_ids: PciIds) -> str:
    """`pci.ids /usr/share/misc/pci.ids (version 2025.07.11, dated 2025-07-11 03:15:02)`."""
    facts = [f"version {pci_ids.edition}" if pci_ids.edition else "no version line"]
    if date := _header_date(pci_ids.path):
        facts.append(f"dated {date}")
    return f"pci.ids {pci_ids.path} ({', '.join(facts)})"


_DATE = re.compile(rb"^#\s*Date:\s*(\S[^\r\n]*?)\s*$", re.M)


def _header_date(path: Path | None) -> str:
    """The Date: of the file's header comment (its first lines), "" when there is none."""
    try:
        with open(path, "rb") as f:  # type: ignore[arg-type]
            head = f.read(4096)
    except (OSError, TypeError):
        return ""
    found = _DATE.search(head)
    return found.group(1).decode("ascii", "replace") if found else ""


def render_table(found: Discovery, include_unreported: bool = False) -> str:
    node = found.node
    lines = [
        "IOMMU: " + ("enabled" if node.iommu_enabled else "not enabled")
        + "; vfio-pci: " + ("available" if node.vfio_available else "not available (modprobe vfio-pci)")
    ]
    shown = [d for d in found.devices if d.reported or include_unreported]
    left_out = sum(not d.reported for d in found.devices)
    if shown:
        rows = [_COLUMNS, *(_row(d) for d in shown)]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS) - 1)]
        for row, device in zip(rows, (None, *shown)):
            lines.append("  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip())
            if device is not None and device.reason:
                lines.append(f"    reason: {device.reason}")
    else:
        lines.append("no devices to report")
    if left_out and not include_unreported:
        lines.append(f"({left_out} left out: bridges, bus 00 and the like; --all lists them)")
    return "\n".join(lines) + "\n"


def _row(d: Device) -> tuple[str, ...]:
    eligible = "yes" if d.eligible else "no" if d.reported else "left out"
    return (
        d.address,
        f"{d.vendor_id or '?'}:{d.device_id or '?'}",
        d.class_code or "?",
        d.driver or "-",
        str(d.iommu_group) if d.iommu_group >= 0 else "-",
        str(d.numa_node) if d.numa_node >= 0 else "-",
        eligible,
        d.resource_name or "-",
        d.name,
    )


def _load_pci_ids(command: str, path: str | None) -> PciIds | None:
    """The database, with its problem said once on stderr; None when a file named by the
    user cannot be used (a silent fallback to hex IDs would print wrong names)."""
    pci_ids = PciIds.load(path)
    if pci_ids.problem and path is not None:
        _fail(command, f"--pci-ids {path}: {pci_ids.problem}")
        return None
    for problem in (pci_ids.problem, pci_ids.damage_report):
        if problem:
            print(f"warning: {problem}", file=sys.stderr)
    return pci_ids


def _write(text: str) -> None:
    """Print to stdout; a reader that went away (`| head`) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _fail(command: str, message: str) -> int:
    print(f"passthrough {command}: {message}", file=sys.stderr)
    return EXIT_USAGE
