"""Fixture hosts: sysfs and procfs trees laid out exactly as the Linux kernel lays them out.

Devices live under `sys/devices/pci<domain>:<bus>/[<bridge>/]<address>/`, and everything
else reaches them through relative symlinks, as on a real host: `sys/bus/pci/devices/*`,
`driver`, `iommu_group` and its `devices/` back links, `sys/class/net` and
`sys/class/block` (into `net/<ifname>` and the disk and partition directories), block
`holders/` and `slaves/`. Each block device has its `dev` (major:minor, numbered as the kernel
numbers them: sd 8, virtio 252, device-mapper 253, md 9, NVMe and the rest 259), and procfs has
`self/mountinfo` (with `mounts` beside it), `swaps` and, on a ZFS host, `spl/kstat/zfs/<pool>`.
So code that reads the fixture reads a real host the same way.

Next to them, `dev/vfio/` holds a node per IOMMU group while a member is on vfio-pci (and
`vfio` while vfio-pci is loaded), and `fakehost/` what the kernel knows beyond sysfs: each
device's default driver (its driver's ID table matches it), the devices something holds (a VMM,
a CUDA process), the devices that fall off the bus when unbound or probe slowly, and a second
name (hard link) of each `driver_override`. `e2e.fakekernel` reads them to answer the bind
sequence as the kernel does.

While a simulated kernel runs (`e2e.fakekernel`), the control files are mount points of its FUSE
filesystem; a FakeHost in any process of the same mount namespace mounts the control files of
the devices and drivers it adds, and takes the mounts away with what it removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from itertools import cycle
from pathlib import Path

ROOT_PORT = ("8086", "2030", "060400")  # Sky Lake-E PCI Express Root Port A
HOST_BRIDGE = ("8086", "2020", "060000")  # Sky Lake-E DMI3 Registers

# (mountpoint, fstype, source, anonymous minor): what every host has mounted.
_BASE_MOUNTS = (("/sys", "sysfs", "sysfs", 21), ("/proc", "proc", "proc", 22), ("/dev", "devtmpfs", "udev", 5))
_SWAPS_HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
# What the kernel knows of a device beyond sysfs: a folder each under fakehost/, a file per device.
_STATE = ("default_driver", "held", "fragile", "probe_time", "override")


class FakeHost:
    """A host's /sys, /proc and /dev under `root`, grown one device at a time."""

    def __init__(self, root: Path, iommu: bool = True, vfio: bool = True) -> None:
        self._paths(root, iommu)
        for d in ("bus/pci/devices", "bus/pci/drivers", "devices/virtual/block", "class/net", "class/block",
                  "block", "module", "kernel/iommu_groups"):  # fmt: skip
            (self.sysfs / d).mkdir(parents=True, exist_ok=True)
        (self.sysfs / "bus" / "pci" / "drivers_probe").write_text("")
        for d in _STATE:
            (self.state / d).mkdir(parents=True, exist_ok=True)
        self.dev.mkdir(parents=True, exist_ok=True)
        if vfio:
            self.load_vfio()
        (self.proc / "self").mkdir(parents=True, exist_ok=True)
        (self.proc / "self" / "mountinfo").write_text("")
        (self.proc / "self" / "mounts").write_text("")
        (self.proc / "mounts").symlink_to("self/mounts")
        (self.proc / "swaps").write_text(_SWAPS_HEADER)
        for mountpoint, fstype, source, minor in _BASE_MOUNTS:
            self._mount_line((0, minor), mountpoint, fstype, source)

    @classmethod
    def existing(cls, root: Path) -> FakeHost:
        """The host already built under `root` (by another process), left as it is."""
        if not (Path(root) / "sys" / "bus" / "pci").is_dir():
            raise FileNotFoundError(f"{root} holds no fixture host (no sys/bus/pci)")
        host = cls.__new__(cls)
        host._paths(root, iommu=True)
        return host

    def _paths(self, root: Path, iommu: bool) -> None:
        self.root = Path(root)
        self.sysfs = self.root / "sys"
        self.proc = self.root / "proc"
        self.dev = self.root / "dev"
        self.state = self.root / "fakehost"
        self.iommu = iommu
        self._bridges: dict[str, str] = {}  # "dddd:bb" secondary bus -> the bridge's address
        self._next_minor: dict[int, int] = {}  # major -> the next free minor, for dynamic majors

    def load_vfio(self) -> None:
        """`modprobe vfio-pci`: its driver, its module and the VFIO container node appear."""
        self._driver_dir("vfio-pci")
        (self.sysfs / "module" / "vfio_pci").mkdir(parents=True, exist_ok=True)
        (self.dev / "vfio").mkdir(parents=True, exist_ok=True)
        (self.dev / "vfio" / "vfio").touch()

    # --- Devices ----------------------------------------------------------------------

    def add_device(
        self,
        address: str,
        vendor: str,
        device: str,
        class_code: str,
        *,
        driver: str | None = None,
        iommu_group: int | None = None,
        numa_node: int = -1,
        subsystem: tuple[str, str] = ("0000", "0000"),
        parent: str | None = None,
    ) -> Path:
        """One PCI function; returns its directory in the device tree.

        It goes below `parent` (a bridge's address), else below the root port added for its
        bus with `add_root_port`, else directly on its root bus (`pci<domain>:<bus>`).
        """
        domain, bus = address.split(":")[:2]
        if parent is None:
            parent = self._bridges.get(f"{domain}:{bus}")
        base = self.device_dir(parent) if parent else self.sysfs / "devices" / f"pci{domain}:{bus}"
        path = base / address
        path.mkdir(parents=True)
        for name, value in (("vendor", vendor), ("device", device), ("class", class_code),
                            ("subsystem_vendor", subsystem[0]), ("subsystem_device", subsystem[1])):  # fmt: skip
            (path / name).write_text(f"0x{value.lower()}\n")
        (path / "numa_node").write_text(f"{numa_node}\n")
        (path / "driver_override").write_text("(null)\n")
        # The kernel's copy of the value: the same file under a name no mount covers.
        os.link(path / "driver_override", self.state / "override" / address)
        _link(path / "subsystem", self.sysfs / "bus" / "pci")
        _link(self.sysfs / "bus" / "pci" / "devices" / address, path)
        self._attach(path / "driver_override", f"sysfs/devices/{address}")
        if driver:
            self.set_default_driver(address, driver)
            self.bind(address, driver)
        if iommu_group is not None:
            if not self.iommu:
                raise ValueError(f"{address}: an IOMMU group on a host built with iommu=False")
            group = self.sysfs / "kernel" / "iommu_groups" / str(iommu_group)
            (group / "devices").mkdir(parents=True, exist_ok=True)
            (group / "type").write_text("DMA\n")
            _link(path / "iommu_group", group)
            _link(group / "devices" / address, path)
            self._sync_vfio_node(iommu_group)
        return path

    def add_root_port(self, address: str, secondary_bus: str, *, iommu_group: int | None = None) -> Path:
        """A PCIe root port (a bridge); devices added later on `secondary_bus` go below it."""
        path = self.add_device(address, *ROOT_PORT, driver="pcieport", iommu_group=iommu_group)
        self._bridges[f"{address.split(':')[0]}:{secondary_bus}"] = address
        return path

    def device_dir(self, address: str) -> Path:
        return Path(os.path.realpath(self.sysfs / "bus" / "pci" / "devices" / address))

    def bind(self, address: str, driver: str | None) -> None:
        """Bind the device to `driver` (None: unbind), with the driver's back link and, for
        vfio-pci, its group's node in `dev/vfio`."""
        path = self.device_dir(address)
        old = path / "driver"
        if old.is_symlink():
            (old.resolve() / address).unlink(missing_ok=True)
            old.unlink()
        if driver:
            drv = self._driver_dir(driver)
            _link(path / "driver", drv)
            _link(drv / address, path)
        group = self.iommu_group(address)
        if group is not None:
            self._sync_vfio_node(group)

    def driver(self, address: str) -> str:
        """The device's driver; "" when it has none."""
        return _link_name(self.sysfs / "bus" / "pci" / "devices" / address / "driver")

    def iommu_group(self, address: str) -> int | None:
        link = self.sysfs / "bus" / "pci" / "devices" / address / "iommu_group"
        return int(os.path.basename(os.readlink(link))) if link.is_symlink() else None

    def vfio_node(self, group: int) -> Path:
        return self.dev / "vfio" / str(group)

    def remove_device(self, address: str) -> None:
        """The device vanishes (hot-unplug), with everything below it and every link to it."""
        path = self.device_dir(address)
        bus = self.sysfs / "bus" / "pci" / "devices"
        gone = {a: self.iommu_group(a) for a in os.listdir(bus) if _under(Path(os.path.realpath(bus / a)), path)}
        links = [self.sysfs / "bus" / "pci" / "devices", self.sysfs / "class" / "net", self.sysfs / "class" / "block",
                 self.sysfs / "block", *(self.sysfs / "bus" / "pci" / "drivers").iterdir()]  # fmt: skip
        groups = self.sysfs / "kernel" / "iommu_groups"
        links += [g / "devices" for g in groups.iterdir()]
        detach_mounts(path)
        for folder in links:
            for entry in folder.iterdir():
                if entry.is_symlink() and _under(Path(os.path.realpath(entry)), path):
                    entry.unlink()
        for folder in list(groups.iterdir()):
            if not any((folder / "devices").iterdir()):
                shutil.rmtree(folder)
        shutil.rmtree(path)
        for gone_address, group in gone.items():
            if group is not None:
                self._sync_vfio_node(group)
            for state in _STATE:
                (self.state / state / gone_address).unlink(missing_ok=True)

    # --- What the kernel knows beyond sysfs (read by e2e.fakekernel) --------------------

    def set_default_driver(self, address: str, driver: str | None) -> None:
        """The driver that claims the device when it is probed without `driver_override`
        (None: none does, as a GPU on a node without the NVIDIA driver)."""
        self._flag("default_driver", address, driver)

    def default_driver(self, address: str) -> str | None:
        return self._read_flag("default_driver", address) or None

    def hold(
        self, target: str, holder: str | None = None, *, name: str | None = None, lets_go_after: float | None = None
    ) -> None:
        """Two kinds of holding, as the kernel has two:

        - `hold(address)`: something uses the PCI device (`hold_device`: a VMM, a CUDA process);
        - `hold(block_name, holder)`: a block device is built on another (`hold_block`: LVM, RAID).
        """
        if holder is None:
            self.hold_device(target, lets_go_after=lets_go_after)
        else:
            self.hold_block(target, holder, name=name)

    def hold_device(self, address: str, *, lets_go_after: float | None = None) -> None:
        """Something holds the device: a VMM with its VFIO device open, a CUDA process or
        nvidia-persistenced on the NVIDIA driver. Unbinding it from its driver then blocks in
        write(2) until `release` (the driver's remove waits for its users), holding the device
        lock meanwhile: reads and writes of its `driver_override`, a bind or a probe of it wait too.

        `lets_go_after`: the holder lets go that many seconds after an unbind starts waiting, as
        QEMU hot-unplugs the device from its guest when vfio-pci asks (about 10 s in the trial).
        """
        self._flag("held", address, "" if lets_go_after is None else f"{lets_go_after}")

    def release(self, address: str) -> None:
        """The holder lets go: a blocked unbind of the device completes."""
        self._flag("held", address, None)

    def is_held(self, address: str) -> bool:
        return (self.state / "held" / address).exists()

    @contextlib.contextmanager
    def holding(self, *addresses: str) -> Iterator[None]:
        """`hold` the devices for the block, `release` them after it (however it ends)."""
        for address in addresses:
            self.hold_device(address)
        try:
            yield
        finally:
            for address in addresses:
                self.release(address)

    def set_fragile(self, address: str, fragile: bool = True) -> None:
        """The device falls off the bus when its driver lets go of it (a GPU whose reset fails)."""
        self._flag("fragile", address, "1" if fragile else None)

    def is_fragile(self, address: str) -> bool:
        return bool(self._read_flag("fragile", address))

    def set_probe_time(self, address: str, seconds: float | None) -> None:
        """A driver's probe of the device takes `seconds` (None: no time), holding the device
        lock meanwhile, as a GPU driver's probe does while it initialises the card."""
        self._flag("probe_time", address, None if seconds is None else f"{seconds}")

    def probe_time(self, address: str) -> float:
        return float(self._read_flag("probe_time", address) or 0)

    # --- The simulated kernel's mounts (e2e.fakekernel) ---------------------------------

    @property
    def kernel_mount(self) -> Path:
        """Where a running simulated kernel mounts its FUSE filesystem."""
        return self.state / "kernel"

    def kernel_running(self) -> bool:
        return os.path.ismount(self.kernel_mount)

    def _attach(self, target: Path, source: str) -> None:
        """Put the running kernel's file `source` over the control file `target` (nothing to do
        without a kernel: the plain file is what a host without one would show)."""
        if self.kernel_running():
            bind_mount(self.kernel_mount / source, target)

    # --- What the host does with them -------------------------------------------------

    def add_netdev(self, address: str, ifname: str, up: bool, *, carrier: bool = True) -> None:
        iface = self.device_dir(address) / "net" / ifname
        iface.mkdir(parents=True)
        _link(self.sysfs / "class" / "net" / ifname, iface)
        self.set_netdev(ifname, up, carrier=carrier)

    def set_netdev(self, ifname: str, up: bool, *, carrier: bool = True) -> None:
        """`ip link set <ifname> up|down`; without a carrier (no cable) operstate stays down."""
        iface = self.sysfs / "class" / "net" / ifname
        (iface / "flags").write_text("0x1003\n" if up else "0x1002\n")
        (iface / "operstate").write_text("up\n" if up and carrier else "down\n")

    def add_block(
        self, address: str, disk: str, partitions: tuple[str, ...] | list[str] = (), *, multipath: bool = False
    ) -> None:
        """A disk on the device (NVMe, virtio or SATA layout by its name) and its partitions.

        `multipath` (NVMe): native NVMe multipath, as on a dual-port drive. The device gets the
        path disk (`nvme0c0n1`, hidden); the disk the host uses and its partitions live under
        `devices/virtual/nvme-subsystem`, and list the path disk in their `multipath/`.
        """
        device = self.device_dir(address)
        if disk.startswith("nvme"):
            base = device / "nvme" / disk[: disk.index("n", 4)]
        elif disk.startswith("vd"):
            base = device / "virtio0" / "block"
        else:
            base = device / "ata1" / "host0" / "target0:0:0" / "0:0:0:0" / "block"
        path_disk = ""
        if multipath:
            match = re.fullmatch(r"nvme([0-9]+)n([0-9]+)", disk)
            if match is None:
                raise ValueError(f"{disk}: native multipath is NVMe's")
            path_disk = f"nvme{match.group(1)}c{match.group(1)}n{match.group(2)}"
            self._block_dir(base / path_disk, path_disk)
            (base / path_disk / "hidden").write_text("1\n")
            base = self.sysfs / "devices" / "virtual" / "nvme-subsystem" / f"nvme-subsys{match.group(1)}"
        disk_dir = base / disk
        self._block_dir(disk_dir, disk)
        _link(self.sysfs / "block" / disk, disk_dir)
        if path_disk:
            path_dir = Path(os.path.realpath(self.sysfs / "class" / "block" / path_disk))
            _link(disk_dir / "multipath" / path_disk, path_dir)
        for number, part in enumerate(partitions, start=1):
            self._block_dir(disk_dir / part, part, partition=number)
            (disk_dir / part / "partition").write_text(f"{number}\n")

    def name_partition(self, part: str, partname: str) -> None:
        """Give a partition its GPT name (PARTNAME in its `uevent`), as `zpool create` names
        the partition it makes on a whole disk `zfs-<guid>`."""
        with (self.sysfs / "class" / "block" / part / "uevent").open("a") as f:
            f.write(f"PARTNAME={partname}\n")

    def mount(self, block_name: str, mountpoint: str, *, source: str | None = None, fstype: str = "ext4") -> None:
        """Mount `block_name` on `mountpoint`; mountinfo gets the device's major:minor.

        `source`: the name mount(2) was given, as mountinfo shows it (`/dev/root` for a root
        the kernel mounted itself, `/dev/mapper/vg0-root`); `/dev/<block_name>` by default.
        `fstype="btrfs"`: the filesystem gets an anonymous device number (0:N) as btrfs's do,
        and `sys/fs/btrfs/<fsid>/devices` names the disk.
        """
        source = source or f"/dev/{block_name}"
        if fstype == "btrfs":
            fsid = str(uuid.uuid5(uuid.NAMESPACE_OID, block_name))
            held = self.sysfs / "class" / "block" / block_name
            _link(self.sysfs / "fs" / "btrfs" / fsid / "devices" / block_name, Path(os.path.realpath(held)))
            devnum = (0, 100 + len(self._mountinfo_lines()))
        else:
            devnum = self.devnum(block_name)
        self._mount_line(devnum, mountpoint, fstype, source)

    def mount_zfs(self, dataset: str, mountpoint: str) -> None:
        """Import the dataset's pool and mount the dataset (ZFS: an anonymous device number,
        and nothing in sysfs that names the pool's disks)."""
        self.import_zfs_pool(dataset.split("/")[0])
        self._mount_line((0, 100 + len(self._mountinfo_lines())), mountpoint, "zfs", dataset)

    def import_zfs_pool(self, pool: str) -> None:
        """`zpool import`: the pool gets its kstat directory; nothing names its disks."""
        kstat = self.proc / "spl" / "kstat" / "zfs"
        (kstat / pool).mkdir(parents=True, exist_ok=True)
        (kstat / pool / "state").write_text("ONLINE\n")
        (kstat / "arcstats").write_text("")  # the module's own statistics: a file, not a pool

    def swapon(self, block_name: str, *, path: str | None = None) -> None:
        """`swapon` on a block device; /proc/swaps shows `path` (`/dev/<block_name>` by default)."""
        shown = (path or f"/dev/{block_name}").replace("\\", "\\134").replace(" ", "\\040")
        with (self.proc / "swaps").open("a") as f:
            f.write(f"{shown:<40}partition\t8388604\t\t0\t\t-2\n")

    def hold_block(self, block_name: str, holder: str, *, name: str | None = None) -> None:
        """`holder` (dm-0, md0) is built on `block_name`, as LVM, RAID and dm-crypt do.

        A device-mapper holder gets its `dm/name` (`name`, e.g. `vg0-root`; the holder's own
        name by default), an md one its `md/level`. Call again to build it on more devices.
        """
        virtual = self.sysfs / "devices" / "virtual" / "block" / holder
        if not virtual.exists():
            self._block_dir(virtual, holder)
            (virtual / "slaves").mkdir()
            _link(self.sysfs / "block" / holder, virtual)
            if holder.startswith("dm-"):
                (virtual / "dm").mkdir()
                (virtual / "dm" / "name").write_text(f"{name or holder}\n")
                (virtual / "dm" / "uuid").write_text(f"LVM-{uuid.uuid5(uuid.NAMESPACE_OID, holder).hex}\n")
            elif holder.startswith("md"):
                (virtual / "md").mkdir()
                (virtual / "md" / "level").write_text("raid1\n")
        held = Path(os.path.realpath(self.sysfs / "class" / "block" / block_name))
        _link(held / "holders" / holder, virtual)
        _link(virtual / "slaves" / block_name, held)

    def devnum(self, block_name: str) -> tuple[int, int]:
        """The block device's major:minor, from its `dev`."""
        major, minor = (self.sysfs / "class" / "block" / block_name / "dev").read_text().strip().split(":")
        return int(major), int(minor)

    # --- Breaking things, the way a confused kernel or a half-done unbind would -------

    def write_attribute(self, address: str, name: str, text: str) -> None:
        """Write `text` as the device's attribute `name` (garbage into `vendor`, ...)."""
        (self.device_dir(address) / name).write_text(text)

    def remove_attribute(self, address: str, name: str) -> None:
        detach_mounts(self.device_dir(address) / name)
        (self.device_dir(address) / name).unlink()
        if name == "driver_override":
            (self.state / "override" / address).unlink(missing_ok=True)

    def refuse_writes(self, address: str, name: str) -> None:
        """Writes to the device's attribute `name` fail (EISDIR): it becomes a directory, since
        root ignores file modes."""
        attribute = self.device_dir(address) / name
        detach_mounts(attribute)
        attribute.unlink(missing_ok=True)
        attribute.mkdir()

    def break_link(self, address: str, name: str) -> None:
        """Point the device's link `name` (`driver`, `iommu_group`) at something that is gone."""
        link = self.device_dir(address) / name
        target = os.readlink(link) if link.is_symlink() else f"../{name}"
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.join(os.path.dirname(target), "gone"))

    # --- Helpers ----------------------------------------------------------------------

    def _driver_dir(self, driver: str) -> Path:
        path = self.sysfs / "bus" / "pci" / "drivers" / driver
        if not path.exists():
            path.mkdir(parents=True)
            for name in ("bind", "unbind", "new_id", "remove_id"):
                (path / name).write_text("")
            for name in ("bind", "unbind"):
                self._attach(path / name, f"sysfs/drivers/{driver}/{name}")
        return path

    def _sync_vfio_node(self, group: int) -> None:
        """`dev/vfio/<group>` exists while a member of the group is on vfio-pci."""
        members = self.sysfs / "kernel" / "iommu_groups" / str(group) / "devices"
        bound = any(_link_name(m / "driver") == "vfio-pci" for m in members.iterdir()) if members.is_dir() else False
        node = self.vfio_node(group)
        if bound:
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()
        else:
            node.unlink(missing_ok=True)

    def _flag(self, kind: str, address: str, value: str | None) -> None:
        path = self.state / kind / address
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(value)

    def _read_flag(self, kind: str, address: str) -> str:
        try:
            return (self.state / kind / address).read_text()
        except FileNotFoundError:
            return ""

    def _block_dir(self, path: Path, name: str, partition: int = 0) -> None:
        path.mkdir(parents=True)
        (path / "holders").mkdir()
        (path / "size").write_text("1953525168\n")
        major, minor = self._allocate_devnum(name, partition)
        (path / "dev").write_text(f"{major}:{minor}\n")
        kind = f"DEVTYPE=partition\nPARTN={partition}\n" if partition else "DEVTYPE=disk\n"
        (path / "uevent").write_text(f"MAJOR={major}\nMINOR={minor}\nDEVNAME={name}\n{kind}")
        _link(self.sysfs / "class" / "block" / name, path)

    def _allocate_devnum(self, name: str, partition: int) -> tuple[int, int]:
        """As the kernel numbers them: sd and virtio disks 16 minors each on their majors,
        dm-N and mdN on theirs by number, everything else (NVMe) the next free of major 259."""
        if match := re.fullmatch(r"(sd|vd)([a-z]+)[0-9]*", name):
            index = 0
            for letter in match.group(2):
                index = index * 26 + ord(letter) - ord("a") + 1
            return (8 if match.group(1) == "sd" else 252), (index - 1) * 16 + partition
        if match := re.fullmatch(r"(dm-|md)([0-9]+)", name):
            return (253 if match.group(1) == "dm-" else 9), int(match.group(2))
        if 259 not in self._next_minor:  # a host built by another process: carry on after its devices
            taken = [-1]
            for entry in (self.sysfs / "class" / "block").iterdir():
                dev = (entry / "dev").read_text().split(":") if (entry / "dev").is_file() else []
                if len(dev) == 2 and dev[0] == "259":
                    taken.append(int(dev[1]))
            self._next_minor[259] = max(taken) + 1
        minor = self._next_minor[259]
        self._next_minor[259] = minor + 1
        return 259, minor

    def _mountinfo_lines(self) -> list[str]:
        return (self.proc / "self" / "mountinfo").read_text().splitlines()

    def _mount_line(self, devnum: tuple[int, int], mountpoint: str, fstype: str, source: str) -> None:
        """One mount, in mountinfo and in mounts, escaped as the kernel escapes them."""
        escaped = mountpoint.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
        mount_id = 20 + len(self._mountinfo_lines())
        with (self.proc / "self" / "mountinfo").open("a") as f:
            f.write(f"{mount_id} 1 {devnum[0]}:{devnum[1]} / {escaped} rw,relatime shared:{mount_id} "
                    f"- {fstype} {source} rw\n")  # fmt: skip
        with (self.proc / "self" / "mounts").open("a") as f:
            f.write(f"{source} {escaped} {fstype} rw,relatime 0 0\n")


