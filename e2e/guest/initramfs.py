"""The guest's initramfs: static busybox, the 9p/virtio/overlay modules and two init scripts.

Stage 1 (/init) mounts the host's / read-only over 9p under a tmpfs overlay, the results
share read-write at its host path, the kernel's module tree at /lib/modules/<release>, and
switches root. Stage 2 runs as PID 1 of the new root: it loads every device's driver from
its modalias (udev's coldplug, without udev), vfio-pci and vfio_iommu_type1, brings up the
user-mode network without a default route (the guest reaches the host's loopback as
10.0.2.2 and nothing else), and starts the command server (e2e/guest/server.py).
"""

from __future__ import annotations

import lzma
import shlex
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from e2e.guest.kernel import Kernel, RigUnavailable

# The modules stage 1 needs, dependencies pulled in from modules.dep. Names as in the tree.
BOOT_MODULES = ("virtio_pci", "9pnet_virtio", "9p", "overlay")
GUEST_PORT = 7000  # the command server, reached through QEMU's hostfwd on 127.0.0.1
ROOT_TAG, SHARE_TAG = "hostroot", "results"
BOOT_FAILED = "RK-BOOT-FAILED"  # what the scripts print before they power off on a failure
STAGE2_STARTED = "RK-STAGE2"


@dataclass(frozen=True)
class Layout:
    """Where things are, the same paths on the host and in the guest."""

    repo: Path  # the project, whose e2e.guest.server runs in the guest
    python: Path  # the venv's python, called directly (a shim would cost a second Python start)
    share: Path  # read-write in the guest, read by the host


def _module_closure(kernel: Kernel, names: tuple[str, ...]) -> list[Path]:
    """Module files for `names` and their dependencies, dependencies first; absent built-ins skipped."""
    deps: dict[str, list[str]] = {}
    for line in (kernel.modules / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[target] = rest.split()
    by_name = {_module_name(path): path for path in deps}
    builtin = {_module_name(line) for line in (kernel.modules / "modules.builtin").read_text().split()}
    ordered: list[str] = []
    for name in names:
        name = name.replace("-", "_")
        if name in builtin:
            continue
        if name not in by_name:
            raise RigUnavailable(f"{kernel.package} has no module {name}")
        # modules.dep lists the whole closure of a module, deepest last: load it reversed.
        for path in [*reversed(deps[by_name[name]]), by_name[name]]:
            if path not in ordered:
                ordered.append(path)
    return [kernel.modules / path for path in ordered]


def _module_name(path: str) -> str:
    base = path.rsplit("/", 1)[-1]
    for suffix in (".xz", ".zst", ".gz"):
        base = base.removesuffix(suffix)
    return base.removesuffix(".ko").replace("-", "_")


def _stage1(kernel: Kernel, modules: list[str], layout: Layout) -> str:
    q = shlex.quote
    return f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() {{ echo "{BOOT_FAILED}: $*"; sleep 1; poweroff -f; }}
mkdir -p /proc /sys /dev /lower /upper /newroot
mount -t proc proc /proc && mount -t sysfs sysfs /sys && mount -t devtmpfs devtmpfs /dev || fail "mount proc, sys, dev"
for m in {' '.join(modules)}; do insmod /modules/$m.ko || fail "insmod $m"; done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 {ROOT_TAG} /lower || fail "mount the host's / over 9p"
mount -t tmpfs -o mode=0755 tmpfs /upper && mkdir /upper/data /upper/work || fail "tmpfs"
mount -t overlay overlay -o lowerdir=/lower,upperdir=/upper/data,workdir=/upper/work /newroot || fail "overlay"
mkdir -p /newroot{q(str(layout.share))} /newroot/lib/modules/{kernel.release} /newroot/run/rk
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 {SHARE_TAG} /newroot{q(str(layout.share))} || fail "mount the results share"
mount --bind /newroot{q(str(kernel.modules))} /newroot/lib/modules/{kernel.release} || fail "bind the module tree"
cp /bin/busybox /stage2 /newroot/run/rk/ || fail "copy stage 2"
for fs in proc sys dev; do mount --move /$fs /newroot/$fs; done
exec switch_root /newroot /run/rk/busybox sh /run/rk/stage2
"""


def _stage2(layout: Layout) -> str:
    q = shlex.quote
    return f"""# stage 2, PID 1 of the overlay root
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
bb=/run/rk/busybox
fail() {{ echo "{BOOT_FAILED}: $*"; sleep 1; $bb poweroff -f; }}
echo "{STAGE2_STARTED} $($bb cat /proc/uptime)"
$bb mkdir -p /dev/pts /dev/shm /sys/fs/cgroup
$bb mount -t devpts devpts /dev/pts; $bb mount -t tmpfs tmpfs /dev/shm; $bb mount -t cgroup2 cgroup2 /sys/fs/cgroup
# udev's coldplug: each device's driver from its modalias; twice, for the devices (virtio)
# that the first round's drivers create.
# One modprobe a round: each start of it parses modules.alias, seconds under TCG.
for round in 1 2; do
  $bb modprobe -q -a $($bb cat /sys/bus/*/devices/*/modalias | $bb sort -u) 2>/dev/null
done
echo "{STAGE2_STARTED} drivers loaded $($bb cat /proc/uptime)"
$bb modprobe -a vfio-pci vfio_iommu_type1 || fail "modprobe vfio-pci vfio_iommu_type1"
: > /etc/resolv.conf   # no DNS: nothing here has a name to look up
$bb hostname realkernel-guest
$bb ip link set lo up
for dev in /sys/class/net/*; do
  case "$($bb readlink $dev/device/driver)" in *virtio_net) nic=${{dev##*/}};; esac
