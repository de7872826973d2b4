"""Fixtures of the real-kernel tests: stock Debian kernels booted under QEMU (e2e/guest).

One boot per kernel series per session (`guests.get(series)`; `guest` is the default
series), and one node in the default guest (`node`: the real kubelet and the real agent, with
`--write-deadline=3s`; the operator on the host). Tests marked `rk_last(n)` run after every
other, in the order of n: those that take something from the guest for good (a device_del) or
stop its agent. Where QEMU or a kernel cannot be had, every test here skips with the reason in a
yellow line, and fails instead under CI=true. A boot that fails is an error with the console's
tail, never a skip.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from e2e import support
from e2e.guest.kernel import DEFAULT_SERIES, RigUnavailable, kernel
from e2e.guest.machine import Guest, GuestError, boot, expected, qemu_processes
from e2e.guest.node import GuestNode, wait
from e2e.processes import OperatorProcess

WRITE_DEADLINE = 3.0  # the agent's --write-deadline here: short, so a blocked write shows soon


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "realkernel: boots a real kernel under QEMU (tests/realkernel)")
    config.addinivalue_line("markers", "rk_last(n): run after every other real-kernel test, in the order of n")


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item) -> int:
        mark = item.get_closest_marker("rk_last")
        return mark.args[0] if mark else 0

    items.sort(key=rank)  # stable: the rest keep their order


def _absent(request, reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the real-kernel rig is required under CI=true, and cannot run: {reason}", pytrace=False)
    support.skip_loudly(request, "real-kernel", reason, once_key="realkernel")


class Guests:
    """The session's guests, booted on first request and kept for the session."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.booted: dict[str, Guest] = {}
        self.failed: dict[str, BaseException] = {}
        self.boot_seconds: dict[str, float] = {}

    def get(self, request, series: str = DEFAULT_SERIES) -> Guest:
        if series in self.booted:
            return self.booted[series]
        if series not in self.failed:  # a boot that failed is not tried again for each test
            try:
                found = kernel(series)
                workdir = self.tmp_path_factory.mktemp(f"guest-{series}")
                self.booted[series] = boot(found, workdir)
                self.boot_seconds[f"{series} ({found.package})"] = self.booted[series].boot_seconds
                return self.booted[series]
            except (RigUnavailable, GuestError) as exc:
                self.failed[series] = exc
        exc = self.failed[series]
        if isinstance(exc, RigUnavailable):
            _absent(request, str(exc))
        raise GuestError(f"kernel {series}: {exc}")

    def stop_all(self) -> None:
        for guest in self.booted.values():
            guest.stop()


@pytest.fixture(scope="session")
def guests(request, tmp_path_factory):
    pool = Guests(tmp_path_factory)
    request.config.stash[_BOOTS] = pool.boot_seconds
    yield pool
    mine = [g.proc.pid for g in pool.booted.values()]
    pool.stop_all()
    left = set(mine) & set(qemu_processes())
    assert not left, f"QEMU processes left running after the session: {sorted(left)}"


@pytest.fixture(scope="session")
def guest(request, guests) -> Guest:
    """The default kernel's guest (6.1, bookworm's), booted once for the session."""
    return guests.get(request, DEFAULT_SERIES)


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:6]


_BOOTS = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    boots = config.stash.get(_BOOTS, {})
    if boots:
        line = ", ".join(f"{series} booted in {seconds:.1f}s" for series, seconds in boots.items())
        terminalreporter.write_line(f"real-kernel rig: {line}")


@pytest.fixture(scope="session")
def operator(cluster, tmp_path_factory):
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("rk-operator") / "operator.log")
    proc.start(timeout=60)
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture(scope="session")
def node(guest, cluster, operator):
    """Node rk-<id> in the default guest: the real kubelet, then the agent, once every device is reported."""
    node = GuestNode(guest, cluster, f"rk-{uuid.uuid4().hex[:6]}")
    try:
        node.start_kubelet()
        node.start_agent(f"--write-deadline={WRITE_DEADLINE:g}s")
        started = time.monotonic()
        wait(lambda: set(expected()) <= set(node.devices()), 300, f"the agent on {node.name} to report", node)
        node.timings["agent first report"] = time.monotonic() - started
        print(f"\nguest node {node.name}: " + ", ".join(f"{k} {v:.1f}s" for k, v in node.timings.items()))
        yield node
    finally:
        log = node.stop()
    assert "Traceback" not in log, log


@pytest.fixture(scope="session")
def tenant(cluster):
    name = f"rk-tenant-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
