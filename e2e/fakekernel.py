"""A simulated kernel for fixture hosts: it answers the vfio bind sequence's sysfs writes.

Writes to `driver_override`, `drivers/<driver>/bind` and `unbind` and `bus/pci/drivers_probe`
move the device's `driver` link (and the driver's back link, and `dev/vfio/<group>`) as the
kernel would, a few milliseconds later. The fixture's files are plain files, so writes are
noticed with inotify (IN_CLOSE_WRITE). In a test:

    with FakeKernel(host):
        vfio.bind_group(host.sysfs, host.dev, 20, [...])

or as a process of its own, until SIGTERM: `python -m e2e.fakekernel ROOT`.

What it does, and where it stops being the kernel:
- `driver_override`: the file holds the value; a blank write clears it to `(null)`.
- `unbind`: the device loses its driver, unless `FakeHost.set_busy` says something holds it
  open: then the write is accepted and the device stays bound (a driver with users), and the
  writer notices only by looking. A device marked `set_fragile` falls off the bus instead.
- `bind`: binds an unbound device when `driver_override` is unset or names the driver.
- `drivers_probe`: binds an unbound device to its `driver_override` if that driver is loaded
  (its drivers dir exists), else nothing; without an override, to its default driver
  (`FakeHost.set_default_driver`). vfio-pci takes only a device with an IOMMU group.
- A write is refused only where the file is not a file (`FakeHost.refuse_writes`) or not
  there; writers must not create files (`passthrough.pci.sysfs.write_text` does not).
- Control files are consumed: emptied once read, so the same text written again is seen.
  Writes to one control file must not overlap (inotify merges events, and the file holds only
  the last text): the agent waits for each step's effect before the next, as it must anyway.
- Hotplugged devices and drivers (after start) are watched as they appear.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import select
import signal
import struct
import sys
import threading
from pathlib import Path

from e2e.fakesysfs import FakeHost

log = logging.getLogger(__name__)

IN_CLOSE_WRITE = 0x008
IN_CREATE = 0x100
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then the name, NUL-padded

_libc = ctypes.CDLL(None, use_errno=True)


class FakeKernel:
    """Makes a FakeHost's tree answer the bind sequence; `start`/`stop` or a `with` block."""

    def __init__(self, host: FakeHost | Path | str) -> None:
        self.host = host if isinstance(host, FakeHost) else FakeHost.existing(Path(host))
        self.pci = self.host.sysfs / "bus" / "pci"
        self.errors: list[str] = []  # what went wrong while reacting (also logged)
        self._fd = -1
        self._watches: dict[int, tuple[str, Path]] = {}  # wd -> (kind, path)
        self._stop_r = self._stop_w = -1
        self._thread: threading.Thread | None = None
        self._synced = threading.Condition()
        self._sync_lock = threading.Lock()  # one sync at a time: the file holds one token
        self._sync_sent = self._sync_seen = 0

    def start(self) -> FakeKernel:
        """Watch the tree and catch up on writes made before; returns once watching."""
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        self._stop_r, self._stop_w = os.pipe()
        self._watch_all()
        self._thread = threading.Thread(target=self._run, name="fakekernel", daemon=True)
        self._thread.start()
        return self

    def sync(self, timeout: float = 5.0) -> None:
        """Return once every write made before this call has had its effect.

        The kernel's effects are there when write(2) returns; ours a moment later: a test
        that looks at the tree right after a write the writer did not wait for calls this.
        """
        with self._sync_lock:
            self._sync_sent += 1
            token = self._sync_sent
            (self.host.state / "sync").write_text(str(token))  # queued behind every earlier event
            with self._synced:
                if not self._synced.wait_for(lambda: self._sync_seen >= token, timeout):
                    raise TimeoutError(f"the fake kernel did not catch up within {timeout} s")

    def stop(self) -> None:
        if self._thread is None:
            return
        os.write(self._stop_w, b"x")
        self._thread.join()
        self._thread = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            os.close(fd)
        self._watches.clear()

    def __enter__(self) -> FakeKernel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- Watching -----------------------------------------------------------------------

    def _watch(self, kind: str, path: Path, mask: int) -> bool:
        wd = _libc.inotify_add_watch(self._fd, os.fsencode(path), mask | IN_ONLYDIR)
        if wd < 0:
            return False  # gone meanwhile
        self._watches[wd] = (kind, path)
        return True

    def _watch_all(self) -> None:
        """Every watch, each followed by a catch-up on what was written before it existed."""
        self._watch("pci", self.pci, IN_CLOSE_WRITE)
        self._watch("devices", self.pci / "devices", IN_CREATE)
        self._watch("drivers", self.pci / "drivers", IN_CREATE)
        self._watch("state", self.host.state, IN_CLOSE_WRITE)
        for name in sorted(os.listdir(self.pci / "drivers")):
            self._watch_driver(name)
        for address in sorted(os.listdir(self.pci / "devices")):
            self._watch_device(address)
        self._react("pci", self.pci, "drivers_probe")

    def _watch_driver(self, name: str) -> None:
        path = self.pci / "drivers" / name
        if self._watch("driver", path, IN_CLOSE_WRITE):
            for control in ("unbind", "bind"):
                self._react("driver", path, control)

    def _watch_device(self, address: str) -> None:
        path = Path(os.path.realpath(self.pci / "devices" / address))
        if self._watch("device", path, IN_CLOSE_WRITE):
            self._react("device", path, "driver_override")

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                continue
            offset = 0
            while offset < len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0").decode()
                offset += _EVENT.size + length
                try:
                    self._event(wd, mask, name)
                except Exception as e:  # a fixture changed under us (a device removed): note it, go on
                    self.errors.append(f"{name}: {e!r}")
                    log.warning("fake kernel: reacting to %s failed: %r", name, e)

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:
            self._watch_all()
            return
        if mask & IN_IGNORED:
            self._watches.pop(wd, None)
            return
        if wd not in self._watches:
            return
        kind, path = self._watches[wd]
        if mask & IN_CREATE:
            (self._watch_driver if kind == "drivers" else self._watch_device)(name)
        elif mask & IN_CLOSE_WRITE and kind == "state":
            if name == "sync":
                with self._synced:
                    self._sync_seen = max(self._sync_seen, int((path / name).read_text() or 0))
                    self._synced.notify_all()
        elif mask & IN_CLOSE_WRITE:
            self._react(kind, path, name)

    # --- Reacting -----------------------------------------------------------------------

    def _react(self, kind: str, folder: Path, name: str) -> None:
        if kind == "device" and name == "driver_override":
            self._override_written(folder / name)
        elif kind == "driver" and name in ("bind", "unbind"):
            address = _consume(folder / name)
            if address:
                (self._unbind if name == "unbind" else self._bind)(folder.name, address)
        elif kind == "pci" and name == "drivers_probe":
            address = _consume(folder / name)
            if address:
                self._probe(address)

    def _override_written(self, path: Path) -> None:
        # Only a blank write changes what the file holds: rewriting anything else would race
        # the next write for nothing (and our own write would come back as an event).
        try:
            text = path.read_text()
        except OSError:
            return
        if not text.strip():
            path.write_text("(null)\n")

    def _exists(self, address: str) -> bool:
        return (self.pci / "devices" / address).exists()

    def _override(self, address: str) -> str:
        try:
            value = (self.pci / "devices" / address / "driver_override").read_text().strip()
        except OSError:
            return ""
        return "" if value == "(null)" else value

    def _unbind(self, driver: str, address: str) -> None:
        if not self._exists(address) or self.host.driver(address) != driver or self.host.is_busy(address):
            return
        if self.host.is_fragile(address):
            self.host.remove_device(address)
        else:
            self.host.bind(address, None)

    def _bind(self, driver: str, address: str) -> None:
        if self._exists(address) and not self.host.driver(address) and self._override(address) in ("", driver):
            self._take(driver, address)

    def _probe(self, address: str) -> None:
        if not self._exists(address) or self.host.driver(address):
            return
        driver = self._override(address) or self.host.default_driver(address)
        if driver and (self.pci / "drivers" / driver).is_dir():
            self._take(driver, address)

    def _take(self, driver: str, address: str) -> None:
        if driver == "vfio-pci" and self.host.iommu_group(address) is None:
            return  # vfio-pci's probe fails: no IOMMU group
        self.host.bind(address, driver)


def _consume(path: Path) -> str:
    """What was written to a control file, which is then emptied (truncate: no close event)."""
    try:
        text = path.read_text().strip()
        if text:
            os.truncate(path, 0)
    except OSError:
        return ""
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.fakekernel", description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the fixture host's root (holding sys/ and dev/)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with FakeKernel(args.root):
        print(f"fakekernel: answering sysfs writes under {args.root}", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass


if __name__ == "__main__":
    main()
