"""Broken sysfs and procfs trees, as JSON descriptions that `materialise` builds under a test's tmp_path.

A description is a ready-made fixture host (`e2e.fakesysfs`, the real kernel layout) and the
changes that break it:

    {"why": "...", "base": "gpu_node", "changes": [
        {"at": "dev:0000:3b:00.0/iommu_group", "make": "link", "to": "iommu_group", "device": "0000:3b:00.0"},
        {"at": "proc/mounts", "make": "file", "b64": "..."}]}

`at` is a path below the host's root (`sys/...`, `proc/...`), or `dev:<address>/<path>`
below a device's directory in the device tree. `make` is one of
- `missing`: removed (a file, a link, or a directory with everything in it);
- `dir`: an empty directory in its place (reading it fails with EISDIR, as root ignores modes);
- `mkdir`: a directory made if it is not there (what is in it stays);
- `file`: a regular file holding `text` (UTF-8; surrogate escapes give raw bytes), `b64`,
  or `repeat` written `times` times (a huge attribute, made on the fly);
- `link`: a symlink to `to`, taken as it is when relative (`driver` in the device's own
  directory is a loop onto itself), or from the host's root when it starts with `/`.
`device` (optional) says the change touches only that device (and the devices below it);
a change without it may touch anything. FIFOs are never made: reading one blocks.

Every path and every link target must stay inside the host's root: the real /sys is never
read or written.
"""

from __future__ import annotations

import atexit
import base64
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from e2e import fakesysfs
from tests.corpus import scratch_dir

BASES = {"gpu_node": fakesysfs.gpu_node, "storage_node": fakesysfs.storage_node}
MAX_FILE = 8 << 20

# Devices of the ready-made hosts (address -> IOMMU group), their links, and what hangs off them.
DEVICES = {
    "gpu_node": ["0000:00:00.0", "0000:00:03.0", "0000:00:07.0", "0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0", "0000:af:00.1"],
    "storage_node": ["0000:00:00.0", "0000:00:01.0", "0000:00:02.0", "0000:18:00.0", "0000:18:00.1", "0000:3d:00.0"],
}
NETDEVS = {"storage_node": {"eth0": "0000:18:00.0", "eth1": "0000:18:00.1"}}
BLOCKS = {"storage_node": {"nvme0n1": "0000:3d:00.0", "nvme0n1p1": "0000:3d:00.0", "nvme0n1p2": "0000:3d:00.0"}}
ATTRIBUTES = ["vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node", "driver_override"]
LINKS = ["driver", "iommu_group", "subsystem"]
BLOCK_ATTRIBUTES = ["holders", "slaves", "dev", "uevent", "partition", "dm", "dm/name", "multipath", "hidden"]
GLOBAL = [
    "sys/bus/pci/devices", "sys/bus/pci", "sys/kernel/iommu_groups", "sys/kernel", "sys/class/net",
    "sys/class/block", "sys/block", "sys/bus/pci/drivers/vfio-pci", "sys/module/vfio_pci", "sys/fs/btrfs",
    "sys/kernel/iommu_groups/20/devices", "sys/kernel/iommu_groups/32/devices", "sys/devices/virtual/block",
    "proc", "proc/self", "proc/self/mountinfo", "proc/1/mountinfo", "proc/mounts", "proc/1/mounts", "proc/swaps",
    "proc/spl/kstat/zfs",
]  # fmt: skip


@dataclass
class Host:
    root: Path
    sysfs: Path
    proc: Path
    skipped: list[str] = field(default_factory=list)  # changes that could not be made, and why


def device_dirs(sysfs: Path) -> dict[str, Path]:
    bus = sysfs / "bus" / "pci" / "devices"
    return {a: Path(os.path.realpath(bus / a)) for a in sorted(os.listdir(bus))}


_TEMPLATES: dict[str, Path] = {}


def _template(base: str) -> Path:
    """The ready-made host, built once per process (copying it is ten times faster than building it)."""
    if base not in _TEMPLATES:
        folder = Path(tempfile.mkdtemp(prefix=f"corpus-{base}-", dir=scratch_dir()))
        atexit.register(shutil.rmtree, folder, True)
        BASES[base](folder / "host")
        _TEMPLATES[base] = folder / "host"
    return _TEMPLATES[base]