def _link(link: Path, target: Path) -> None:
    """A relative symlink, as sysfs makes them (so the tree can be moved or copied)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _link_name(link: Path) -> str:
    try:
        return os.path.basename(os.readlink(link))
    except OSError:  # no link, or its device vanished meanwhile
        return ""


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


# --- Mounts (only ever inside the private mount namespace of a test run) --------------

_libc = ctypes.CDLL(None, use_errno=True)
_MS_BIND = 0x1000
_MNT_DETACH = 0x2


def bind_mount(source: Path, target: Path) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount --bind {source} {target}: {os.strerror(err)}")


def mounts_under(folder: Path) -> list[Path]:
    """The mount points at or below `folder` in this mount namespace, deepest first."""
    folder = Path(os.path.realpath(folder))
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            raw = line.split(b" ", 5)[4]  # octal escapes for space, tab, newline and backslash
            point = Path(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), raw).decode())
            if _under(point, folder):
                found.append(point)
    return sorted(set(found), key=lambda p: len(p.parts), reverse=True)


def detach_mounts(folder: Path) -> None:
    """Lazily unmount everything at or below `folder` (a mount point cannot be removed)."""
    for point in mounts_under(folder):
        if _libc.umount2(os.fsencode(point), _MNT_DETACH) != 0 and ctypes.get_errno() not in (22, 2):
            err = ctypes.get_errno()  # EINVAL: not a mount point (any more); ENOENT: gone
            raise OSError(err, f"umount -l {point}: {os.strerror(err)}")


# --- Ready-made hosts -----------------------------------------------------------------


def gpu_node(root: Path, vfio: bool = True) -> FakeHost:
    """Two NVIDIA A10s, each with its audio function in its IOMMU group, behind root ports.

    The host bridge and the root ports sit on bus 00: the agent leaves them out. `vfio`:
    whether vfio-pci is loaded.
    """
    host = FakeHost(root, vfio=vfio)
    host.add_device("0000:00:00.0", *HOST_BRIDGE, iommu_group=0)
    for n, (port, bus, numa) in enumerate((("0000:00:03.0", "3b", 0), ("0000:00:07.0", "af", 1))):
        host.add_root_port(port, bus, iommu_group=10 + n)
        group = 20 + n
        host.add_device(f"0000:{bus}:00.0", "10de", "2236", "030200", driver="nvidia",
                        iommu_group=group, numa_node=numa, subsystem=("10de", "1482"))  # fmt: skip
        host.add_device(f"0000:{bus}:00.1", "10de", "1aef", "040300", driver="snd_hda_intel",
                        iommu_group=group, numa_node=numa, subsystem=("10de", "1482"))  # fmt: skip
    return host


def storage_node(root: Path) -> FakeHost:
    """A free NVMe drive, a NIC whose eth0 is up and a free NIC (eth1 down), each in its own group."""
    host = FakeHost(root)
    host.add_device("0000:00:00.0", *HOST_BRIDGE, iommu_group=0)
    host.add_root_port("0000:00:01.0", "18", iommu_group=1)
    host.add_root_port("0000:00:02.0", "3d", iommu_group=2)
    host.add_device("0000:18:00.0", "8086", "1593", "020000", driver="ice", iommu_group=30,
                    subsystem=("8086", "0005"))  # fmt: skip
    host.add_netdev("0000:18:00.0", "eth0", up=True)
    host.add_device("0000:18:00.1", "8086", "1593", "020000", driver="ice", iommu_group=31,
                    subsystem=("8086", "0005"))  # fmt: skip
    host.add_netdev("0000:18:00.1", "eth1", up=False)
    host.add_device("0000:3d:00.0", "144d", "a808", "010802", driver="nvme", iommu_group=32,
                    subsystem=("144d", "a801"))  # fmt: skip
    host.add_block("0000:3d:00.0", "nvme0n1", ("nvme0n1p1", "nvme0n1p2"))
    return host


def synthetic_host(root: Path, devices: int) -> FakeHost:
    """About `devices` PCI functions (root ports included) for the discovery benchmark.

    A mix as on GPU and storage servers: A10s with their audio function, single-function
    H100s, dual-port NICs (the first port of every other card up), NVMe drives (every third
    one mounted); each card behind its own root port, root ports spread over as many PCI
    domains as needed.
    """
    host = FakeHost(root)
    kinds = cycle(("a10", "nic", "nvme", "h100"))
    count = port = disks = 0
    bus = 1
    domain = 0
    while count < devices:
        if port == 248 or bus == 256:
            domain, port, bus = domain + 1, 0, 1
        dom = f"{domain:04x}"
        host.add_root_port(f"{dom}:00:{1 + port // 8:02x}.{port % 8}", f"{bus:02x}", iommu_group=count)
        count += 1
        group = count
        addr = f"{dom}:{bus:02x}:00"
        kind = next(kinds)
        if kind == "a10":
            for fn, (device, klass, driver) in enumerate((("2236", "030200", "vfio-pci"), ("1aef", "040300", None))):
                host.add_device(f"{addr}.{fn}", "10de", device, klass, driver=driver, iommu_group=group,
                                numa_node=domain % 2)  # fmt: skip
            count += 2
        elif kind == "h100":
            host.add_device(f"{addr}.0", "10de", "2330", "030200", driver="nvidia", iommu_group=group)
            count += 1
        elif kind == "nic":
            for fn in range(2):
                host.add_device(f"{addr}.{fn}", "15b3", "101d", "020000", driver="mlx5_core", iommu_group=group)
                host.add_netdev(f"{addr}.{fn}", f"ens{bus}f{fn}d{domain}", up=fn == 0 and bus % 2 == 0)
            count += 2
        else:
            name = f"nvme{disks}n1"
            disks += 1
            host.add_device(f"{addr}.0", "8086", "0b60", "010802", driver="nvme", iommu_group=group)
            host.add_block(f"{addr}.0", name, (f"{name}p1",))
            if bus % 3 == 0:
                host.mount(f"{name}p1", f"/data/{name}")
            count += 1
        port += 1
        bus += 1
    return host
