"""The binder runs vfio sequences in a child process under a deadline: a sysfs write that blocks
(as an unbind of a held device does on Linux) holds up that child, never the agent.

The blocking write here is real: the `unbind` file is a FIFO nobody reads, so the child's
open(2) blocks in the kernel until the test opens the other end, as the kernel's unbind
returns only once the device's holder lets go.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import pytest

from e2e.fakesysfs import FakeHost, gpu_node
from e2e.processes import children, start_binder
from passthrough.pci.binder import Binder, BinderAway
from passthrough.pci.vfio import BindError

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
OTHER_GPU, OTHER_AUDIO = "0000:af:00.0", "0000:af:00.1"


def block_unbind(host, driver: str):
    """Make `drivers/<driver>/unbind` a FIFO: a write to it blocks until someone reads."""
    path = host.sysfs / "bus" / "pci" / "drivers" / driver / "unbind"
    path.unlink()
    os.mkfifo(path)
    return path


def let_go(path) -> None:
    """The holder lets go: the blocked write returns."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    time.sleep(0.2)
    os.close(fd)


async def test_a_write_that_blocks_past_its_deadline_is_write_blocked_and_left_alone(tmp_path):
    host = gpu_node(tmp_path)
    fifo = block_unbind(host, "nvidia")
    finished = asyncio.Event()
    binder = Binder(deadline=1.5, on_finished=finished.set)
    try:
        started = time.monotonic()
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert e.value.reason == "WriteBlocked"
        assert "has not returned after 1.5 s" in str(e.value) and "IOMMU group 20" in str(e.value)
        assert time.monotonic() - started < 10  # the deadline, plus one child's start
        assert binder.overdue_addresses() == {GPU, AUDIO}
        # Asked again while the write is in flight: refused at once, nothing sent to a child.
        with pytest.raises(BindError) as again:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert again.value.reason == "WriteBlocked"
        # Another group is served by a fresh child meanwhile: an answer, not a wait (nothing of
        # group 21 is on vfio-pci, so nothing to give back).
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert not finished.is_set()
        await asyncio.to_thread(let_go, fifo)
        await asyncio.wait_for(finished.wait(), 10)
        assert binder.overdue == {}
    finally:
        await binder.close()


async def test_closing_does_not_wait_for_a_child_blocked_in_the_kernel(tmp_path):
    host = gpu_node(tmp_path)
    fifo = block_unbind(host, "nvidia")
    binder = Binder(deadline=1.0)
    with pytest.raises(BindError):
        await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
    started = time.monotonic()
    await binder.close()  # SIGTERM to the agent: it must exit although the write has not returned
    assert time.monotonic() - started < 3
    await asyncio.to_thread(let_go, fifo)  # the killed child dies once its write returns


async def test_a_job_whose_caller_went_stays_in_flight_until_its_write_returns(tmp_path):
    """A scan cancelled mid-job (its own deadline, SIGTERM) leaves the write in the child: the
    group counts as blocked (discovery must not read what waits for its device lock) until the
    child answers, and then asks for a scan like any late job."""
    host = gpu_node(tmp_path)
    fifo = block_unbind(host, "nvidia")
    finished = asyncio.Event()
    binder = Binder(deadline=30, on_finished=finished.set)
    try:
        job = asyncio.create_task(binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2))
        override = host.sysfs / "bus" / "pci" / "devices" / GPU / "driver_override"
        while override.read_text().strip() != "vfio-pci":
            await asyncio.sleep(0.05)  # the child's next write is the unbind, which blocks until let_go
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert binder.overdue_addresses() == {GPU, AUDIO}
        with pytest.raises(BindError) as again:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert again.value.reason == "WriteBlocked" and "was cancelled" in str(again.value)
        await asyncio.to_thread(let_go, fifo)
        await asyncio.wait_for(finished.wait(), 10)
        assert binder.overdue == {}
    finally:
        await binder.close()


async def test_a_child_that_dies_is_replaced_for_the_next_job(tmp_path):
    host = gpu_node(tmp_path)
    binder = Binder(deadline=5)
    try:
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, ["0000:ff:00.0"], timeout=0.2)
        assert e.value.reason == "DeviceGone"
        binder._worker.kill()
        await binder._worker.wait()
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, ["0000:ff:00.0"], timeout=0.2)
        assert e.value.reason == "DeviceGone"  # answered by a new child
    finally:
        await binder.close()


