"""The operator stops on SIGTERM even when its API server is gone.

Kubernetes sends SIGTERM and waits out the grace period; a benchmark or `make run` that is
interrupted stops its control plane first. Either way the operator must exit, not wait on
requests to a server that will never answer them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import pytest

from e2e import cluster as local
from e2e import support
from e2e.processes import OperatorProcess
from passthrough.kube.connect import connect

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def own(tmp_path_factory):
    """A control plane of this module's own: these tests freeze and stop it under the operator."""
    started = local.start(tmp_path_factory.mktemp("controlplane"))
    yield started
    started.stop()


def _started_up(operator: OperatorProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while "start-up done" not in operator.output():  # every index listed, the work queue run dry once
        assert time.monotonic() < deadline, operator.output()[-3000:]
        time.sleep(0.1)


def _exits_on_sigterm(operator: OperatorProcess, within: float) -> float:
    assert operator.proc.poll() is None, f"the operator exited by itself:\n{operator.output()[-3000:]}"
    started = time.monotonic()
    operator.proc.send_signal(signal.SIGTERM)
    try:
        code = operator.proc.wait(within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the operator did not exit within {within:.0f}s of SIGTERM:\n{operator.output()[-3000:]}")
    assert code == 0, operator.output()[-3000:]
    return time.monotonic() - started


async def _assign_devices(own, count: int) -> None:
    api = await connect(str(own.kubeconfig))
    try:
        await support.create_namespace(api, "team-a")
        node = await support.ensure_node(api, "frozen-node")
        names = [await support.report_device(api, node, support.gpu(f"0000:{j // 8 + 1:02x}:{j % 8:02x}.0")) for j in range(count)]
        await asyncio.gather(*(support.assign(api, name, "team-a") for name in names))
    finally:
        await api.close()


def test_the_operator_stops_on_sigterm_while_its_api_server_answers_nothing(own, tmp_path):
    # A server that hangs, or one behind a partition, accepts connections and never answers:
    # requests with no deadline (an Event being posted) would keep the operator waiting.
    operator = OperatorProcess(own, tmp_path / "operator.log")
    apiserver = next(p for p in own.processes if p.name == "kube-apiserver")
    operator.start()
    try:
        _started_up(operator)
        asyncio.run(_assign_devices(own, 100))  # writes and Events on their way as the server freezes
        time.sleep(0.3)
        os.kill(apiserver.pid, signal.SIGSTOP)
        time.sleep(2)
        _exits_on_sigterm(operator, within=20)
    finally:
        os.kill(apiserver.pid, signal.SIGCONT)
        operator.stop(signal.SIGKILL)


def test_the_operator_stops_on_sigterm_after_its_control_plane_is_stopped(own, tmp_path):
    operator = OperatorProcess(own, tmp_path / "operator.log")
    operator.start()
    try:
        _started_up(operator)
        own.stop()
        time.sleep(3)  # its watches and writes now fail and retry
        _exits_on_sigterm(operator, within=20)
    finally:
        operator.stop(signal.SIGKILL)
