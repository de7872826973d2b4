"""Runs the vfio sequences (`pci.vfio`) in a child process, each job under a deadline: a sysfs
write that blocks (an unbind whose device someone holds, a driver's slow remove) blocks that
child, never the agent, which keeps scanning, reporting and serving, and exits on SIGTERM.

A job past its deadline is overdue: its group is left alone (`overdue`), its child is set aside
and a fresh one takes the next job. The overdue write returns when the holder lets go; the child
then reports, exits, and `on_finished` asks for a scan. A child blocked in a write cannot be
killed until the write returns, so nobody waits for it.

The child is `python -m passthrough.pci.binder --sysfs-root=... --dev-root=... --proc-root=...`
(the agent's roots): one JSON job per line on stdin, one JSON answer per line on stdout. Or,
where the agent itself may not write sysfs (the chart's least-privilege pod: its container
sees the host's /sys read-only), `passthrough binder --listen SOCKET` runs in a container of
its own that may, and forks a child per connection that speaks the same lines: the agent's
`Binder(sockets=...)` connects instead of starting a child, and sets a blocked connection aside
just as it sets a blocked child aside. The sockets are binder containers in order of preference
(the chart runs two, `binder` and `binder-standby`): a container killed while a child of it is
blocked in the kernel cannot restart until that write returns, and meanwhile the next one takes
the new connections.

Either way the binder judges each job itself (`pci.jobs`): its roots are those of its own
command line, never the job's, and it writes only the bind files below its sysfs root, never
through a symlink (`sysfs.confine`). A compromised agent can ask it only for what the agent
may legitimately ask: an eligible group moved whole to vfio-pci, or given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socketserver
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from passthrough.pci import sysfs
from passthrough.pci.jobs import Roots
from passthrough.pci.vfio import BindError

log = logging.getLogger(__name__)

DEADLINE = 15.0  # seconds one job may take: writes of 1-140 ms, polls, the wait for /dev/vfio/<group>
START_TIMEOUT = 120.0  # seconds a child may take to start (a Python start; slow under emulation)
# Seconds a binder container that took a connection but did not greet is tried after the others:
# each try waits for its greeting, and a job should not wait for it again and again.
SLOW_GREETING_SET_BACK = 60.0


class BinderAway(BindError):
    """No binder container is there to take the job (restarting, or stopped behind a write the
    kernel holds), or the one that took it went: BindFailed, asked again soon rather than after a
    growing back-off, as one may be back any second and each try is one local connect."""

    def __init__(self, message: str) -> None:
        super().__init__("BindFailed", message)


@dataclass
class Overdue:
    """A job whose write has not returned by its deadline."""

    op: str
    group: int
    members: tuple[str, ...]
    since: float  # time.monotonic() at the deadline, or when its caller went
    cancelled: bool = False  # its caller went before the deadline (the job is in flight all the same)

    def message(self, deadline: float) -> str:
        what = "binding it to vfio-pci" if self.op == "bind" else "giving it back"
        if self.cancelled:
            late, holds = "is still in flight (the scan that asked for it was cancelled)", "something may hold"
        else:
            late, holds = f"has not returned after {deadline:g} s", "something holds"
        return (
            f"a sysfs write while {what} {late}: {holds} IOMMU group {self.group} ({', '.join(self.members)}): a VMM, "
            "nvidia-persistenced, a CUDA process. The kernel finishes the write once that lets go; until then the agent "
            "leaves the group alone"
        )


class Binder:
    """Bind and release jobs, one at a time, in a child process that the agent never waits on."""

    def __init__(
        self,
        deadline: float = DEADLINE,
        start_timeout: float = START_TIMEOUT,
        on_finished: Callable[[], None] | None = None,
        command: tuple[str, ...] = (sys.executable, "-m", "passthrough.pci.binder"),
        sockets: Sequence[Path] = (),
        proc_root: Path = Path("/proc"),
        virtual_functions: bool = False,
    ) -> None:
        self.deadline = deadline
        # Binder containers, in order of preference; none: a child of this process.
        self.sockets = tuple(Path(s) for s in sockets)
        self._slow: dict[Path, float] = {}  # socket -> when it last took a connection and did not greet
        # The child's roots besides the sysfs and /dev of the jobs, as the agent's own (a binder
        # container has its own on its command line).
        self.proc_root = Path(proc_root)
        self.virtual_functions = virtual_functions
        self.start_timeout = start_timeout
        self.on_finished = on_finished
        self.command = command
        self.overdue: dict[int, Overdue] = {}
        # What late bind jobs moved to vfio-pci (address -> its old driver_override), for the
        # agent's record: a write that returned after its deadline still moved devices.
        self.late_moved: dict[str, str] = {}
        self._worker: Any = None  # the child (asyncio.subprocess.Process) or connection (_Connection)
        self._set_aside: list[Any] = []
        self._lock = asyncio.Lock()
        self._ids = itertools.count(1)

    def take_late_moved(self) -> dict[str, str]:
        """What late bind jobs moved to vfio-pci since the last call."""
        moved, self.late_moved = self.late_moved, {}
        return moved

    def overdue_addresses(self) -> frozenset[str]:
        return frozenset(a for job in self.overdue.values() for a in job.members)

    async def bind(
        self, sysfs_root: Path, dev_root: Path, group: int, members: list[str], timeout: float
    ) -> tuple[int, dict[str, str]]:
        """Returns the writes made and the members this job moved to vfio-pci, each with the
        `driver_override` it had before (what a give-back restores); the latter also when the
        job failed and left some there, as a rollback that failed does."""
        answer = await self._run("bind", group, members, (sysfs_root, dev_root), timeout=timeout)
        return int(answer["writes"]), answer.get("moved") or {}

    async def release(
        self,
        sysfs_root: Path,
        dev_root: Path,
        group: int,
        members: list[str],
        timeout: float,
        overrides: Mapping[str, str] | None = None,
    ) -> int:
        answer = await self._run("release", group, members, (sysfs_root, dev_root), timeout=timeout,
                                 overrides=dict(overrides or {}))  # fmt: skip
        return int(answer["writes"])

    async def close(self) -> None:
        """Stop the children: the idle one at once; one blocked in a write dies when it returns."""
        for worker in [*self._set_aside, *([self._worker] if self._worker else [])]:
            with contextlib.suppress(ProcessLookupError):
                worker.kill()
        if self._worker is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._worker.wait()
        self._worker = None

    # -- the parent's side -------------------------------------------------------------------

    def _roots(self, sysfs_root: Path, dev_root: Path) -> Roots:
        return Roots(Path(sysfs_root), Path(dev_root), self.proc_root, self.virtual_functions)

    async def _run(self, op: str, group: int, members: list[str], roots: tuple[Path, Path], **args: Any) -> dict[str, Any]:
        if group in self.overdue:
            raise BindError("WriteBlocked", self.overdue[group].message(self.deadline))
        async with self._lock:
            worker = await self._ready_worker(self._roots(*roots))
            job = {"id": next(self._ids), "op": op, "group": group, "members": members, **args}
            assert worker.stdin is not None
            worker.stdin.write(json.dumps(job).encode() + b"\n")
            reply = asyncio.ensure_future(self._answer(worker))
            try:
                # asyncio.timeout, never wait_for: on Python 3.11 wait_for loses a cancellation
                # that comes with the answer (SIGTERM reaches this child and the agent at once:
                # the child dies, the cancelled scan went on as if the answer were all).
                async with asyncio.timeout(self.deadline):
                    answer = await asyncio.shield(reply)
            except TimeoutError:
                late = Overdue(op, group, tuple(members), time.monotonic())
                self.overdue[group] = late
                self._worker = None  # a fresh child takes the next job
                self._set_aside.append(worker)
                reply.add_done_callback(lambda task: self._finished_late(late, worker, task))
                log.warning("%s", late.message(self.deadline))
                raise BindError("WriteBlocked", late.message(self.deadline)) from None
            except asyncio.CancelledError:
                # The caller went (a scan past its own deadline, SIGTERM) with the job still in
                # the child: the child goes aside, so that no later job reads this one's answer,
                # and the group counts as overdue until the answer comes (its write may be the
                # one that blocks: nothing may read what waits for its device lock meanwhile).
                # Its end (an answer, or death when close() kills it) is collected as a late one.
                if self._worker is worker:
                    self._worker = None
                self._set_aside.append(worker)
                if not reply.done():
                    late = Overdue(op, group, tuple(members), time.monotonic(), cancelled=True)
                    self.overdue[group] = late
                    reply.add_done_callback(lambda task: self._finished_late(late, worker, task))
                else:
                    reply.add_done_callback(lambda task: self._collected(worker, task))
                raise
        return _outcome(answer)

    async def _ready_worker(self, roots: Roots) -> asyncio.subprocess.Process:
        # A worker whose output has ended is gone though nobody waited for it: a child that died,
        # or a binder container's child killed with its container (a crash, an OOM kill).
        worker = self._worker
        if worker is not None and (worker.returncode is not None or worker.stdout.at_eof()):
            worker = self._worker = None
        if not self.sockets:
            if worker is None:
                worker = await asyncio.create_subprocess_exec(
                    *self.command, *roots_arguments(roots), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
                )
                try:
                    await self._greeted(worker, self.start_timeout)
                except TimeoutError:
                    raise BindError("BindFailed", f"the binder process did not start within {self.start_timeout:g} s") from None
                self._worker = worker
            return worker
        # A connection to a standby is kept only until a container preferred to it answers again:
        # the preferred one is back (its blocked write returned), and takes the jobs as before.
        # One that took a connection and did not greet lately is tried last, and not while another serves.
        now = time.monotonic()
        slow = {s for s, since in self._slow.items() if now - since < SLOW_GREETING_SET_BACK}
        if worker is None:
            tried = sorted(self.sockets, key=lambda s: s in slow)
        else:
            tried = [s for s in self.sockets[: self.sockets.index(worker.socket)] if s not in slow]
        away = []
        for socket in tried:
            try:
                found = await self._connect(socket)
            except BindError as exc:
                away.append(f"{socket} ({exc})")
                continue
            if worker is not None:
                worker.kill()  # idle: its child in the standby exits
            self._worker = found
            return found
        if worker is not None:
            return worker
        raise BinderAway(f"no binder container answers: {'; '.join(away)}. Are the agent pod's binder containers "
                         "running? (kubectl describe pod <agent pod>; kubectl logs <agent pod> -c binder, "
                         "-c binder-standby)")  # fmt: skip

    async def _connect(self, socket: Path) -> _Connection:
        try:
            worker = _Connection(socket, *await asyncio.open_unix_connection(str(socket)))
        except OSError as exc:
            raise BindError("BindFailed", exc.strerror or str(exc)) from None
        # A binder container's child answers at once (a fork, no start-up): waiting longer than a
        # job may take would hold the scan on a container that accepts and never serves.
        limit = min(self.start_timeout, self.deadline)
        try:
            await self._greeted(worker, limit)
        except TimeoutError:
            self._slow[socket] = time.monotonic()  # tried after the others for a while
            raise BindError("BindFailed", f"it took the connection but did not answer within {limit:g} s") from None
        self._slow.pop(socket, None)
        return worker

    async def _greeted(self, worker: Any, limit: float) -> None:
        """The worker's hello; TimeoutError (the worker killed) when none comes within `limit` s."""
        try:
            async with asyncio.timeout(limit):
                hello = await self._answer(worker)
        except TimeoutError:
            worker.kill()
            raise
        if not hello.get("ready"):
            worker.kill()
            raise BindError("BindFailed", f"the binder process started wrongly: {hello}")

    async def _answer(self, worker: asyncio.subprocess.Process) -> dict[str, Any]:
        assert worker.stdout is not None
        try:
            line = await worker.stdout.readline()
        except ConnectionError:  # the binder container's child went with the job unanswered
            line = b""
        if not line:
            code = await worker.wait()
            if worker is self._worker:
                self._worker = None
            if isinstance(worker, _Connection):
                raise BinderAway(f"the binder container's connection on {worker.socket} ended before it answered (was "
                                 "the container restarted? kubectl logs <agent pod> -c binder --previous, or "
                                 "-c binder-standby --previous)")  # fmt: skip
            raise BindError("BindFailed", f"the binder process exited (code {code}) before it answered; the agent's log says why")
        return json.loads(line)

    def _let_go(self, worker: asyncio.subprocess.Process) -> None:
        """A set-aside child whose job ended: no longer ours to kill; it exits at the end of its input."""
        with contextlib.suppress(ValueError):
            self._set_aside.remove(worker)
        if worker.stdin is not None:
            worker.stdin.close()

    def _collected(self, worker: asyncio.subprocess.Process, task: asyncio.Future) -> None:
        """The end of a job whose caller went: read (never "exception was never retrieved"), and
        its child let go (it exits at the end of its input; close() kills one still there)."""
        self._let_go(worker)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a job whose caller went ended: %s", task.exception())

    def _finished_late(self, late: Overdue, worker: asyncio.subprocess.Process, task: asyncio.Future) -> None:
        self.overdue.pop(late.group, None)
        self._let_go(worker)
        if task.cancelled():
            return
        error = task.exception()
        if late.op == "bind":
            answer = task.result() if error is None else {}
            self.late_moved.update(answer.get("moved") or {})
        try:
            outcome = f"done ({_outcome(task.result())['writes']} writes)" if error is None else f"failed ({error})"
        except BindError as exc:
            outcome = f"failed ({exc})"
        log.info("the overdue %s of IOMMU group %d returned after %.1f s more: %s", late.op, late.group,
                 time.monotonic() - late.since, outcome)  # fmt: skip
        if self.on_finished is not None:
            self.on_finished()