def materialise(description: dict, root: Path) -> Host:
    """Build the described host under `root` (which must not exist yet, or be empty)."""
    root = Path(os.path.realpath(root))
    shutil.copytree(_template(description["base"]), root, symlinks=True, dirs_exist_ok=True)
    host = Host(root, root / "sys", root / "proc")
    devices = device_dirs(host.sysfs)
    for change in description.get("changes", []):
        try:
            _apply(change, root, devices)
        except OSError as e:  # a parent a change before removed or made a file
            host.skipped.append(f"{change['at']}: {e.strerror or e}")
    return host


def affected(description: dict) -> set[str] | None:
    """The devices the changes touch (with the devices below them); None: any device may be touched."""
    scoped = set()
    for change in description.get("changes", []):
        if "device" not in change:
            return None
        scoped.add(change["device"])
    return scoped


def _inside(path: str | Path, root: Path) -> Path:
    normal = os.path.normpath(path)
    if normal != str(root) and not normal.startswith(str(root) + os.sep):
        raise ValueError(f"{path} is outside the fixture host {root}")
    return Path(normal)


def _resolve(at: str, root: Path, devices: dict[str, Path]) -> Path:
    if ".." in Path(at).parts or at.startswith("/"):
        raise ValueError(f"{at!r}: a change's path is relative to the host, without '..'")
    if at.startswith("dev:"):
        address, _, rest = at[4:].partition("/")
        path = devices[address] / rest if rest else devices[address]
    else:
        path = root / at
    parent = Path(os.path.realpath(path.parent))  # a link on the way (class/net/eth0) stays inside too
    return _inside(parent / path.name, root)


def _clear(path: Path) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _content(change: dict) -> bytes:
    if "b64" in change:
        data = base64.b64decode(change["b64"])
    elif "repeat" in change:
        unit = change["repeat"].encode("utf-8", "surrogateescape")
        if len(unit) * change["times"] > MAX_FILE:
            raise ValueError(f"{change['at']}: over {MAX_FILE} bytes")
        data = unit * change["times"]
    else:
        data = change.get("text", "").encode("utf-8", "surrogateescape")
    return data


def _apply(change: dict, root: Path, devices: dict[str, Path]) -> None:
    path = _resolve(change["at"], root, devices)
    make = change["make"]
    if make == "mkdir":
        path.mkdir(parents=True, exist_ok=True)
        return
    if make != "missing":
        path.parent.mkdir(parents=True, exist_ok=True)
    _clear(path)
    if make == "dir":
        path.mkdir()
    elif make == "file":
        path.write_bytes(_content(change))
    elif make == "link":
        to = change["to"]
        if to.startswith("/"):
            target = _inside(root / to.lstrip("/"), root)
            to = os.path.relpath(target, path.parent)
        else:
            _inside(path.parent / to, root)
        path.symlink_to(to)
    elif make != "missing":
        raise ValueError(f"{change['at']}: unknown change {make!r}")


# --- Strategies -------------------------------------------------------------------------------

NASTY_TEXT = [
    "", "\n", " ", "0x", "0x\n", "0x10de0x10de\n", "0X10DE\n", " 0x10de \n", "0x10de\x00", "0x-1\n", "-0x1\n",
    "0x1g2h\n", "zzzz\n", "-1\n", "-2\n", "-99999999999999999999\n", "99999999999999999999\n",
    "9223372036854775808\n", "\u0663\n", "\u00b2\n", "0x\uff11\uff10\uff44\uff45\n", "(null)\n", "1e3\n", "+1\n",
    "0b1\n", "nan\n", "0x10de\n0x10de\n", "\t0x10de\t\n", "0x0000\n", "0xffff\n", "0xFFFFFF\n",
    "0x030200extra\n", "0x1003\n", "0xffffffffffffffffff\n", "up\n", "down\n", "\udcff\udcfe\n",
]  # fmt: skip
WEIRD_NAMES = [
    "\u00b2", "-1", "99999999999999999999", "\u0661\u0662", "0x1f", "abc", "1 2", "\udcff", "a\nb", "x" * 255,
    " 7", "07", "+3", "3\t", "\u0663", "20", "0",
]  # fmt: skip

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
contents = st.one_of(
    st.sampled_from(NASTY_TEXT).map(lambda t: {"text": t}),
    st.binary(max_size=64).map(lambda b: {"b64": base64.b64encode(b).decode()}),
    _text.map(lambda t: {"text": t}),
    st.integers().map(lambda i: {"text": f"{i}\n"}),
    st.integers(0, 2**70).map(lambda i: {"text": f"0x{i:x}\n"}),
    st.tuples(st.sampled_from(["0", "0x10de", "\udcff", "\n"]), st.integers(10**4, 10**6)).map(
        lambda rt: {"repeat": rt[0], "times": rt[1]}
    ),
)
names = st.one_of(
    st.sampled_from(WEIRD_NAMES),
    st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(
        lambda s: s not in (".", "..")
    ),
)


