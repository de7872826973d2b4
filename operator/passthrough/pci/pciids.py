"""The PCI ID database (pci.ids): vendor, device, subsystem and class names by hex ID.

Loading never fails: a missing or damaged file gives an empty database whose `problem`
says that names fall back to hex IDs, and how to fix it. A damaged line is skipped and noted
with its line number (`damage`, `damage_report`); the rest of the file is still used.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

SEARCH_PATHS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids")

# Names are split from IDs on any run of blanks: the file uses two spaces, hand edits do not.
_VENDOR = re.compile(r"([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_DEVICE = re.compile(r"\t([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_SUBSYSTEM = re.compile(r"\t\t([0-9A-Fa-f]{4})[ \t]+([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_CLASS = re.compile(r"C[ \t]+([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_SUBCLASS = re.compile(r"\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_PROG_IF = re.compile(r"\t\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_EDITION = re.compile(r"#\s*Version:\s*(\S+)")

_CONSEQUENCE = (
    "device names fall back to hex IDs and GPU resource names become <domain>/<device-id>, "
    "which an allow-list written for named resources will not match"
)
_FIX = "install the hwdata (or pciutils) package, or pass --pci-ids FILE"
# The real file is under 2 MiB; one this size is something else, and reading it whole would
# cost the agent that much memory on every node.
MAX_SIZE = 256 << 20
# Damaged lines noted one by one; the rest are only counted (a binary file has thousands).
NOTED_DAMAGE = 20


class PciIds:
    """An in-memory pci.ids. IDs are looked up case-insensitively."""

    def __init__(self, path: Path | None = None, edition: str = "", problem: str = "") -> None:
        self.path = path
        self.edition = edition
        self.problem = problem
        self.damaged_lines = 0  # lines skipped
        # (line number, what is wrong with it), in line order: the first NOTED_DAMAGE of the
        # skipped lines, and the first line that is not UTF-8 (read with U+FFFD, not skipped).
        self.damage: list[tuple[int, str]] = []
        self._vendors: dict[str, str] = {}
        self._devices: dict[tuple[str, str], str] = {}
        self._subsystems: dict[tuple[str, str, str, str], str] = {}
        self._classes: dict[str, str] = {}  # "03", "0302", "030200"

    def __repr__(self) -> str:
        return f"PciIds(path={self.path!r}, edition={self.edition!r}, vendors={len(self._vendors)})"

    @classmethod
    def load(cls, path: str | Path | None = None, host_root: str | Path | None = None) -> PciIds:
        """The database at `path`, or the first of SEARCH_PATHS that exists; never raises.

        `host_root`: where the host's filesystem is mounted (the agent's pod sees the node's
        /usr/share at /host/usr/share): its SEARCH_PATHS come first, so names follow the
        node's own pci.ids as on the host, and the image's own database is the fallback.
        """
        if path is None:
            candidates = [*(str(Path(host_root) / p.lstrip("/")) for p in SEARCH_PATHS if host_root), *SEARCH_PATHS]
            found = next((Path(p) for p in candidates if Path(p).is_file()), None)
            if found is None:
                return cls(problem=f"no pci.ids found (looked in {', '.join(candidates)}); {_CONSEQUENCE}; {_FIX}")
            path = found
        path = Path(path)
        try:
            # A FIFO or a device (--pci-ids /dev/stdin, /dev/zero) would block or never end.
            if not stat.S_ISREG(os.stat(path).st_mode):
                return cls(path=path, problem=f"pci.ids {path} is not a regular file; {_CONSEQUENCE}; {_FIX}")
            with open(path, "rb") as f:
                data = f.read(MAX_SIZE + 1)
        except OSError as e:
            return cls(path=path, problem=f"cannot read pci.ids {path} ({e.strerror or e}); {_CONSEQUENCE}; {_FIX}")
        if len(data) > MAX_SIZE:
            return cls(
                path=path,
                problem=f"pci.ids {path} is over {MAX_SIZE >> 20} MiB, too large to be a PCI ID database "
                f"(the real one is under 2 MiB); {_CONSEQUENCE}; {_FIX}",
            )
        try:
            return cls.parse(data.decode("utf-8"), path)
        except UnicodeDecodeError as e:
            db = cls.parse(data.decode("utf-8", errors="replace"), path)
            line = data.count(b"\n", 0, e.start) + 1
            column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
            db.damage.append((line, f"is not UTF-8 (byte 0x{data[e.start]:02x} at column {column}); its bad bytes read as U+FFFD"))
            db.damage.sort(key=lambda note: note[0])
            return db

    @classmethod
    def parse(cls, text: str, path: Path | None = None) -> PciIds:
        db = cls(path=path)
        vendors, devices, subsystems, classes = db._vendors, db._devices, db._subsystems, db._classes
        vendor = device = klass = subclass = None
        in_classes = False
        damaged = 0
        for number, line in enumerate(text.split("\n"), start=1):
            line = line.rstrip("\r")
            if not line or line.isspace():
                continue
            first = line[0]
            if first == "#":
                if not db.edition:
                    m = _EDITION.match(line)
                    if m:
                        db.edition = m.group(1)
                continue
            # A damaged line is skipped and changes no context, so it hides nothing after it.
            # Of two entries for one ID the first wins, as in the NVIDIA plugin's lookup.
            wrong = ""
            if first != "\t":
                if first == "C" and (m := _CLASS.fullmatch(line)):
                    in_classes, vendor, device, subclass = True, None, None, None
                    klass = m.group(1).lower()
                    classes.setdefault(klass, _name(m.group(2)))
                elif m := _VENDOR.fullmatch(line):
                    in_classes, device, klass, subclass = False, None, None, None
                    vendor = m.group(1).lower()
                    vendors.setdefault(vendor, _name(m.group(2)))
                elif first in " \v\f":
                    wrong = "is indented with spaces; the format indents with tabs"
                else:
                    wrong = "is neither a vendor line (4 hex digits, blanks, a name) nor a class line (C, 2 hex digits, a name)"
            elif line.startswith("\t\t\t"):
                wrong = "is indented three tabs deep; the format has two levels below a vendor or class"
            elif in_classes:
                if line[1:2] != "\t" and klass and (m := _SUBCLASS.fullmatch(line)):
                    subclass = klass + m.group(1).lower()
                    classes.setdefault(subclass, _name(m.group(2)))
                elif subclass and (m := _PROG_IF.fullmatch(line)):
                    classes.setdefault(subclass + m.group(1).lower(), _name(m.group(2)))
                elif line[1:2] != "\t":
                    wrong = "is not a subclass line (a tab, 2 hex digits, blanks, a name)"
                elif subclass:
                    wrong = "is not a programming interface line (two tabs, 2 hex digits, blanks, a name)"
                else:
                    wrong = "is a programming interface line outside any subclass"
            elif line[1:2] != "\t":
                if vendor and (m := _DEVICE.fullmatch(line)):
                    device = m.group(1).lower()
                    devices.setdefault((vendor, device), _name(m.group(2)))
                elif vendor:
                    wrong = "is not a device line (a tab, 4 hex digits, blanks, a name)"
                else:
                    wrong = "is a device line outside any vendor"
            elif vendor and device and (m := _SUBSYSTEM.fullmatch(line)):
                key = (vendor, device, m.group(1).lower(), m.group(2).lower())
                subsystems.setdefault(key, _name(m.group(3)))
            elif vendor and device:
                wrong = "is not a subsystem line (two tabs, 4 hex digits, a blank, 4 hex digits, blanks, a name)"
            else:
                wrong = "is a subsystem line outside any device"
            if wrong:
                damaged += 1
                if damaged <= NOTED_DAMAGE:
                    db.damage.append((number, f"{_show(line)} {wrong}"))
        db.damaged_lines = damaged
        if not vendors:
            where = f"pci.ids {path}" if path else "pci.ids"
            db.problem = f"{where} is damaged (no vendor entries in it); {_CONSEQUENCE}; {_FIX}"
        return db

    @property
    def damage_report(self) -> str:
        """The damaged lines in one sentence that says what to do; "" when there are none."""
        if not self.damage:
            return ""
        where = f"pci.ids {self.path}" if self.path else "pci.ids"
        notes = "; ".join(f"line {number}: {text}" for number, text in self.damage)
        unnoted = self.damaged_lines - min(self.damaged_lines, NOTED_DAMAGE)
        more = f"; and {unnoted} more damaged lines" if unnoted else ""
        return (
            f"{where} has damaged lines ({notes}{more}); devices named on them fall back to hex IDs; "
            "reinstall the hwdata (or pciutils) package, or fix the file"
        )

    def vendor_name(self, vendor_id: str) -> str | None:
        return self._vendors.get(vendor_id.lower())

    def device_name(self, vendor_id: str, device_id: str) -> str | None:
        return self._devices.get((vendor_id.lower(), device_id.lower()))

    def subsystem_name(self, vendor_id: str, device_id: str, subvendor_id: str, subdevice_id: str) -> str | None:
        key = (vendor_id.lower(), device_id.lower(), subvendor_id.lower(), subdevice_id.lower())
        return self._subsystems.get(key)

    def class_name(self, class_code: str) -> str | None:
        """The name lspci shows for a class code of 2, 4 or 6 hex digits.

        The subclass name ("3D controller"), with the programming interface in brackets
        when it has one ("Non-Volatile memory controller (NVM Express)"); the base class
        name when the subclass is unknown.
        """
        code = class_code.lower()
        base = self._classes.get(code[:2])
        sub = self._classes.get(code[:4]) if len(code) >= 4 else None
        prog_if = self._classes.get(code[:6]) if len(code) >= 6 else None
        if sub is None:
            return base
        return f"{sub} ({prog_if})" if prog_if else sub


def _show(line: str) -> str:
    # A binary file's "line" can be megabytes long.
    return repr(line) if len(line) <= 60 else repr(line[:60]) + "..."


def _name(text: str) -> str:
    # Only blanks: anything else at the end of a name is left for the naming rule to judge.
    return text.rstrip(" \t")