def _outcome(answer: dict[str, Any]) -> dict[str, Any]:
    if "reason" in answer:
        error = BindError(answer["reason"], answer["message"])
        error.moved = answer.get("moved") or {}  # type: ignore[attr-defined]
        raise error
    return answer


# -- the child's side ------------------------------------------------------------------------


def roots_arguments(roots: Roots) -> list[str]:
    """The command-line arguments that give a binder `roots` (`parse_roots` reads them)."""
    flags = [f"--sysfs-root={roots.sysfs}", f"--dev-root={roots.dev}", f"--proc-root={roots.proc}"]
    return flags + (["--sriov-virtual-functions"] if roots.virtual_functions else [])


def parse_roots(argv: list[str]) -> Roots:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m passthrough.pci.binder")
    add_roots(parser)
    return roots_of(parser.parse_args(argv))


def add_roots(parser: Any) -> None:
    """The binder's own roots, as `passthrough binder` and its child take them."""
    parser.add_argument("--sysfs-root", default="/sys", metavar="DIR", help="the host's sysfs (default /sys)")
    parser.add_argument("--dev-root", default="/dev", metavar="DIR", help="where /dev/vfio is found (default /dev)")
    parser.add_argument("--proc-root", default="/proc", metavar="DIR",
                        help="the host's procfs: which disks are in use (default /proc)")  # fmt: skip
    parser.add_argument("--sriov-virtual-functions", action="store_true",
                        help="SR-IOV virtual functions may be moved, as the agent's flag of that name says")  # fmt: skip