async def test_what_a_bind_that_returned_late_moved_is_kept_for_the_agents_record(tmp_path):
    """On Linux (tests/realkernel/test_busy.py) an unbind that blocked past the deadline finishes
    the bind once the holder lets go: those devices are the agent's to give back later."""
    from e2e.fakekernel import FakeKernel

    problem = FakeKernel.unavailable(tmp_path)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)
    finished = asyncio.Event()
    binder = Binder(deadline=1.0, on_finished=finished.set)
    with FakeKernel(gpu_node(tmp_path)) as kernel:
        host = kernel.host
        host.hold_device(AUDIO)  # an open sound device: snd_hda_intel's remove waits for it
        try:
            with pytest.raises(BindError) as e:
                await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=2)
            assert e.value.reason == "WriteBlocked"
            assert binder.take_late_moved() == {}
            host.release(AUDIO)
            await asyncio.wait_for(finished.wait(), 10)
            assert binder.take_late_moved() == {GPU: "", AUDIO: ""}
            assert binder.take_late_moved() == {}  # handed over once
        finally:
            host.release(AUDIO)
            await binder.close()


@pytest.fixture
def binder_container(tmp_path):
    """The binder container over the host at tmp_path/host."""
    proc = start_binder(tmp_path / "run" / "binder.sock", gpu_node(tmp_path / "host"))
    yield tmp_path / "run" / "binder.sock"
    proc.terminate()
    assert proc.wait(10) == 0  # at once, although one of its children may still be blocked in a write


async def test_through_a_binder_container_a_blocked_write_holds_up_only_its_own_connection(tmp_path, binder_container):
    host = FakeHost.existing(tmp_path / "host")  # the one the binder container works on
    fifo = block_unbind(host, "nvidia")
    finished = asyncio.Event()
    binder = Binder(deadline=1.5, on_finished=finished.set, sockets=[binder_container])
    try:
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert e.value.reason == "WriteBlocked" and binder.overdue_addresses() == {GPU, AUDIO}
        # A new connection, a new child of the binder: it answers while the first is blocked.
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        await asyncio.to_thread(let_go, fifo)
        await asyncio.wait_for(finished.wait(), 10)
        assert binder.overdue == {}
    finally:
        await binder.close()


async def test_a_binder_container_restarted_behind_a_blocked_write_takes_the_next_job(tmp_path):
    """The container stops (its child blocked in the write stays in the kernel) and starts again:
    the agent's next job goes to the new one, and the old write still counts until it returns."""
    host = gpu_node(tmp_path / "host")
    socket = tmp_path / "run" / "binder.sock"
    first, second = start_binder(socket, host), None
    fifo = block_unbind(host, "nvidia")
    finished = asyncio.Event()
    binder = Binder(deadline=1.5, on_finished=finished.set, sockets=[socket])
    try:
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert e.value.reason == "WriteBlocked"
        first.terminate()
        assert first.wait(10) == 0
        second = start_binder(socket, host)
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert binder.overdue_addresses() == {GPU, AUDIO}
        await asyncio.to_thread(let_go, fifo)
        await asyncio.wait_for(finished.wait(), 10)
        assert binder.overdue == {}
    finally:
        await binder.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def newest_child(pid: int) -> int:
    """The process `pid` forked last (the binder's child for the agent's newest connection)."""
    return max(children(pid), key=lambda c: int(open(f"/proc/{c}/stat").read().rsplit(")", 1)[1].split()[19]))


