"""Reads `driver_override` without ever waiting behind a blocked write.

The kernel takes the device lock to show `driver_override`, and a sysfs write that blocks (an
unbind whose driver waits for its holder: vfio-pci for a VMM, snd_hda_intel for an open sound
device) holds that lock until it returns. The agent cannot always know of such a write: the
scan that started it may have been cancelled, or the agent or its binder restarted while the
write stayed blocked in the kernel. So the agent reads overrides in a child process
(`Isolated`): a read that does not answer within its timeout marks the device blocked, the
child is set aside (it cannot be killed while in the kernel), and the device is not read again
until that child's read returns, which is also when the write did.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from passthrough.pci import sysfs
from passthrough.pci.sysfs import SysfsError

log = logging.getLogger(__name__)

UNSET = "(null)"  # what the kernel shows for an override that is not set
READ_TIMEOUT = 2.0  # seconds one read may take: microseconds unless the device lock is held
START_TIMEOUT = 120.0  # seconds the child may take to start (a Python start; slow under emulation)
BATCH = 256  # paths asked at once: well inside a pipe's 64 KiB, so the write never waits


def read(entry: Path) -> str:
    """A device's `driver_override` ("" when unset or unreadable: it only says why a device has no
    driver), read here. `entry`: the device's directory."""
    try:
        value = sysfs.read_text(Path(entry) / "driver_override")
    except SysfsError:
        return ""
    return "" if value == UNSET else value


def in_process(entries: Mapping[str, Path]) -> dict[str, str]:
    """Each device's override, read in this process: for a command run once (`passthrough discover`)."""
    return {address: read(entry) for address, entry in entries.items()}


class Isolated:
    """The agent's reader: each read in a child process, under READ_TIMEOUT."""

    def __init__(self, timeout: float = READ_TIMEOUT, start_timeout: float = START_TIMEOUT,
                 command: tuple[str, ...] = (sys.executable, "-m", "passthrough.pci.overrides")) -> None:  # fmt: skip
        self.timeout, self.start_timeout, self.command = timeout, start_timeout, command
        self._child: subprocess.Popen | None = None
        self._stuck: dict[str, subprocess.Popen] = {}  # device directory -> the child still in its read
        self._lock = threading.Lock()  # scans read from worker threads

    def blocked(self) -> frozenset[str]:
        """The directories of the devices whose read has not returned: a write holds their lock."""
        with self._lock:
            self._collect()
            return frozenset(self._stuck)

    def __call__(self, entries: Mapping[str, Path]) -> dict[str, str]:
        """Each device's override; a device whose read is blocked (now, or still from before) is
        left out, and so is every device when no child can be started (said in the log)."""
        with self._lock:
            self._collect()
            pending = [(a, e) for a, e in entries.items() if str(e) not in self._stuck]
            found: dict[str, str] = {}
            while pending:
                child = self._ready()
                if child is None:
                    break
                batch, pending = pending[:BATCH], pending[BATCH:]
                left = self._ask(child, batch, found)
                pending = left + pending
            return found

    def close(self) -> None:
        """Stop the children: the idle one at once; one stuck in a read dies when it returns."""
        with self._lock:
            for child in [*self._stuck.values(), *([self._child] if self._child else [])]:
                _end(child)
            self._stuck.clear()
            self._child = None

    def _ask(self, child: subprocess.Popen, batch: list[tuple[str, Path]], found: dict[str, str]) -> list[tuple[str, Path]]:
        """Ask `child` for the batch at once (one pipe's worth: the write never waits on a child that
        is stuck); the devices it did not get to, when it stuck or died."""
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(b"".join(json.dumps(str(entry)).encode() + b"\n" for _, entry in batch))
        except OSError:
            self._child = None
            return batch
        for done, (address, entry) in enumerate(batch):
            line = _line(child, self.timeout)
            if line is None:
                log.warning("reading %s/driver_override has not returned after %g s: a sysfs write holds the device "
                            "(an unbind whose driver waits for its holder); the device is left alone until it returns",
                            entry, self.timeout)  # fmt: skip
                self._stuck[str(entry)] = child
                self._child = None
                return batch[done + 1 :]
            if not line:
                log.warning("the override reader exited (code %s) while reading %s", child.poll(), entry)
                self._child = None  # this one is unknown, as unreadable is; the next child reads the rest
                _end(child)
                return batch[done + 1 :]
            found[address] = json.loads(line)
        return []

    def _ready(self) -> subprocess.Popen | None:
        if self._child is not None and self._child.poll() is None:
            return self._child
        try:
            # Unbuffered: select() sees what the child wrote, never a line already in our buffer.
            child = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        except OSError as exc:
            log.warning("the override reader cannot start (%s)", exc)
            return None
        if _line(child, self.start_timeout) != b'"ready"\n':
            log.warning("the override reader did not start within %g s", self.start_timeout)
            _end(child)
            return None
        self._child = child
        return child

    def _collect(self) -> None:
        """Let go of the devices whose stuck read returned."""
        for entry, child in list(self._stuck.items()):
            if child.poll() is not None or _line(child, 0) is not None:
                log.info("reading %s/driver_override returned: the write that held the device is done", entry)
                del self._stuck[entry]
                _end(child)


# The agent's reader: one per process, since a child stuck in a read is the process's whatever
# scan started it (keyed by device directory: a test may run agents of several hosts in one).
AGENT = Isolated()


def _line(child: subprocess.Popen, timeout: float) -> bytes | None:
    """The child's next line (b"" at its end), or None if none came within `timeout` s."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    if not ready:
        return None
    return child.stdout.readline()


def _end(child: subprocess.Popen) -> None:
    """Close the child's input (it exits at its end) and kill it; never wait: it may be in the kernel."""
    for close in (child.stdin, child.stdout):
        try:
            if close is not None:
                close.close()
        except OSError:
            pass
    try:
        child.kill()
    except ProcessLookupError:
        pass
    child.poll()


def main() -> None:
    """The child: a path per line in, its override per line out (JSON), until the input ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(sys.stdout.fileno(), "w", buffering=1)
    out.write('"ready"\n')
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(read(Path(json.loads(line)))) + "\n")


if __name__ == "__main__":
    main()
