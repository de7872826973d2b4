"""Whether the host uses a device's disks: the block devices below it and everything stacked on
them (LVM, dm-crypt, RAID, multipath), against what is mounted, swapped on or in a ZFS pool.

Read from sysfs (`class/block`, `holders/`, btrfs' member lists) and procfs (mountinfo, swaps,
ZFS's pools); a disk whose use cannot be told keeps its device back, as a disk in use does.
`discovery` asks `block_in_use` for each device it judges.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from passthrough.pci import sysfs
from passthrough.pci.sysfs import SysfsError

# What a block device is used for, most telling first: the admin reads the first one found.
ROOT, MOUNTED, SWAP, ZFS, UNKNOWN, HELD = range(6)
# Deeper than any stack the kernel builds (dm-crypt on LVM on RAID on a partition is 4).
MAX_STACK = 16
STORAGE_CLASS = "01"
THROUGH = " to pass this device through"
ASK_AGAIN = (
    "let the agent read the host's /proc/1/mountinfo, /proc/swaps and /sys/class/block "
    "(the chart mounts the host's /proc at /host/proc) and rescan"
)


class Blocks:
    """The host's block devices by kernel name (`<sysfs>/class/block`), for following holders
    and for naming the device behind a path in the mount and swap tables."""

    def __init__(self, sysfs_root: Path, members: dict[str, Path]) -> None:
        self.base = sysfs_root / "class" / "block"
        self.paths = members
        self.error = ""  # why class/block could not be listed: then no disk is known
        self._dm_names: dict[str, str] | None = None
        self._heads: dict[str, str] | None = None

    def dm_name(self, name: str) -> str:
        """A device-mapper device's name (`vg0-root` for dm-0); "" when it has none."""
        try:
            return sysfs.read_text(self.base / name / "dm" / "name")
        except SysfsError:
            return ""

    def named(self, path: str, device: bool = False) -> str | None:
        """The block device behind a path of the mount or swap table, or None.

        The kernel names its nodes in /dev after the device (`/dev/nvme0n1p2`, `/dev/dm-1`);
        device-mapper's own names live under /dev/mapper. Any other path (`/dev/root`, a
        by-uuid link left unresolved) names no device this way. `device`: the path is known to
        be a block device's (a swap partition), wherever it is shown: seen from a container,
        the host's /dev can be printed without its /dev.
        """
        base = os.path.basename(path)
        if (device or path.startswith("/dev/")) and base in self.paths:
            return base
        if path.startswith("/dev/mapper/"):
            if self._dm_names is None:
                self._dm_names = {self.dm_name(n): n for n in self.paths if n.startswith("dm-")}
                self._dm_names.pop("", None)
            return self._dm_names.get(base)
        return None

    def heads(self) -> dict[str, str]:
        """NVMe native multipath: the path disk (`nvme0c0n1`, below its controller) -> the
        disk the host uses (`nvme0n1`, under devices/virtual/nvme-subsystem), listed in the
        head's `multipath/`."""
        if self._heads is None:
            self._heads = {}
            for name in self.paths:
                try:
                    for path_disk in sysfs.entries(self.base / name / "multipath"):
                        self._heads[path_disk] = name
                except SysfsError:
                    continue  # its path disks are then judged without it, as disks of their own
        return self._heads