def _breakage(at: str, device: str | None, own_name: str) -> st.SearchStrategy[list[dict]]:
    """Every way to break one entry: gone, a directory, garbled, a loop, dangling."""
    tag = {"device": device} if device else {}

    def one(**change: Any) -> list[dict]:
        return [{"at": at, **change, **tag}]

    return st.one_of(
        st.just(one(make="missing")),
        st.just(one(make="dir")),
        contents.map(lambda c: one(make="file", **c)),
        st.just(one(make="link", to=own_name)),  # a loop onto itself
        st.just([{"at": at, "make": "link", "to": f"{own_name}.loop", **tag},
                 {"at": f"{at}.loop", "make": "link", "to": own_name, **tag}]),  # a loop of two
        st.just(one(make="link", to="gone")),
        st.just(one(make="link", to="/sys")),
    )


@st.composite
def _device_change(draw, base: str) -> list[dict]:
    address = draw(st.sampled_from(DEVICES[base]))
    kind = draw(st.sampled_from(["attribute", "link", "renamed", "net"]))
    if kind == "attribute":
        name = draw(st.sampled_from(ATTRIBUTES))
        return draw(_breakage(f"dev:{address}/{name}", address, name))
    if kind == "link":
        name = draw(st.sampled_from(LINKS))
        return draw(_breakage(f"dev:{address}/{name}", address, name))
    if kind == "renamed":  # the link points at a real directory with a name sysfs never uses
        link = draw(st.sampled_from(["driver", "iommu_group"]))
        where = "sys/kernel/iommu_groups" if link == "iommu_group" else "sys/bus/pci/drivers"
        name = draw(names)
        return [{"at": f"{where}/{name}", "make": "mkdir", "device": address},
                {"at": f"dev:{address}/{link}", "make": "link", "to": f"/{where}/{name}", "device": address}]
    ifname = draw(st.sampled_from(["eth0", "eth9"]))
    entry = draw(st.sampled_from(["flags", "operstate"]))
    return draw(_breakage(f"dev:{address}/net/{ifname}/{entry}", address, entry))


@st.composite
def _bus_entry_change(draw, base: str) -> list[dict]:
    bus = "sys/bus/pci/devices"
    address = draw(st.sampled_from(DEVICES[base]))
    if draw(st.booleans()):
        return draw(_breakage(f"{bus}/{address}", address, address))
    # An entry the kernel never makes: a name like an address but not one, or a second link to a device.
    name = draw(st.one_of(st.sampled_from(["0000:3b:00.8", "0000:3B:00.0", "00000:3b:00.0", "0000:3b:00.0 ",
                                           "junk", "0000:3b:00.9", "10000:3b:00.0", "0000:3b:0.0"]), names))
    if "/" in name or name in DEVICES[base]:
        name = "junk"
    to = draw(st.sampled_from(["/sys/devices", "gone", name, "/sys/bus/pci/drivers_probe",
                               f"/sys/bus/pci/devices/{address}"]))  # fmt: skip
    return [{"at": f"{bus}/{name}", "make": "link", "to": to}]