def roots_of(args: Any) -> Roots:
    return Roots(Path(args.sysfs_root), Path(args.dev_root), Path(args.proc_root), bool(args.sriov_virtual_functions))


def _do(raw: Any, roots: Roots) -> dict[str, Any]:
    from passthrough.pci import jobs, vfio

    root, dev = roots.sysfs, roots.dev
    answer: dict[str, Any] = {"id": raw.get("id") if isinstance(raw, dict) else None, "moved": {}}
    try:
        job = jobs.judge(raw, roots)
    except BindError as exc:
        log.warning("%s", exc)
        return {**answer, "reason": exc.reason, "message": str(exc)}
    before = {a: vfio.state(root, a) for a in job.members} if job.op == "bind" else {}
    try:
        if job.op == "bind":
            answer["writes"] = vfio.bind_group(root, dev, job.group, list(job.members), job.timeout)
        else:
            answer["writes"] = vfio.release_group(root, dev, job.group, list(job.members), job.timeout,
                                                  overrides=job.overrides)  # fmt: skip
    except BindError as exc:
        answer.update(reason=exc.reason, message=str(exc))
    except Exception as exc:  # a bug must not take the channel down: say it, and go on
        answer.update(reason="BindFailed", message=f"the binder failed: {type(exc).__name__}: {exc}")
    # What this job moved to vfio-pci, success or not: only that is the agent's to give back.
    answer["moved"] = {
        a: override for a, (driver, override) in before.items()
        if driver not in (None, vfio.VFIO_DRIVER) and vfio.state(root, a)[0] == vfio.VFIO_DRIVER
    }
    return answer