async def test_a_binder_container_killed_with_a_write_blocked_fails_jobs_one_by_one_until_it_is_back(tmp_path):
    """The container killed as a whole (its idle child for the agent's open connection too; the
    blocked one stays in the kernel): the next job fails as that job's own BindFailed, never as
    an error of the whole scan, and the job after the container is back goes to the new one."""
    host = gpu_node(tmp_path / "host")
    socket = tmp_path / "run" / "binder.sock"
    first, second = start_binder(socket, host), None
    fifo = block_unbind(host, "nvidia")
    binder = Binder(deadline=1.5, sockets=[socket])
    try:
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert e.value.reason == "WriteBlocked"
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        idle = newest_child(first.pid)
        first.kill()
        os.kill(idle, 9)
        first.wait(10)
        with pytest.raises(BindError) as e:
            await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2)
        assert e.value.reason == "BindFailed" and "binder container" in str(e.value), e.value
        # The blocked child must not keep the container's socket listening for nobody: the next
        # job is told at once that nobody answers, not left waiting for a greeting.
        with pytest.raises(BindError) as e:
            await asyncio.wait_for(binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2), 10)
        assert e.value.reason == "BindFailed" and f"no binder container answers: {socket} (" in str(e.value), e.value
        second = start_binder(socket, host)
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert binder.overdue_addresses() == {GPU, AUDIO}  # the old write still counts until it returns
    finally:
        await asyncio.to_thread(let_go, fifo)
        await binder.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def kill_container(proc, blocked: tuple[int, ...] = ()) -> None:
    """A binder container killed as a whole (a crash, an OOM kill), but for its children `blocked`
    in a write, which the kernel keeps."""
    idle = [c for c in children(proc.pid) if c not in blocked]
    proc.kill()
    for child in idle:
        os.kill(child, 9)
    proc.wait(10)


async def test_a_standby_binder_container_takes_the_jobs_while_the_first_is_killed_behind_a_blocked_write(tmp_path):
    """The chart's two binder containers: the first killed while a child of it is blocked cannot
    restart until the write returns (the runtime waits for that child); the standby takes the
    next jobs meanwhile, the first takes them again once it is back, and with both away the job
    says which sockets did not answer and why."""
    host = gpu_node(tmp_path / "host")
    first_socket, standby_socket = tmp_path / "run" / "binder.sock", tmp_path / "run" / "standby.sock"
    binder = Binder(deadline=1.5, sockets=[first_socket, standby_socket])
    first, standby, again = start_binder(first_socket, host), start_binder(standby_socket, host), None
    fifo = block_unbind(host, "nvidia")
    try:
        with pytest.raises(BindError) as e:
            await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
        assert e.value.reason == "WriteBlocked"
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert len(children(first.pid)) == 2 and children(standby.pid) == []  # the blocked child, the idle one: the first's
        kill_container(first, blocked=tuple(c for c in children(first.pid) if c != newest_child(first.pid)))
        # The job on the connection the kill ended is that job's BinderAway (asked again in 5 s).
        with pytest.raises(BinderAway) as e:
            await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2)
        assert f"connection on {first_socket} ended" in str(e.value), e.value
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert len(children(standby.pid)) == 1, "the job was not done by the standby"
        assert binder.overdue_addresses() == {GPU, AUDIO}  # the first's blocked write still counts
        # The first back (its write returned, the runtime restarts it): preferred again, and the
        # standby's child for the agent's connection is let go.
        again = start_binder(first_socket, host)
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        assert len(children(again.pid)) == 1, "the job did not go to the first again"
        while children(standby.pid):
            await asyncio.sleep(0.05)  # its connection closed: the child exits (else the test's timeout)
        # Both away: the job says each socket and why, and what to look at.
        kill_container(again)
        kill_container(standby)
        for _ in range(2):  # the first may be the job on the connection the kill ended
            with pytest.raises(BinderAway) as e:
                await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2)
        message = str(e.value)
        assert f"no binder container answers: {first_socket} (Connection refused); {standby_socket} (Connection refused)" in message, message
        assert "kubectl logs <agent pod> -c binder, -c binder-standby" in message
    finally:
        await asyncio.to_thread(let_go, fifo)
        await binder.close()
        for proc in (first, standby, again):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(10)