@dataclass
class Usage:
    """What the host does with its block devices, read from procfs (and sysfs for btrfs).

    Detected: a filesystem on a block device, by the device number in mountinfo (whatever the
    source is called: /dev/root, /dev/mapper/vg0-root); a filesystem on an anonymous device
    (btrfs, whose st_dev is 0:N) by its source and, for btrfs, by `<sys>/fs/btrfs/*/devices`,
    which lists every member of a mounted btrfs; swap on any block device.
    Not detectable from procfs and sysfs: which partitions a ZFS pool uses (ZFS opens its
    disks without a holders link). A whole disk given to `zpool create` gets a partition named
    `zfs-<guid>`, found by its PARTNAME; any other partition on a host with an imported pool
    may be a pool's, so it is not offered (see `_zfs`).
    """

    mounts: dict[tuple[int, int], list[str]]  # device number -> mount points
    mounted: dict[str, list[str]]  # block device name -> mount points, for anonymous-device filesystems
    btrfs: dict[str, str]  # block device name -> the fsid of the mounted btrfs it belongs to
    swaps: set[str]  # block device names
    zfs_pools: list[str]
    problem: str  # why use cannot be told at all; "" when it can
    todo: str = ""  # what to do about the problem

    @classmethod
    def read(cls, proc_root: Path, sysfs_root: Path, blocks: Blocks, problems: list[str]) -> Usage:
        usage = cls({}, {}, {}, set(), [], "")
        errors: list[str] = []
        stray = ""
        try:
            table = sysfs.read_mountinfo(proc_root)
        except SysfsError as e:
            table = []
            errors.append(str(e))
        for mount in table:
            if mount.devnum[0] != 0:
                usage.mounts.setdefault(mount.devnum, []).append(mount.mountpoint)
            elif mount.fstype == "zfs":
                usage.zfs_pools.append(mount.source.split("/")[0])
            elif (name := blocks.named(mount.source)) is not None:
                usage.mounted.setdefault(name, []).append(mount.mountpoint)
            # Else a filesystem without a disk (tmpfs, overlay, nfs), or an anonymous-device one
            # whose source names no disk: btrfs mounted as /dev/root, found through its fsid below.
        # A btrfs is mounted from one of its disks and lives on all of them: sysfs names them all.
        btrfs = sysfs_root / "fs" / "btrfs"
        try:
            for fsid in sysfs.entries(btrfs):
                members = sysfs.entries(btrfs / fsid / "devices")
                where = sorted({point for member in members for point in usage.mounted.get(member, [])})
                for member in members:
                    usage.btrfs[member] = fsid
                    if where:
                        usage.mounted[member] = where
        except SysfsError as e:
            errors.append(str(e))
        try:
            for path, kind in sysfs.read_swaps(proc_root):
                if kind != "partition":
                    continue  # a swap file: its filesystem is mounted, and counts as such
                name = blocks.named(path, device=True)
                if name is None:
                    errors.append(f"swap {path} in {proc_root / 'swaps'} names no block device in {blocks.base}")
                    stray = f"which disk holds swap {path} cannot be told; turn it off (swapoff {shlex.quote(path)})"
                else:
                    usage.swaps.add(name)
        except SysfsError as e:
            errors.append(str(e))
        try:
            usage.zfs_pools = sorted({*usage.zfs_pools, *sysfs.zfs_pools(proc_root)})
        except SysfsError as e:
            errors.append(str(e))
        problems.extend(errors)  # a class/block that cannot be listed is there already
        usage.problem = "; ".join([blocks.error, *errors] if blocks.error else errors)
        usage.todo = stray if stray and usage.problem == errors[0] else ASK_AGAIN
        return usage


def block_in_use(disks: Iterable[str], class_code: str, blocks: Blocks, usage: Usage) -> tuple[str, str] | None:
    """Whether any of a device's block devices (`disks`: those below it in the device tree), or
    anything built on one, is in use: (why, what to do), or None.

    Followed by device number, not by name: mountinfo names a device as it was mounted
    (`/dev/root`, `/dev/mapper/vg0-root`), its major:minor is the kernel's own. Each disk and
    partition, and everything stacked on it through `holders/` (LVM, dm-crypt, RAID), is
    looked up; a holder counts as in use even when nothing on it is mounted.
    """
    names = _disks_of(disks, blocks)
    unlisted = bool(blocks.error) and class_code[:2] == STORAGE_CLASS
    if not names and not unlisted:
        return None
    if usage.problem:
        what = f"block device {names[0]}" if names else "any of its disks"
        return f"whether {what} is in use cannot be told ({usage.problem})", usage.todo
    uses: list[tuple[int, int, str, str]] = []
    for name in names:
        for rank, why, todo in _uses(name, blocks, usage):
            uses.append((rank, len(uses), why, todo))
    if not uses:
        return None
    _, _, why, todo = min(uses)
    return why, todo


def _disks_of(disks: Iterable[str], blocks: Blocks) -> list[str]:
    """The device's disks and partitions, sorted, with the multipath disks built on them."""
    names = set(disks)
    heads = blocks.heads() if names else {}
    for path_disk in list(names):
        head = heads.get(path_disk)
        if head is not None:
            top = blocks.paths[head]
            names.update(n for n, p in blocks.paths.items() if p == top or top in p.parents)
    return sorted(names)