done
[ -n "$nic" ] || fail "no virtio-net interface"
# No default route: 10.0.2.2 (the host's loopback) is all the guest can reach.
$bb ip addr add 10.0.2.15/24 dev $nic && $bb ip link set $nic up || fail "network"
echo "{STAGE2_STARTED} network up $($bb cat /proc/uptime)"
cd {q(str(layout.repo))} || fail "no {layout.repo}"
PYTHONPATH={q(str(layout.repo))} {q(str(layout.python))} -m e2e.guest.server --port {GUEST_PORT} >{q(str(layout.share / "server.log"))} 2>&1 &
while true; do wait; $bb sleep 1; done   # PID 1 reaps what is orphaned
"""


def _cpio_entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0), ino: int = 0) -> bytes:
    """One entry of the kernel's "newc" cpio format (no cpio binary needed, no root for /dev nodes)."""
    encoded = name.encode() + b"\0"
    fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0)
    header = b"070701" + b"".join(f"{f:08x}".encode() for f in fields) + encoded
    header += b"\0" * (-len(header) % 4)
    return header + data + b"\0" * (-len(data) % 4)


def build(kernel: Kernel, layout: Layout, out: Path) -> Path:
    """Write the initramfs (uncompressed cpio: nothing to inflate under TCG) to `out`."""
    busybox = shutil.which("busybox")
    if busybox is None:
        raise RigUnavailable("busybox not on PATH (Debian: busybox-static)")
    if not _is_static(Path(busybox)):
        raise RigUnavailable(f"{busybox} is not statically linked (install busybox-static)")
    files = _module_closure(kernel, BOOT_MODULES)
    names = []
    entries = [
        _cpio_entry(d, stat.S_IFDIR | 0o755, ino=i + 1) for i, d in enumerate(("bin", "dev", "modules"))
    ]
    entries.append(_cpio_entry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1), ino=10))
    entries.append(_cpio_entry("bin/busybox", stat.S_IFREG | 0o755, Path(busybox).read_bytes(), ino=11))
    for index, path in enumerate(files):
        data = path.read_bytes()
        if path.suffix == ".xz":  # insmod of a plain file needs no decompressor in busybox or the kernel
            data = lzma.decompress(data)
        name = _module_name(path.name)
        names.append(name)
        entries.append(_cpio_entry(f"modules/{name}.ko", stat.S_IFREG | 0o644, data, ino=100 + index))
    entries.append(_cpio_entry("init", stat.S_IFREG | 0o755, _stage1(kernel, names, layout).encode(), ino=12))
    entries.append(_cpio_entry("stage2", stat.S_IFREG | 0o644, _stage2(layout).encode(), ino=13))
    entries.append(_cpio_entry("TRAILER!!!", 0))
    out.write_bytes(b"".join(entries))
    return out


def _is_static(binary: Path) -> bool:
    # A dynamically linked ELF names its interpreter (PT_INTERP: /lib64/ld-linux-...).
    return b"/ld-linux" not in binary.read_bytes()[:4096]