async def test_a_binder_container_that_takes_connections_and_never_greets_is_tried_last(tmp_path):
    """A binder container that accepts but does not answer (stopped, starved) costs one job its
    greeting's wait, not every job: the standby takes the jobs without asking it again."""
    import socket as sockets

    host = gpu_node(tmp_path / "host")
    silent_socket, standby_socket = tmp_path / "run" / "binder.sock", tmp_path / "run" / "standby.sock"
    binder = Binder(deadline=1.0, sockets=[silent_socket, standby_socket])
    standby = start_binder(standby_socket, host)
    silent = sockets.socket(sockets.AF_UNIX)
    silent.bind(str(silent_socket))
    silent.listen(8)
    try:
        for _ in range(3):
            assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        binder._worker.kill()  # the standby's connection ends: the next job connects anew
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
        silent.setblocking(False)
        accepted = []
        with contextlib.suppress(BlockingIOError):
            while True:
                accepted.append(silent.accept()[0])
        assert len(accepted) == 1, f"the silent binder was asked {len(accepted)} times"
    finally:
        await binder.close()
        silent.close()
        standby.terminate()
        standby.wait(10)


async def test_a_binder_container_that_is_not_there_is_said_with_what_to_look_at(tmp_path):
    host = gpu_node(tmp_path / "host")
    binder = Binder(sockets=[tmp_path / "nobody.sock"])
    with pytest.raises(BindError) as e:
        await binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2)
    assert e.value.reason == "BindFailed" and "kubectl logs <agent pod> -c binder" in str(e.value)


async def test_a_job_whose_caller_is_cancelled_leaves_no_stray_answer_nor_unretrieved_error(tmp_path):
    # SIGTERM cancels a scan waiting on the binder: its child goes aside (a later job must not
    # read the old job's answer), and its end, answer or death, is collected, never logged as
    # "Task exception was never retrieved".
    import gc

    host = gpu_node(tmp_path)
    fifo = block_unbind(host, "nvidia")
    loop = asyncio.get_running_loop()
    unretrieved = []
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    binder = Binder(deadline=30)
    try:
        job = asyncio.create_task(binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2))
        await asyncio.sleep(2)  # the child is blocked in its write
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        # The next job goes to a fresh child and gets its own answer.
        assert await binder.release(host.sysfs, host.dev, 21, [OTHER_GPU, OTHER_AUDIO], timeout=0.2) == 0
    finally:
        await binder.close()  # kills the set-aside child: its pending answer ends in an error
        await asyncio.to_thread(let_go, fifo)
        await asyncio.sleep(0.5)
        gc.collect()
        await asyncio.sleep(0.1)
        loop.set_exception_handler(None)
    assert unretrieved == []


async def test_a_cancellation_that_comes_with_the_childs_death_is_not_lost(tmp_path):
    # SIGTERM goes to the agent's process group: the child dies of it and the agent cancels its
    # scan, within a few turns of the loop of each other. The cancellation must win, whichever
    # turn it comes in. When it was lost, the scan took the child's death for its answer and
    # went on, and the agent never exited (seen in CI: asyncio.wait_for on Python 3.11).
    host = gpu_node(tmp_path)
    deaths: list[asyncio.Future] = []
    children = []

    class Dying(Binder):
        async def _answer(self, worker):
            if worker is not self._worker:  # the child's hello
                children.append(worker)
                return await super()._answer(worker)
            deaths.append(asyncio.get_running_loop().create_future())
            return await deaths[-1]  # the job's answer: the test decides when the child dies

    binder = Dying(deadline=30)
    outcomes = []
    try:
        for turns in range(8):
            job = asyncio.create_task(binder.bind(host.sysfs, host.dev, 20, [GPU, AUDIO], timeout=0.2))
            while len(deaths) <= turns:  # a fresh child started and took the job
                await asyncio.sleep(0.01)
            deaths[-1].set_exception(BindError("BindFailed", "the binder process exited (code -15) before it answered"))
            for _ in range(turns):
                await asyncio.sleep(0)
            if not job.cancel():
                outcomes.append("over before the cancellation")  # the scan's next await gets it
                continue
            try:
                await job
                outcomes.append("lost the cancellation")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
            except BindError:
                outcomes.append("lost the cancellation, went on with the death for its answer")
    finally:
        await binder.close()  # kills the children, which (unlike one blocked in a write) die at once
        for child in children:
            await child.wait()
    assert "cancelled" in outcomes and "over before the cancellation" in outcomes, outcomes  # both sides of the race
    assert set(outcomes) == {"cancelled", "over before the cancellation"}, outcomes
