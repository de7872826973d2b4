"""A served device's health is read off the event loop: a config-space read that waits (the
kernel holds config access during a reset, as vfio-pci's does) stops nothing else.

Here the device's `config` is a FIFO, whose open waits until a writer comes, as the kernel's
read waits for the reset's end. The agent's event loop runs in a thread of its own, so that a
loop stuck in the read shows as a loop that does not answer rather than as a test that hangs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

from e2e.fakesysfs import gpu_node
from passthrough.agent.handover import Handover
from passthrough.agent.plan import Served
from passthrough.pci.health import Health

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
GROUP = 20
RESOURCE = "nvidia.com/GA102GL_A10"


def _host(tmp_path):
    host = gpu_node(tmp_path / "host")
    for address in (GPU, AUDIO):
        host.bind(address, "vfio-pci")
    return host


def _block_config(host, address: str):
    config = host.device_dir(address) / "config"
    config.unlink(missing_ok=True)
    os.mkfifo(config)
    return config


def _let_go(config) -> None:
    """End the wait of the read in flight; the reads after it read a config space again."""
    with contextlib.suppress(OSError):  # ENXIO: no read waits
        fd = os.open(config, os.O_WRONLY | os.O_NONBLOCK)  # a reader waits: this open ends its wait
        os.close(fd)
    config.unlink()
    config.write_bytes(b"\xde\x10\xef\x1a" + bytes(60))


def test_a_config_read_that_waits_stops_neither_serving_nor_the_loop(tmp_path):
    host = _host(tmp_path)
    config = _block_config(host, AUDIO)
    handover = Handover(host.sysfs, host.dev, plugin_dir=tmp_path / "plugins", state_dir=tmp_path / "state")
    ticks: list[float] = []
    served = threading.Event()
    seen: list[bool] = []

    async def agent() -> None:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        await handover.serve({RESOURCE: (Served(GPU, GROUP, -1),)})
        seen.append(handover.plugins.plugin(RESOURCE).devices[GPU].healthy)
        served.set()
        await asyncio.sleep(0.5)
        ticker.cancel()
        await handover.close()

    loop = threading.Thread(target=asyncio.run, args=(agent(),), daemon=True)
    loop.start()
    try:
        assert served.wait(5), "serve() waited on the config-space read"
        loop.join(5)
        assert not loop.is_alive(), "the event loop waited on the config-space read"
    finally:
        _let_go(config)
        loop.join(5)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert gaps and max(gaps) < 0.4, f"the loop stood still for {max(gaps, default=0):.2f} s"
    assert seen == [True]  # no word from its config space yet, and none before: not judged ill for a moment


async def test_a_device_whose_config_space_does_not_answer_is_unhealthy_after_the_deadline(tmp_path):
    host = _host(tmp_path)
    config = _block_config(host, AUDIO)
    health = Health(host.sysfs, host.dev)
    try:
        assert await health.problems({GPU: GROUP}, deadline=1.0) == {GPU: ""}  # a reset's moment: its last word
        await asyncio.sleep(0.6)
        found = (await health.problems({GPU: GROUP}, deadline=1.0))[GPU]
        assert "config space has not answered" in found, found
        assert sum(t.name == f"health {GPU} _config_part" for t in threading.enumerate()) == 1  # never a second one
    finally:
        _let_go(config)
    # The read returns: what it says from then on.
    for _ in range(20):
        found = (await health.problems({GPU: GROUP}, deadline=0.3))[GPU]
        if "has not answered" not in found:
            break
    assert found == "", found


async def test_two_polls_at_once_share_the_reads_in_flight(tmp_path):
    host = _host(tmp_path)
    health = Health(host.sysfs, host.dev)
    first, second = await asyncio.gather(health.problems({GPU: GROUP}), health.problems({GPU: GROUP, AUDIO: GROUP}))
    assert first == {GPU: ""} and second == {GPU: "", AUDIO: ""}


def test_a_fatal_error_counted_at_its_root_port_makes_the_devices_below_it_unhealthy(tmp_path):
    # The kernel reads no endpoint's own status after a fatal error ("type=Inaccessible"): only
    # the root port's counter rises, and the link below it is reset.
    host = _host(tmp_path)
    port = host.device_dir(GPU).parent / "aer_rootport_total_err_fatal"
    port.write_text("0\n")
    health = Health(host.sysfs, host.dev)
    assert health.problem(GPU, GROUP) == ""
    port.write_text("1\n")
    found = health.problem(GPU, GROUP)
    assert "1 new fatal AER error(s) at its root port 0000:00:03.0" in found, found


async def test_an_aer_error_shows_while_its_config_reads_wait(tmp_path, monkeypatch):
    # A fatal error comes with a link reset, which holds config access: the counters are read apart.
    host = _host(tmp_path)
    port = host.device_dir(GPU).parent / "aer_rootport_total_err_fatal"
    port.write_text("0\n")
    health = Health(host.sysfs, host.dev)
    assert await health.problems({GPU: GROUP}) == {GPU: ""}
    config = _block_config(host, AUDIO)
    try:
        port.write_text("1\n")
        monkeypatch.setattr("passthrough.pci.health.POLL_WAIT", 60.0)  # were the config read waited for
        started = time.monotonic()
        found = (await health.problems({GPU: GROUP}))[GPU]
        assert "new fatal AER error(s) at its root port" in found, found
        # The config read that waits is not waited for once the counters have spoken.
        assert time.monotonic() - started < 30
    finally:
        _let_go(config)
