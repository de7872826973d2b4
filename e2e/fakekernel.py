"""A simulated kernel for fixture hosts: the vfio bind sequence's sysfs files answer as Linux's do,
inside the system call, blocking where Linux blocks.

A FUSE filesystem (mfusepy over libfuse3) is mounted at `fakehost/kernel`, and its files are bind
mounted over the fixture's control files: every device's `driver_override`, every driver's `bind`
and `unbind`, `bus/pci/drivers_probe`, and the whole `dev/` folder (for `/dev/vfio/<group>`).
Everything else stays a plain file, so a discovery reads the fixture at the speed of the disk.
In a test:

    with FakeKernel(host):
        vfio.bind_group(host.sysfs, host.dev, 20, [...])

or as a process of its own, until SIGTERM: `python -m e2e.fakekernel ROOT`. Mounting is only
done inside a private mount namespace made for the test run (`make unit`, `make integration` and
`make test` run pytest under `unshare --mount --propagation private`); elsewhere `start` refuses.

What it does, as Linux 6.1 to 6.12 do (drivers/base/bus.c, dd.c and driver.c,
drivers/pci/pci-driver.c and pci-sysfs.c, drivers/vfio/group.c):
- A write has had its effect when write(2) returns; an error is the write's errno.
- `driver_override`: reads show the value or `(null)`; a write keeps what comes before its first
  newline, an empty value (or a lone newline) clears it; 4095 bytes or more are EINVAL. Reads and
  writes take the device lock.
- `drivers/<X>/unbind`: ENODEV unless the device is bound to X. Otherwise the device lock is
  taken, the driver links go (the device shows no driver from then on) and the driver's remove
  runs, which waits while anything holds the device (`FakeHost.hold`): the write blocks until
  `FakeHost.release` (or the holder's own `lets_go_after`); only then does `/dev/vfio/<group>`
  go with the last member. It never refuses. A device marked `set_fragile`
  falls off the bus instead of staying unbound.
- `drivers/<X>/bind`: ENODEV when the device is missing or X does not match it (its
  `driver_override` names another driver; without one, X is not its default driver, which stands
  for the driver's ID table: vfio-pci has none); EBUSY when it has a driver; the probe's own
  error otherwise (vfio-pci: EINVAL for a device without an IOMMU group).
- `bus/pci/drivers_probe`: ENODEV for a device that is not there; otherwise success, whether or
  not a driver took the device: its `driver_override` (if that driver is loaded, and nothing if it
  is not) or, without one, its default driver. A probe takes the device lock for
  `FakeHost.set_probe_time` seconds.
- `/dev/vfio/<group>` exists while a member of the group is on vfio-pci and opens once: a second
  open is EBUSY until the first is closed. A VMM's `VFIO_GROUP_SET_CONTAINER` ioctl on it fails
  with EPERM while the group is not viable: a member is bound to a driver other than vfio-pci,
  pci-stub or pcieport (the drivers that manage DMA themselves). An unbound member is fine.

Where it stops being the kernel:
- Holding is `FakeHost.hold`, not an open file: opening `/dev/vfio/<group>` takes the group, but
  a VMM's device file descriptors (which are what vfio-pci's remove waits for) are not modelled.
- Of the group's ioctls only `VFIO_GROUP_SET_CONTAINER` is answered (FUSE passes no argument
  buffer for VFIO's `_IO` ioctls, so `VFIO_GROUP_GET_STATUS` cannot be filled in: ENOTTY).
- A group file is taken back when FUSE's release arrives, which follows close(2) by a moment: an
  open finding the group taken waits up to 0.2 s for that before it answers EBUSY.
- Writes to one control file wait for each other: FUSE holds the file's inode lock through a
  write (libfuse 3.14 cannot offer FOPEN_PARALLEL_DIRECT_WRITES, and an O_TRUNC open takes the
  lock exclusively anyway). So while an unbind of a held device blocks in `drivers/nvidia/unbind`,
  a second write to that same file waits too (on Linux it would go ahead); other control files,
  other drivers' and every device's `driver_override`, are not held up.
- `new_id`, `remove`, `rescan`, `reset` and the rest are plain files without effect.
- A FakeHost that changes links itself (`bind`, `add_device`, `remove_device`) does not take
  device locks; `stop` fails the writes still blocked with EIO.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from e2e.fakesysfs import FakeHost, bind_mount, detach_mounts

log = logging.getLogger(__name__)

PAGE_SIZE = 4096
# Drivers that manage DMA themselves (driver_managed_dma): a member on one of them, or on none,
# leaves its IOMMU group viable for VFIO.
DMA_SAFE_DRIVERS = ("vfio-pci", "pci-stub", "pcieport")
VFIO_GROUP_SET_CONTAINER = 0x3B68  # _IO(VFIO_TYPE ';', VFIO_BASE 100 + 4)
GROUP_RELEASE_GRACE = 0.2  # s an open waits for the release of a group that was just closed
HOLDER_POLL = 0.005  # s between looks at whether a holder let go

HOW_TO_RUN = (
    "run the tests through make (`make unit`, `make integration`, `make test`), or as "
    "`unshare --mount --propagation private .venv/bin/python -m pytest ...`"
)


class KernelUnavailable(RuntimeError):
    """The simulated kernel cannot run here; the message says why and what to run instead."""


# --- Where mounting is allowed ----------------------------------------------------------------


def mount_namespace_problem(path: Path) -> str | None:
    """Why mounting below `path` could reach the host's mounts; None inside a private mount
    namespace that this run made (not the one of pid 1 or of an ancestor process, and `path` on a
    mount that propagates nowhere)."""
    try:
        own = os.readlink("/proc/self/ns/mnt")
    except OSError as e:
        return f"this process's mount namespace cannot be read ({e.strerror})"
    if not _namespace_of_our_own(own):
        return f"this process shares its mount namespace ({own}) with the processes that started it"
    point, shared = _mount_of(Path(os.path.realpath(path)))
    if shared:
        return f"{path} lies on {point}, a shared mount: mounts below it would propagate out of this namespace"
    return None


def _namespace_of_our_own(own: str) -> bool:
    """Whether pid 1 (else the nearest ancestor whose namespace can be read) is in another one."""
    with contextlib.suppress(OSError):
        return os.readlink("/proc/1/ns/mnt") != own
    pid = os.getppid()
    while pid > 1:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/ns/mnt") != own:
                return True
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def _mount_of(path: Path) -> tuple[str, bool]:
    """The mount point holding `path`, and whether that mount is shared (propagates)."""
    best, shared = "/", False
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" - ", 1)[0].split()
            point = fields[4].encode().decode("unicode_escape")
            if _under(path, Path(point)) and len(point) >= len(best):
                best, shared = point, any(tag.startswith("shared:") for tag in fields[6:])
    return best, shared


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


# --- libfuse3 through mfusepy -----------------------------------------------------------------

_serving = threading.local()  # what the thread that runs a FUSE loop is serving
_fuse_lock = threading.Lock()
_fuse = None  # the mfusepy module, once loaded and wired to `_serve`


def _load_fuse():  # -> the mfusepy module
    global _fuse
    with _fuse_lock:
        if _fuse is not None:
            return _fuse
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # not libfuse 2, where both are installed
        try:
            import mfusepy
        except (ImportError, OSError) as e:
            raise KernelUnavailable(
                f"the simulated kernel needs mfusepy and libfuse3 ({e}): `make venv` installs both "
                "(Debian's libfuse3-3, the project's test extras)"
            ) from None
        if mfusepy.fuse_version_major != 3:
            raise KernelUnavailable(f"mfusepy loaded libfuse {mfusepy.fuse_version_major}, not libfuse3")
        lib = mfusepy._libfuse
        lib.fuse_new_31.restype = ctypes.c_void_p
        lib.fuse_new_31.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.fuse_mount.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.fuse_unmount.argtypes = [ctypes.c_void_p]
        lib.fuse_loop_cfg_create.restype = ctypes.c_void_p
        lib.fuse_loop_cfg_set_max_threads.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.fuse_loop_cfg_set_idle_threads.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.fuse_loop_cfg_destroy.argtypes = [ctypes.c_void_p]
        lib.fuse_loop_mt_312.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.fuse_destroy.argtypes = [ctypes.c_void_p]
        # mfusepy's FUSE builds the operations table and calls fuse_main_real, which installs
        # process-wide signal handlers (SIGTERM would unmount instead of ending pytest) and caps
        # the loop at 10 threads (blocked writes would starve every other request). The table is
        # served here instead, by the same calls without those two.
        mfusepy.fuse_main_real = _serve
        _fuse = mfusepy
        return mfusepy


class _FuseArgs(ctypes.Structure):
    _fields_ = [("argc", ctypes.c_int), ("argv", ctypes.POINTER(ctypes.c_char_p)), ("allocated", ctypes.c_int)]


def _serve(argc: int, argv: object, operations: object, size: int, user_data: object) -> int:
    """mfusepy's fuse_main_real, less the signal handlers and the cap of 10 threads."""
    lib = _fuse._libfuse
    job = _serving.job
    args = [b"fakekernel", b"-o", b"fsname=fakekernel,subtype=fakekernel"]
    fuse_args = _FuseArgs(len(args), (ctypes.c_char_p * len(args))(*args), 0)
    fuse = lib.fuse_new_31(ctypes.addressof(fuse_args), ctypes.cast(operations, ctypes.c_void_p), size, None)
    if not fuse:
        job["error"] = "libfuse refused the filesystem (fuse_new)"
        return 1
    try:
        if lib.fuse_mount(fuse, os.fsencode(job["mountpoint"])) != 0:
            job["error"] = f"mounting FUSE on {job['mountpoint']} failed (is /dev/fuse there?)"
            return 1
        job["ready"].set()
        config = lib.fuse_loop_cfg_create()
        lib.fuse_loop_cfg_set_max_threads(config, 256)
        lib.fuse_loop_cfg_set_idle_threads(config, 4)
        result = lib.fuse_loop_mt_312(fuse, config)
        lib.fuse_loop_cfg_destroy(config)
        lib.fuse_unmount(fuse)
        return result
    finally:
        lib.fuse_destroy(fuse)