@st.composite
def _class_change(draw, base: str) -> list[dict]:
    entries = {**{f"sys/class/net/{n}": a for n, a in NETDEVS.get(base, {}).items()},
               **{f"sys/class/block/{n}": a for n, a in BLOCKS.get(base, {}).items()}}  # fmt: skip
    if not entries:
        return draw(_global_change(base))
    at = draw(st.sampled_from(sorted(entries)))
    name = at.rsplit("/", 1)[1]
    if at.startswith("sys/class/block/") and draw(st.booleans()):
        attribute = draw(st.sampled_from(BLOCK_ATTRIBUTES))
        return draw(_breakage(f"{at}/{attribute}", entries[at], attribute.rsplit("/", 1)[-1]))
    if at.startswith("sys/class/block/") and draw(st.booleans()):
        holder, folder = draw(names), draw(st.sampled_from(["holders", "slaves", "multipath"]))
        to = draw(st.sampled_from(["gone", "/sys/devices/virtual/block", "/sys/class/block/nvme0n1", holder]))
        return [{"at": f"{at}/{folder}/{holder}", "make": "link", "to": to, "device": entries[at]}]
    return draw(_breakage(at, entries[at], name))


MOUNT_LINES = [
    "/dev/nvme0n1p1 / ext4 rw 0 0", "/dev/nvme0n1p1 /data\\040x ext4 rw 0 0", "/dev/nvme0n1p2 /mnt\\777 xfs rw 0 0",
    "/dev/\\777 /x ext4 rw 0 0", "/", "/dev/nvme0n1p1", "", "   ", "none", "/dev/ /", "/dev/nvme0n1p1\t/\text4",
]  # fmt: skip
MOUNTINFO_LINES = [
    "36 25 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw",
    "37 25 259:2 / /data\\040x rw - xfs /dev/root rw",
    "38 25 0:44 / /tank rw - zfs tank/home rw",
    "39 25 259:1 / /a rw shared:1 master:2 - ext4 /dev/nvme0n1p1 rw",
    "40 25 259:1 / /b rw -", "41 25 259:1", "41 25 259 / /c rw - ext4 x rw", "42 25 -1:-1 / /d rw - ext4 x rw",
    "43 25 99999999999999999999:1 / /e rw - ext4 /dev/x rw", "44 25 259:1 / /f rw - - - -", "- - - - - - - -",
    "45 25 259:1 / /g rw - ext4", "46  25 259:1  / /h rw - ext4 /dev/x rw", "", " ", "\t",
]  # fmt: skip
SWAP_LINES = ["Filename Type Size Used Priority", "/dev/nvme0n1p2 partition 8388604 0 -2", "/dev/\\000", "", "x", " /",
              "/swapfile file 1024 0 -2", "/dev/dm-0 partition 1 0 -2 extra"]  # fmt: skip
PROC_FILES = {"mounts": MOUNT_LINES, "1/mounts": MOUNT_LINES, "self/mountinfo": MOUNTINFO_LINES,
              "1/mountinfo": MOUNTINFO_LINES, "swaps": SWAP_LINES}  # fmt: skip


@st.composite
def _proc_change(draw, base: str) -> list[dict]:
    which = draw(st.sampled_from(sorted(PROC_FILES)))
    if which == "swaps" or draw(st.booleans()):
        lines = draw(st.lists(st.one_of(st.sampled_from(PROC_FILES[which]), _text), max_size=6))
        return [{"at": f"proc/{which}", "make": "file", "text": "\n".join(lines) + "\n"}]
    # A ZFS pool, or a directory of the ZFS module that is not one.
    pool = draw(names)
    return [{"at": f"proc/spl/kstat/zfs/{pool}", "make": draw(st.sampled_from(["mkdir", "file"]))}]


@st.composite
def _global_change(draw, base: str) -> list[dict]:
    at = draw(st.sampled_from(GLOBAL))
    return draw(_breakage(at, None, at.rsplit("/", 1)[-1]))


@st.composite
def trees(draw) -> dict:
    """A description of a fixture host with one to five things broken in it."""
    base = draw(st.sampled_from(sorted(BASES)))
    kinds = [_device_change, _device_change, _bus_entry_change, _class_change, _proc_change, _global_change]
    changes: list[dict[str, Any]] = []
    for _ in range(draw(st.integers(1, 5))):
        changes += draw(draw(st.sampled_from(kinds))(base))
    return {"base": base, "changes": changes}


def scoped_trees() -> st.SearchStrategy[dict]:
    """Trees whose every change touches named devices only (for "hides no other device")."""
    return trees().filter(lambda d: affected(d) is not None)