def _speak(lines: Iterable[str], out: IO[str], roots: Roots) -> None:
    """The binder's side of the channel: a hello, then one answer per job, until the input ends."""
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in lines:
        if line.strip():
            try:
                raw = json.loads(line)
            except ValueError:
                raw = None  # refused as not a job, like any other shape
            out.write(json.dumps(_do(raw, roots)) + "\n")
            out.flush()


def main() -> None:
    # A terminal's Ctrl-C reaches the whole process group: the agent stops this child itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    roots = parse_roots(sys.argv[1:])
    sysfs.confine(roots.sysfs)
    _speak(sys.stdin, sys.stdout, roots)


class _Connection:
    """A connection to a binder container, shaped like the child process it stands in for."""

    def __init__(self, socket: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.socket = socket
        self.stdout, self.stdin = reader, writer
        self.returncode: int | None = None

    def kill(self) -> None:
        self.stdin.close()  # the binder's child for it ends once its write (if any) returns
        self.returncode = -9

    async def wait(self) -> int:
        self.stdin.close()
        self.returncode = 0 if self.returncode is None else self.returncode
        return self.returncode


class _Server(socketserver.ForkingMixIn, socketserver.UnixStreamServer):
    block_on_close = False  # a child blocked in the kernel must not hold up the container's stop
    roots: Roots

    def finish_request(self, request: Any, client_address: Any) -> None:
        # In the child (ForkingMixIn forks first): the listening socket is its parent's. A child
        # that kept it, blocked in the kernel after its container was killed, would keep the
        # socket accepting connections nobody serves, and the agent would wait on each one.
        self.socket.close()
        super().finish_request(request, client_address)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        _speak((line.decode(errors="replace") for line in self.rfile), _Text(self.wfile), self.server.roots)


class _Text:
    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw

    def write(self, text: str) -> None:
        self.raw.write(text.encode())

    def flush(self) -> None:
        self.raw.flush()


def serve(path: Path, roots: Roots) -> None:
    """`passthrough binder --listen PATH`: a child per connection, so a job blocked in the kernel
    holds up only its own connection; until SIGTERM. Jobs are judged against `roots`, and
    nothing but the bind files below its sysfs is written."""
    path = Path(path)
    sysfs.confine(roots.sysfs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with _Server(str(path), _Handler) as server:
        server.roots = roots
        os.chmod(path, 0o600)  # the agent runs as root too; nobody else on the node may ask
        log.info("binder listening on %s (sysfs %s, /dev %s, /proc %s)", path, roots.sysfs, roots.dev, roots.proc)
        server.serve_forever()


def run(args: Any) -> int:
    """`passthrough binder`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(Path(args.listen), roots_of(args))
    return 0


if __name__ == "__main__":
    main()