# --- The kernel -------------------------------------------------------------------------------


class FakeKernel:
    """Makes a FakeHost's control files answer as the kernel's do; `start`/`stop` or a `with` block."""

    def __init__(self, host: FakeHost | Path | str) -> None:
        self.host = host if isinstance(host, FakeHost) else FakeHost.existing(Path(host))
        self.errors: list[str] = []  # what went wrong in the simulation itself (also logged)
        self._kernel: FakeHost | None = None  # the same host, its dev/ reached under our mount
        self._dev_fd = -1
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._locks: dict[str, threading.Lock] = {}  # address -> its device lock
        self._locks_lock = threading.Lock()
        self._groups = threading.Condition()
        self._open_groups: set[int] = set()
        self._files: dict[int, tuple[str, object]] = {}  # FUSE file handle -> (kind, what)
        self._fhs = itertools.count(1)

    @staticmethod
    def unavailable(path: Path) -> str | None:
        """Why a simulated kernel could not run over a fixture under `path`, or None."""
        problem = mount_namespace_problem(path)
        if problem:
            return f"the simulated kernel mounts FUSE files over the fixture, never in the host's mount namespace: {problem}; {HOW_TO_RUN}"
        try:
            _load_fuse()
        except KernelUnavailable as e:
            return str(e)
        return None

    def start(self) -> FakeKernel:
        """Mount the filesystem and put its files over the control files; returns once they answer."""
        problem = self.unavailable(self.host.root)
        if problem:
            raise KernelUnavailable(problem)
        fuse = _load_fuse()
        if self.host.kernel_running():
            raise KernelUnavailable(f"a simulated kernel already serves {self.host.root}")
        detach_mounts(self.host.root)  # what a kernel that was killed left behind
        self.host.kernel_mount.mkdir(parents=True, exist_ok=True)
        self._dev_fd = os.open(self.host.dev, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._kernel = FakeHost.existing(self.host.root)
        self._kernel.dev = Path(f"/proc/self/fd/{self._dev_fd}")  # under the mount over dev/
        self._stopping.clear()
        job = {"mountpoint": self.host.kernel_mount, "ready": threading.Event(), "error": None}

        def serve() -> None:
            _serving.job = job
            try:
                fuse.FUSE(_Filesystem(self), str(self.host.kernel_mount), foreground=True)
            except BaseException as e:  # noqa: BLE001 - the loop's end, reported to start or stop
                job["error"] = job["error"] or f"the FUSE loop failed: {e!r}"
            finally:
                job["ready"].set()

        self._thread = threading.Thread(target=serve, name=f"fakekernel {self.host.root}", daemon=True)
        self._thread.start()
        if not job["ready"].wait(30) or job["error"]:
            self._thread = None
            os.close(self._dev_fd)
            raise KernelUnavailable(job["error"] or "the FUSE filesystem did not come up within 30 s")
        try:
            self._mount_all()
        except BaseException:
            self.stop()
            raise
        return self

    def _mount_all(self) -> None:
        host, source = self.host, self.host.kernel_mount
        pci = host.sysfs / "bus" / "pci"
        bind_mount(source / "dev", host.dev)
        bind_mount(source / "sysfs" / "drivers_probe", pci / "drivers_probe")
        for driver in sorted(os.listdir(pci / "drivers")):
            for name in ("bind", "unbind"):
                if (pci / "drivers" / driver / name).is_file():
                    bind_mount(source / "sysfs" / "drivers" / driver / name, pci / "drivers" / driver / name)
        for address in sorted(os.listdir(pci / "devices")):
            override = pci / "devices" / address / "driver_override"
            backing = host.state / "override" / address
            if not override.is_file():
                continue  # a fixture that broke it on purpose (a folder: writes refused)
            if not backing.exists():  # a tree from before the kernel's copy existed
                backing.parent.mkdir(parents=True, exist_ok=True)
                os.link(override, backing)
            bind_mount(source / "sysfs" / "devices" / address, override)

    def sync(self, timeout: float = 5.0) -> None:
        """Nothing to wait for: every write has had its effect when it returns, and a FakeHost
        mounts the control files of what it adds itself. Kept for the callers of old."""

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()  # writes still blocked fail (EIO), so nothing keeps the mount busy
        with self._groups:
            self._groups.notify_all()
        for folder in (self.host.sysfs, self.host.dev, self.host.kernel_mount):
            detach_mounts(folder)
        self._thread.join(10)
        if self._thread.is_alive():  # a file of ours still open somewhere: the loop ends with it
            self._error(f"the FUSE loop for {self.host.root} outlived its unmount (a file left open?)")
        self._thread = None
        os.close(self._dev_fd)
        self._dev_fd = -1

    def __enter__(self) -> FakeKernel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _error(self, message: str) -> None:
        self.errors.append(message)
        log.warning("fake kernel: %s", message)

    # --- The device model (runs in FUSE's threads; `_kernel` reaches dev/ past our mount) ---

    @contextlib.contextmanager
    def _device_lock(self, address: str) -> Iterator[None]:
        with self._locks_lock:
            lock = self._locks.setdefault(address, threading.Lock())
        while not lock.acquire(timeout=0.05):
            if self._stopping.is_set():
                raise OSError(errno.EIO, "the simulated kernel stopped")
        try:
            yield
        finally:
            lock.release()

    def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self._stopping.wait(seconds):
            raise OSError(errno.EIO, "the simulated kernel stopped")

    def _device(self, data: bytes) -> str | None:
        """The device a control file was given (compared as sysfs_streq does), if it exists."""
        name = data[:-1] if data.endswith(b"\n") else data
        try:
            address = name.decode()
        except UnicodeDecodeError:
            return None
        if not address or "/" in address or address in (".", ".."):
            return None
        return address if os.path.lexists(self.host.sysfs / "bus" / "pci" / "devices" / address) else None

    def _override_file(self, address: str) -> Path:
        return self.host.state / "override" / address

    def _override(self, address: str) -> str:
        """The device's driver_override, "" when unset (read without the device lock, as
        pci_match_device reads it)."""
        try:
            value = self._override_file(address).read_text().strip()
        except OSError:
            return ""
        return "" if value == "(null)" else value

    def read_override(self, address: str) -> bytes:
        with self._device_lock(address):
            try:
                return self._override_file(address).read_bytes()
            except FileNotFoundError:
                raise OSError(errno.ENODEV, "no such device") from None

    def write_override(self, address: str, data: bytes) -> None:
        if len(data) >= PAGE_SIZE - 1:
            raise OSError(errno.EINVAL, "driver_override too long")
        value = data.split(b"\0", 1)[0]  # strlen: Python's print() may send a NUL or two
        value = value.split(b"\n", 1)[0] if value else value
        with self._device_lock(address):
            self._override_file(address).write_bytes(value + b"\n" if value else b"(null)\n")

    def unbind(self, driver: str, data: bytes) -> None:
        address = self._device(data)
        if address is None or self._kernel.driver(address) != driver:
            raise OSError(errno.ENODEV, "not bound to this driver")
        with self._device_lock(address):
            if self._kernel.driver(address):  # another unbind may have finished while we waited
                # __device_release_driver removes the driver links before it calls the driver's
                # remove: a device whose remove waits for its holder already shows no driver
                # (seen under QEMU: tests/realkernel/test_simulation.py), while its group node stays.
                link = self._kernel.device_dir(address) / "driver"
                (link.resolve() / address).unlink(missing_ok=True)
                link.unlink()
                self._wait_for_holders(address)
                if self._kernel.is_fragile(address):
                    self._kernel.remove_device(address)
                elif self._device(data):
                    self._kernel.bind(address, None)

    def _wait_for_holders(self, address: str) -> None:
        """The driver's remove: wait until nothing holds the device (its holder may let go by
        itself once asked, after `lets_go_after` seconds)."""
        held = self.host.state / "held" / address
        asked = time.monotonic()
        while True:
            try:
                text = held.read_text().strip()
            except FileNotFoundError:
                return
            if text and time.monotonic() - asked >= float(text):
                held.unlink(missing_ok=True)
                return
            self._sleep(HOLDER_POLL)

    def bind(self, driver: str, data: bytes) -> None:
        address = self._device(data)
        override = self._override(address) if address else ""
        default = self._kernel.default_driver(address) if address else None
        if address is None or (override or default) != driver:
            raise OSError(errno.ENODEV, "the driver does not match the device")
        with self._device_lock(address):
            if self._kernel.driver(address):
                raise OSError(errno.EBUSY, "the device has a driver")
            failed = self._probe(driver, address)
            if failed:
                raise OSError(failed, os.strerror(failed))

    def drivers_probe(self, data: bytes) -> None:
        address = self._device(data)
        if address is None:
            raise OSError(errno.ENODEV, "no such device")
        if self._kernel.driver(address):
            return
        with self._device_lock(address):
            if self._kernel.driver(address):
                return
            driver = self._override(address) or self._kernel.default_driver(address)
            if driver and (self.host.sysfs / "bus" / "pci" / "drivers" / driver).is_dir():
                self._probe(driver, address)  # a failed probe leaves the device without a driver

    def _probe(self, driver: str, address: str) -> int:
        """The driver's probe: 0 once it took the device, else its errno."""
        self._sleep(self._kernel.probe_time(address))
        if driver == "vfio-pci" and self._kernel.iommu_group(address) is None:
            return errno.EINVAL  # vfio_group_find_or_alloc: no IOMMU group
        self._kernel.bind(address, driver)
        return 0

    def viable(self, group: int) -> bool:
        """VFIO's rule: every member on a driver that manages DMA itself, or on none."""
        members = self.host.sysfs / "kernel" / "iommu_groups" / str(group) / "devices"
        return all(self._kernel.driver(a) in (*DMA_SAFE_DRIVERS, "") for a in os.listdir(members))

    def open_group(self, group: int) -> None:
        with self._groups:
            if not self._groups.wait_for(lambda: group not in self._open_groups, GROUP_RELEASE_GRACE):
                raise OSError(errno.EBUSY, f"group {group} is open")
            self._open_groups.add(group)

    def close_group(self, group: int) -> None:
        with self._groups:
            self._open_groups.discard(group)
            self._groups.notify_all()


def _operation(method):  # noqa: ANN001, ANN202 - a FUSE operation: errors become errnos
    @functools.wraps(method)
    def wrapped(self: _Filesystem, *args: object) -> object:
        try:
            return method(self, *args)
        except _fuse.FuseOSError:
            raise
        except OSError as e:
            raise _fuse.FuseOSError(e.errno or errno.EIO) from None
        except Exception as e:
            self.kernel._error(f"{method.__name__}{args[:2]!r}: {e!r}")
            raise _fuse.FuseOSError(errno.EIO) from None

    return wrapped


class _Filesystem:
    """The FUSE tree: `sysfs/devices/<address>` (a driver_override), `sysfs/drivers/<driver>/bind`
    and `unbind`, `sysfs/drivers_probe`, and `dev/`, passed through to the fixture's dev/ folder
    except for the group nodes in `dev/vfio/`."""

    use_ns = True

    def __init__(self, kernel: FakeKernel) -> None:
        self.kernel = kernel
        self.host = kernel.host
        self.started = time.time_ns()

    def init_with_config(self, conn_info: object, config: object) -> None:
        # No caching in the kernel: dev/ changes under it (the kernel's own binds write it directly).
        config.entry_timeout = config.attr_timeout = config.negative_timeout = 0.0
        config.direct_io = 1  # every read and write reaches us, as sysfs stores and shows do

    # --- Routing ----------------------------------------------------------------------------

    def _route(self, path: str) -> tuple[str, str]:
        """(kind, detail): dir, override (address), bind/unbind (driver), drivers_probe, group
        (number), dev (a path relative to dev/, "" for dev/ itself)."""
        parts = path.strip("/").split("/") if path.strip("/") else []
        if not parts:
            return "dir", ""
        if parts[0] == "dev":
            rel = "/".join(parts[1:])
            if len(parts) == 3 and parts[1] == "vfio" and parts[2].isdigit():
                return "group", parts[2]
            return "dev", rel
        if parts[0] != "sysfs":
            raise OSError(errno.ENOENT, path)
        pci = self.host.sysfs / "bus" / "pci"
        rest = parts[1:]
        if not rest or rest in (["devices"], ["drivers"]):
            return "dir", ""
        if rest == ["drivers_probe"]:
            return "drivers_probe", ""
        if len(rest) == 2 and rest[0] == "devices" and self.kernel._override_file(rest[1]).exists():
            return "override", rest[1]
        if rest[0] == "drivers" and (pci / "drivers" / rest[1]).is_dir():
            if len(rest) == 2:
                return "dir", ""
            if len(rest) == 3 and rest[2] in ("bind", "unbind"):
                return rest[2], rest[1]
        raise OSError(errno.ENOENT, path)

    def _dev(self, rel: str) -> tuple[str, int | None]:
        """A path for the *at calls under dev/ (behind our own mount), and the folder's fd."""
        return (rel or "."), self.kernel._dev_fd

    def _fh(self, kind: str, what: object) -> int:
        fh = next(self.kernel._fhs)
        self.kernel._files[fh] = (kind, what)
        return fh

    # --- Attributes and folders ----------------------------------------------------------------

    @_operation
    def getattr(self, path: str, fh: int | None = None) -> dict:
        kind, detail = self._route(path)
        if kind in ("dev", "group"):
            rel, fd = self._dev(f"vfio/{detail}" if kind == "group" else detail)
            st = os.stat(rel, dir_fd=fd, follow_symlinks=False)
            attrs = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size")}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            if kind == "group":
                attrs["st_mode"] = stat.S_IFREG | 0o600  # a character device on a real host, mode 0600
            return attrs
        if kind == "dir":
            mode = stat.S_IFDIR | 0o755
        else:  # sysfs attributes: a page each; the control files are write-only
            mode = stat.S_IFREG | (0o644 if kind == "override" else 0o200)
        return {"st_mode": mode, "st_nlink": 2 if kind == "dir" else 1, "st_size": 0 if kind == "dir" else PAGE_SIZE,
                "st_atime": self.started, "st_mtime": self.started, "st_ctime": self.started}  # fmt: skip

    @_operation
    def readdir(self, path: str, fh: int) -> list[str]:
        kind, detail = self._route(path)
        if kind == "dev":
            rel, fd = self._dev(detail)
            return [".", "..", *os.listdir(os.path.join(f"/proc/self/fd/{fd}", rel))]
        parts = path.strip("/").split("/")
        pci = self.host.sysfs / "bus" / "pci"
        if parts == [""]:
            names = ["sysfs", "dev"]
        elif parts == ["sysfs"]:
            names = ["devices", "drivers", "drivers_probe"]
        elif parts == ["sysfs", "devices"]:
            names = os.listdir(self.host.state / "override")
        elif parts == ["sysfs", "drivers"]:
            names = os.listdir(pci / "drivers")
        else:
            names = ["bind", "unbind"]
        return [".", "..", *names]

    @_operation
    def readlink(self, path: str) -> str:
        kind, detail = self._route(path)
        if kind != "dev":
            raise OSError(errno.EINVAL, path)
        rel, fd = self._dev(detail)
        return os.readlink(rel, dir_fd=fd)

    # --- Files ------------------------------------------------------------------------------

    @_operation
    def open(self, path: str, flags: int) -> int:
        kind, detail = self._route(path)
        reading = flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR)
        if kind in ("bind", "unbind", "drivers_probe") and reading:
            raise OSError(errno.EACCES, "write-only")  # kernfs: no show, no read
        if kind == "group":
            if not os.path.exists(self.kernel._kernel.vfio_node(int(detail))):
                raise OSError(errno.ENOENT, path)
            self.kernel.open_group(int(detail))
            return self._fh("group", int(detail))
        if kind == "dev":
            rel, fd = self._dev(detail)
            return self._fh("dev", os.open(rel, flags & ~(os.O_CREAT | os.O_EXCL), dir_fd=fd))
        if kind == "dir":
            raise OSError(errno.EISDIR, path)
        return self._fh(kind, detail)

    @_operation
    def create(self, path: str, mode: int, flags: int) -> int:
        kind, detail = self._route(os.path.dirname(path))
        if kind != "dev":
            raise OSError(errno.EACCES, path)
        rel, fd = self._dev(os.path.join(detail, os.path.basename(path)))
        return self._fh("dev", os.open(rel, flags | os.O_CREAT, mode, dir_fd=fd))

    @_operation
    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        kind, what = self.kernel._files[fh]
        if kind == "override":
            return self.kernel.read_override(what)[offset : offset + size]
        if kind == "dev":
            return os.pread(what, size, offset)
        raise OSError(errno.EINVAL, path)  # a group file has no read

    @_operation
    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        kind, what = self.kernel._files[fh]
        if kind == "dev":
            return os.pwrite(what, data, offset)
        if kind == "override":
            self.kernel.write_override(what, data)
        elif kind == "bind":
            self.kernel.bind(what, data)
        elif kind == "unbind":
            self.kernel.unbind(what, data)
        elif kind == "drivers_probe":
            self.kernel.drivers_probe(data)
        else:
            raise OSError(errno.EINVAL, path)
        return len(data)

    @_operation
    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        kind, detail = self._route(path)
        if kind == "dev":  # sysfs ignores O_TRUNC; passed-through files truncate
            rel, fd = self._dev(detail)
            with contextlib.closing(_Fd(os.open(rel, os.O_WRONLY, dir_fd=fd))) as f:
                os.ftruncate(f.fd, length)
        return 0

    @_operation
    def release(self, path: str, fh: int) -> int:
        kind, what = self.kernel._files.pop(fh, ("", None))
        if kind == "dev":
            os.close(what)
        elif kind == "group":
            self.kernel.close_group(what)
        return 0

    @_operation
    def ioctl(self, path: str, cmd: int, arg: object, fh: int, flags: int, data: object) -> int:
        kind, what = self.kernel._files.get(fh, ("", None))
        if kind == "group" and cmd & 0xFFFFFFFF == VFIO_GROUP_SET_CONTAINER:
            if not self.kernel.viable(what):
                raise OSError(errno.EPERM, f"group {what} is not viable")
            return 0
        raise OSError(errno.ENOTTY, path)

    # --- Changes under dev/ (a FakeHost in a test keeps its group nodes there) -----------------

    def _dev_only(self, path: str) -> tuple[str, int | None]:
        kind, detail = self._route(os.path.dirname(path))
        if kind != "dev":
            raise OSError(errno.EPERM, path)
        return self._dev(os.path.join(detail, os.path.basename(path)))

    def _in_dev(self, call, path: str, *args: object) -> int:  # noqa: ANN001 - an os function taking dir_fd
        rel, fd = self._dev_only(path)
        call(rel, *args, dir_fd=fd)
        return 0

    @_operation
    def mkdir(self, path: str, mode: int) -> int:
        return self._in_dev(os.mkdir, path, mode)

    @_operation
    def rmdir(self, path: str) -> int:
        return self._in_dev(os.rmdir, path)

    @_operation
    def unlink(self, path: str) -> int:
        return self._in_dev(os.unlink, path)

    @_operation
    def symlink(self, target: str, source: str) -> int:
        rel, fd = self._dev_only(target)
        os.symlink(source, rel, dir_fd=fd)
        return 0

    @_operation
    def rename(self, old: str, new: str) -> int:
        old_rel, fd = self._dev_only(old)
        new_rel, _ = self._dev_only(new)
        os.rename(old_rel, new_rel, src_dir_fd=fd, dst_dir_fd=fd)
        return 0

    @_operation
    def chmod(self, path: str, mode: int) -> int:
        kind, detail = self._route(path)
        if kind == "dev":
            rel, fd = self._dev(detail)
            os.chmod(rel, mode, dir_fd=fd)
        return 0

    @_operation
    def chown(self, path: str, uid: int, gid: int) -> int:
        return 0

    @_operation
    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        kind, detail = self._route(path)
        if kind in ("dev", "group"):
            rel, fd = self._dev(f"vfio/{detail}" if kind == "group" else detail)
            os.utime(rel, ns=times, dir_fd=fd) if times else os.utime(rel, dir_fd=fd)
        return 0


class _Fd:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.fakekernel", description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the fixture host's root (holding sys/ and dev/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        kernel = FakeKernel(args.root).start()
    except KernelUnavailable as e:
        print(f"fakekernel: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        print(f"fakekernel: answering sysfs writes under {args.root}", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        kernel.stop()


if __name__ == "__main__":
    main()
