"""Every read of sysfs and procfs the agent makes, and its only writes (the vfio bind sequence),
relative to roots a test can point elsewhere.

A read or write that fails raises SysfsError, whose message names the file and the problem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


class SysfsError(Exception):
    """A sysfs or procfs file that is missing, unreadable or not what the kernel writes."""


class SysfsWriteError(SysfsError):
    """The kernel refused a write; `errno` says how (ENOENT: the file, or its device, is gone)."""

    def __init__(self, message: str, path: Path, errno: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


def write_text(path: Path, text: str) -> None:
    """Write `text` to a sysfs attribute in one write(2), as `echo -n text > path` does.

    Never creates a file: an attribute that is not there is an error (its device is gone),
    and the kernel takes a value only whole, so a short write is an error too.
    """
    data = text.encode("ascii")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        raise SysfsWriteError(f"writing {text!r} to {path} failed ({e.strerror or e})", path, e.errno) from None
    if written != len(data):
        raise SysfsWriteError(f"writing {text!r} to {path} stopped after {written} bytes", path, None)


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError as e:
        raise SysfsError(f"{path} is unreadable ({e.strerror or e})") from None


def read_hex(path: Path, digits: int | None = None) -> str:
    """A hex attribute as the kernel writes it (`0x10de`), as lowercase digits without `0x`.

    `digits`: the exact width (IDs, class codes); None for a value of any width (flags).
    """
    text = read_text(path)
    width = f"{{{digits}}}" if digits else "{1,16}"
    if not re.fullmatch(rf"0[xX][0-9A-Fa-f]{width}", text):
        example = {4: "0x10de", 6: "0x030200"}.get(digits or 0, "0x1003")
        raise SysfsError(f"{path} holds {text[:40]!r}, not a hex value like {example}")
    return text[2:].lower()


def read_int(path: Path, missing: int | None = None) -> int:
    """A decimal attribute; `missing` is returned when the file does not exist (if given)."""
    if missing is not None and not os.path.lexists(path):
        return missing
    text = read_text(path)
    if not re.fullmatch(r"-?[0-9]+", text):
        raise SysfsError(f"{path} holds {text[:40]!r}, not a number")
    return int(text)


def link_name(path: Path) -> str:
    """The last component of a symlink's target (`driver` -> `nvidia`); "" when there is no link.

    A link whose target does not exist is an error: the kernel never leaves one behind.
    """
    try:
        target = os.readlink(path)
    except FileNotFoundError:
        return ""
    except OSError as e:
        raise SysfsError(f"{path} is not a readable link ({e.strerror or e})") from None
    if not path.exists():
        raise SysfsError(f"{path} points to {target}, which does not exist")
    return os.path.basename(target)


def entries(path: Path) -> list[str]:
    """The names in a directory, sorted; [] when it does not exist."""
    try:
        return sorted(os.listdir(path))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise SysfsError(f"{path} cannot be listed ({e.strerror or e})") from None


def class_devices(sysfs_root: Path, cls: str) -> dict[str, Path]:
    """`<sysfs>/class/<cls>/*` (block, net) by name, each resolved into the device tree.

    A dangling entry is left out: it names nothing that can be in use.
    """
    found = {}
    base = sysfs_root / "class" / cls
    for name in entries(base):
        resolved = Path(os.path.realpath(base / name))
        if resolved.exists():
            found[name] = resolved
    return found


def _unescape(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_file(proc_root: Path) -> Path:
    """The host's mount table.

    `<proc>/mounts` is `self/mounts`: in a container (the agent's DaemonSet mounts the host's
    /proc at /host/proc) that is the container's own mount namespace, which misses a disk
    mounted only on the host. PID 1's table is the host's; fall back where it is not there.
    """
    init = proc_root / "1" / "mounts"
    return init if os.access(init, os.R_OK) else proc_root / "mounts"


def read_mounts(proc_root: Path) -> dict[str, list[str]]:
    """Mount points by the basename of the mounted device (`nvme0n1p1` -> [`/data`])."""
    mounts: dict[str, list[str]] = {}
    for line in read_text(mounts_file(proc_root)).splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0].startswith("/"):
            mounts.setdefault(os.path.basename(_unescape(fields[0])), []).append(_unescape(fields[1]))
    return mounts


def read_swaps(proc_root: Path) -> set[str]:
    """Basenames of the devices used as swap (the header line and swap files match no block device)."""
    lines = read_text(proc_root / "swaps").splitlines()[1:]
    return {os.path.basename(_unescape(line.split()[0])) for line in lines if line.strip()}
