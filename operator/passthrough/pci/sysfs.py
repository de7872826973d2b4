"""Every read of sysfs and procfs the agent makes, and its only writes (the vfio bind sequence),
relative to roots a test can point elsewhere.

A read or write that fails raises SysfsError, whose message names the file and the problem.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


class SysfsError(Exception):
    """A sysfs or procfs file that is missing, unreadable or not what the kernel writes."""


class SysfsWriteError(SysfsError):
    """The kernel refused a write; `errno` says how (ENOENT: the file, or its device, is gone)."""

    def __init__(self, message: str, path: Path, errno: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


# The files the bind sequence writes, and the only ones a confined process (the binder) may.
BIND_FILES = frozenset({"driver_override", "unbind", "bind", "drivers_probe"})
_beneath: str | None = None  # set by `confine`: the real path every write must resolve under


def confine(root: Path) -> None:
    """From now on this process writes only the bind files, and only below `root` (its real
    path): a write anywhere else is refused before the file is opened."""
    global _beneath
    _beneath = os.path.realpath(root)


def _check_confined(path: Path) -> None:
    if _beneath is None:
        return
    name = os.path.basename(path)
    parent = os.path.realpath(os.path.dirname(path))
    if name not in BIND_FILES:
        raise SysfsWriteError(f"{path} is not a file the bind sequence writes ({', '.join(sorted(BIND_FILES))})", path, None)
    if os.path.commonpath([parent, _beneath]) != _beneath:
        raise SysfsWriteError(f"{path} leads to {parent}, outside {_beneath}", path, None)


def write_text(path: Path, text: str) -> None:
    """Write `text` to a sysfs attribute in one write(2), as `echo -n text > path` does.

    Never creates a file: an attribute that is not there is an error (its device is gone),
    and the kernel takes a value only whole, so a short write is an error too. Never follows
    a symlink in the last component (sysfs attributes are regular files; a link there was
    put by someone else), and in a confined process (`confine`) writes only the bind files.
    """
    data = text.encode("ascii")
    try:
        _check_confined(path)
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        raise SysfsWriteError(f"writing {text!r} to {path} failed ({e.strerror or e})", path, e.errno) from None
    if written != len(data):
        raise SysfsWriteError(f"writing {text!r} to {path} stopped after {written} bytes", path, None)


def read_text(path: Path) -> str:
    # os.read, not Path.read_text: a scan reads a dozen attributes per function, and the text
    # layers (a buffered reader, a decoder) cost twice the system calls themselves.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
        finally:
            os.close(fd)
    except OSError as e:
        raise SysfsError(f"{path} is unreadable ({e.strerror or e})") from None
    return b"".join(chunks).decode("ascii", errors="replace").strip()


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
    # The kernel writes these from an int: anything longer is garbage, not a big number.
    if not re.fullmatch(r"-?[0-9]{1,10}", text) or not -(2**31) <= int(text) < 2**31:
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


def driver_of(entry: Path) -> str | None:
    """A device's driver by its `driver` link ("" when it has none), None when the device is gone
    (`entry`: its directory). A readlink takes no device lock: it never waits behind a write."""
    try:
        return os.path.basename(os.readlink(os.path.join(entry, "driver")))
    except OSError:
        return "" if os.path.lexists(entry) else None


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


def read_devnum(path: Path) -> tuple[int, int]:
    """A block device's `dev` attribute (`259:3`) as (major, minor)."""
    text = read_text(path)
    match = re.fullmatch(r"([0-9]{1,10}):([0-9]{1,10})", text)
    if not match:
        raise SysfsError(f"{path} holds {text[:40]!r}, not a device number like 259:1")
    return int(match.group(1)), int(match.group(2))


def read_uevent(path: Path) -> dict[str, str]:
    """A `uevent` attribute's KEY=value lines (a partition's PARTNAME, a disk's DEVTYPE)."""
    return dict(line.split("=", 1) for line in read_text(path).splitlines() if "=" in line)


def _unescape(field: str) -> str:
    # The mount and swap tables write space, tab, newline and backslash as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    """One line of a mountinfo table."""

    devnum: tuple[int, int]  # st_dev of the filesystem: the block device's, or (0, N) when it has none of its own
    mountpoint: str
    fstype: str
    source: str  # what was mounted, as given to mount(2): /dev/nvme0n1p2, /dev/root, tank/home, tmpfs


def mountinfo_file(proc_root: Path) -> Path:
    """The host's mount table.

    `<proc>/self/mountinfo` is the reader's own mount namespace: in a container (the agent's
    DaemonSet mounts the host's /proc at /host/proc) that misses a disk mounted only on the
    host. PID 1's table is the host's; fall back where it is not readable.
    """
    init = proc_root / "1" / "mountinfo"
    return init if os.access(init, os.R_OK) else proc_root / "self" / "mountinfo"


def read_mountinfo(proc_root: Path) -> list[Mount]:
    """The host's mounts. A line not laid out as the kernel writes it is an error, not skipped:
    it could be the one that mounts a disk."""
    path = mountinfo_file(proc_root)
    mounts = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        # ID parent MAJ:MIN root mountpoint options [optional fields...] - fstype source superoptions
        fields = line.split(" ")
        devnum = re.fullmatch(r"([0-9]{1,10}):([0-9]{1,10})", fields[2]) if len(fields) > 2 else None
        try:
            dash = fields.index("-", 6)
        except ValueError:
            dash = -1
        if devnum is None or dash < 0 or len(fields) < dash + 3:
            raise SysfsError(f"{path} line {number} is not a mountinfo line: {line[:80]!r}")
        mounts.append(
            Mount(
                devnum=(int(devnum.group(1)), int(devnum.group(2))),
                mountpoint=_unescape(fields[4]),
                fstype=fields[dash + 1],
                source=_unescape(fields[dash + 2]),
            )
        )
    return mounts


def read_swaps(proc_root: Path) -> list[tuple[str, str]]:
    """The swap areas in use as (path, type): type `partition` for any block device (dm and md
    included), `file` for a swap file (whose filesystem is mounted, and found as such)."""
    path = proc_root / "swaps"
    swaps = []
    for number, line in enumerate(read_text(path).splitlines()[1:], start=2):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2:
            raise SysfsError(f"{path} line {number} is not a swaps line: {line[:80]!r}")
        swaps.append((_unescape(fields[0]), fields[1]))
    return swaps


def zfs_pools(proc_root: Path) -> list[str]:
    """The imported ZFS pools: each has a directory in `<proc>/spl/kstat/zfs` (the module's
    own statistics there are files); [] without ZFS."""
    base = proc_root / "spl" / "kstat" / "zfs"
    return [name for name in entries(base) if (base / name).is_dir()]