def _uses(top: str, blocks: Blocks, usage: Usage) -> list[tuple[int, str, str]]:
    """Every use of block device `top` and of the stack on it, as (rank, why, todo)."""
    uses: list[tuple[int, str, str]] = []
    seen = {top}

    def unknown(label: str, cause: str, todo: str = "check dmesg and rescan") -> None:
        uses.append((UNKNOWN, f"whether block device {label} is in use cannot be told{cause}", todo))

    def visit(chain: list[str]) -> None:
        name = chain[-1]
        label = _label(chain, blocks)
        path = blocks.paths.get(name)
        if path is None:
            return unknown(label, f" ({blocks.base / name} does not exist)")
        mounted = list(usage.mounted.get(name, []))
        try:
            mounted += usage.mounts.get(sysfs.read_devnum(blocks.base / name / "dev"), [])
        except SysfsError as e:
            unknown(label, f" ({e})", "check the disk (dmesg, lsblk) and rescan")
        if mounted:
            uses.append(_mounted(chain, label, mounted))
        elif name in usage.btrfs:
            why = f"block device {label} is in a mounted btrfs filesystem ({usage.btrfs[name]})"
            uses.append((MOUNTED, why, f"unmount it (findmnt -t btrfs shows where){_and_out(chain)}{THROUGH}"))
        if name in usage.swaps:
            why = f"block device {label} is used as swap"
            uses.append((SWAP, why, f"turn it off (swapoff /dev/{name}){_and_out(chain)}{THROUGH}"))
        try:
            holders = sysfs.entries(blocks.base / name / "holders")
        except SysfsError as e:
            return unknown(label, f" ({e})")
        if len(chain) == 1 and holders:
            why = f"block device {name} is held by {', '.join(holders)} (LVM, RAID or device-mapper)"
            uses.append((HELD, why, f"take it out of that volume (vgreduce, mdadm --remove, dmsetup remove){THROUGH}"))
        elif len(chain) == 1 and not mounted and name not in usage.swaps and usage.zfs_pools:
            uses.extend(_zfs(name, path, usage.zfs_pools))
        for holder in holders:
            if holder in chain:
                todo = f"no kernel builds such a stack; check {blocks.base / name / 'holders'} and dmesg, and rescan"
                unknown(label, f": its holders loop back to {holder}", todo)
            elif len(chain) >= MAX_STACK:
                unknown(label, f": it is stacked more than {MAX_STACK} deep")
            elif holder not in seen:  # a device two of ours hold (RAID on two partitions) is judged once
                seen.add(holder)
                visit([*chain, holder])
        return None

    visit([top])
    return uses


def _mounted(chain: list[str], label: str, where: list[str]) -> tuple[int, str, str]:
    if "/" in where:
        return ROOT, f"block device {label} holds the root filesystem", "this device stays with the host"
    first = sorted(where)[0]
    return (
        MOUNTED,
        f"block device {label} is mounted on {first}",
        f"unmount it (umount {shlex.quote(first)}){_and_out(chain)}{THROUGH}",
    )


def _and_out(chain: list[str]) -> str:
    """The rest of the fix for a use through holders: the disk leaves the stack too."""
    if len(chain) == 1:
        return " and drop it from /etc/fstab"
    holder = chain[1]
    how = "mdadm --remove" if holder.startswith("md") else "vgreduce, dmsetup remove"
    return f", drop it from /etc/fstab and take {chain[0]} out of {holder} ({how})"


def _label(chain: list[str], blocks: Blocks) -> str:
    """`nvme0n1p3 → dm-0 (vg0-root)`: the stack as lsblk would draw it, device-mapper names included."""
    parts = []
    for name in chain:
        dm = blocks.dm_name(name) if name.startswith("dm-") else ""
        parts.append(f"{name} ({dm})" if dm and dm != name else name)
    return " → ".join(parts)


def _zfs(name: str, path: Path, pools: list[str]) -> list[tuple[int, str, str]]:
    """A partition that nothing visibly uses, on a host with an imported ZFS pool.

    ZFS claims its disks without a holders link, and no file of procfs or sysfs lists a
    pool's disks: only the `zfs-<guid>` partition name that `zpool create` gives a whole disk
    says so. Any other partition may be a pool's (`zpool create tank nvme0n1p3`), so it is not
    offered. A disk without partitions is: ZFS partitions every whole disk it is given.
    """
    if not (path / "partition").exists():
        return []
    imported = f"pool {pools[0]} is" if len(pools) == 1 else f"pools {', '.join(pools)} are"
    try:
        label = sysfs.read_uevent(path / "uevent").get("PARTNAME", "")
    except SysfsError as e:
        label, problem = "", f"; {e}"
    else:
        problem = ""
    if label.startswith("zfs-"):
        why = f"block device {name} is a ZFS disk (partition {label}; ZFS {imported} imported)"
        return [(ZFS, why, f"take it out of its pool (zpool status -P shows which){THROUGH}")]
    why = (
        f"whether block device {name} is in a ZFS pool cannot be told (ZFS {imported} imported, "
        f"and ZFS does not show its disks in sysfs{problem})"
    )
    disk = path.parent.name
    todo = (
        f"if zpool status -P lists no partition of {disk}, remove its partitions "
        f"(wipefs -a /dev/{disk}, which erases it){THROUGH}"
    )
    return [(UNKNOWN, why, todo)]
