"""The DRA driver's health reports to the kubelet (KEP-4680): which devices they name, what they
say of each, that the driver's hardware reading of a fixture node reaches them, and how its
stream sends them (at once, on a change, again before the kubelet's timeout, and ends at shutdown).
The real kubelet reading them: tests/integration/test_dra_health.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import pytest

from e2e import fakesysfs
from passthrough.dra import health as dra_health
from passthrough.dra import slice as dra_slice
from passthrough.dra.driver import SERVICES, Driver
from passthrough.dra.prepared import PreparedClaim
from passthrough.dra.kubeletapi.drahealth_v1 import api_pb2 as health
from passthrough.pci.pciids import PciIds

NODE = "gpu-1"
GPU, AUDIO, GROUP = "0000:af:00.0", "0000:af:00.1", 21  # e2e.fakesysfs.gpu_node's second A10 and its IOMMU group
OTHER_GPU, OTHER_GROUP = "0000:3b:00.0", 20


def _prepared(address: str, group: int, pool: str = NODE) -> dict:
    return {"request": "gpu", "pool": pool, "name": dra_slice.device_name(address), "address": address, "iommu_group": group}


def _said(response: health.NodeWatchResourcesResponse) -> dict[str, tuple[str, str, str]]:
    return {d.device.device_name: (d.device.pool_name, health.HealthStatus.Name(d.health), d.message) for d in response.devices}


def test_registration_lists_the_health_service_the_kubelet_prefers():
    # The kubelet streams health only from a plugin whose registration lists the service, and
    # picks v1 before v1alpha1.
    assert dra_health.SERVICE == "v1.DRAResourceHealth"
    assert SERVICES == ("v1.DRAPlugin", "v1.DRAResourceHealth")


def test_the_kubelet_hears_of_offered_withdrawn_and_held_devices_by_their_slice_names():
    candidates = {GPU: GROUP}  # offered, or withdrawn for its health: the pass would publish it
    prepared = [_prepared(GPU, GROUP), _prepared(OTHER_GPU, OTHER_GROUP), _prepared("0000:01:00.0", 3, pool="another-node")]
    assert dra_health.watched(candidates, prepared, NODE) == {
        "pci-0000-af-00-0": (GPU, GROUP),
        "pci-0000-3b-00-0": (OTHER_GPU, OTHER_GROUP),  # held by a claim, no longer offered: still in a pod
    }
    assert dra_health.watched({}, [{"pool": NODE}], NODE) == {}  # a checkpoint entry without a device names nothing


def test_a_report_names_every_device_healthy_or_unhealthy_with_why():
    problems = {"pci-0000-af-00-0": "", "pci-0000-3b-00-0": "0000:3b:00.0's PCIe link is down"}
    report = dra_health.response(NODE, problems, 1_700_000_000.7)
    assert _said(report) == {
        "pci-0000-af-00-0": (NODE, "HEALTHY", ""),
        "pci-0000-3b-00-0": (NODE, "UNHEALTHY", "0000:3b:00.0's PCIe link is down"),
    }
    assert {(d.last_updated_time, d.health_check_timeout_seconds) for d in report.devices} == {(1_700_000_000, dra_health.TIMEOUT)}
    assert dra_health.RESEND * 2 < dra_health.TIMEOUT  # a report lost or late still leaves one in time
    assert list(dra_health.response(NODE, {}, 0).devices) == []  # nothing to speak for: an empty, whole list


def test_a_long_reason_is_cut_where_the_kubelet_would():
    [device] = dra_health.response(NODE, {"pci-0000-af-00-0": "x" * 2000}, 0).devices
    assert len(device.message) == dra_health.MESSAGE_MAX and device.message.endswith("...")


@pytest.fixture
def driver(tmp_path):
    host = fakesysfs.gpu_node(tmp_path / "host")
    pci_ids = PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11")
    made = Driver(None, NODE, sysfs_root=host.sysfs, proc_root=host.proc, dev_root=host.dev, pci_ids=pci_ids,
                  kubelet_dir=tmp_path / "kubelet", cdi_dir=tmp_path / "cdi")  # fmt: skip
    return host, made


def _judge(drv) -> bool:
    """One health read of the driver's candidates and prepared devices, as its watch makes every half second."""
    return asyncio.run(drv.health.judge(drv._candidates, drv.preparer.prepared_devices()))


def test_a_group_member_losing_its_link_makes_the_device_unhealthy_and_withdrawn_until_it_recovers(driver):
    host, drv = driver
    drv._candidates = {GPU: GROUP}
    _judge(drv)
    assert drv.health.device_health == {"pci-0000-af-00-0": ""} and drv.health.unhealthy == {}
    host.write_attribute(AUDIO, "current_link_width", "0")
    assert _judge(drv)  # the slice must change
    why = f"{AUDIO}'s PCIe link is down (current_link_width 0)"
    assert drv.health.device_health == {"pci-0000-af-00-0": why} and drv.health.unhealthy == {GPU: why}
    host.write_attribute(AUDIO, "current_link_width", "16")
    assert _judge(drv)
    assert drv.health.device_health == {"pci-0000-af-00-0": ""} and drv.health.unhealthy == {}


def test_a_held_device_no_longer_offered_is_reported_as_its_hardware_is_not_withdrawn(driver):
    host, drv = driver
    drv.preparer.prepared = {"u-1": PreparedClaim("team-a", "kept", devices=[_prepared(GPU, GROUP)])}
    host.write_attribute(AUDIO, "current_link_width", "0")
    assert not _judge(drv)  # not in the slice: nothing to withdraw
    assert drv.health.device_health == {"pci-0000-af-00-0": f"{AUDIO}'s PCIe link is down (current_link_width 0)"}


async def _next(stream, timeout: float = 2.0):
    return await asyncio.wait_for(anext(stream), timeout)


async def test_the_stream_reports_at_once_on_each_change_again_before_the_timeout_and_ends_at_shutdown(driver, monkeypatch):
    _, drv = driver
    monkeypatch.setattr(dra_health, "RESEND", 0.2)
    drv.health.report({"pci-0000-af-00-0": ""})
    stream = drv.NodeWatchResources(health.NodeWatchResourcesRequest(), None)
    assert _said(await _next(stream)) == {"pci-0000-af-00-0": (NODE, "HEALTHY", "")}
    drv.health.report({"pci-0000-af-00-0": "ill"})
    assert _said(await _next(stream, timeout=0.1)) == {"pci-0000-af-00-0": (NODE, "UNHEALTHY", "ill")}  # not the resend
    assert _said(await _next(stream)) == {"pci-0000-af-00-0": (NODE, "UNHEALTHY", "ill")}  # nothing new: said again
    drv.health.closing.set()
    with pytest.raises(StopAsyncIteration):
        await _next(stream)


def test_a_config_read_that_waits_does_not_stop_the_drivers_loop(driver):
    # The kernel holds a device's config access through a reset (vfio-pci resets a device as a VM
    # starts): here the group member's `config` is a FIFO, whose open waits as such a read does.
    # The driver's event loop runs in a thread of its own, so a loop stuck in the read shows as a
    # loop that stands still rather than as a test that hangs.
    host, drv = driver
    drv._candidates = {GPU: GROUP}
    config = host.device_dir(AUDIO) / "config"
    config.unlink(missing_ok=True)
    os.mkfifo(config)
    ticks: list[float] = []
    watching: list[bool] = []

    async def loop() -> None:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        watch = asyncio.create_task(drv._watch_health())
        await asyncio.sleep(1.5)
        watching.append(not watch.done())
        watch.cancel()
        ticker.cancel()

    runner = threading.Thread(target=asyncio.run, args=(loop(),), daemon=True)
    runner.start()
    try:
        runner.join(5)
        assert not runner.is_alive(), "the driver's event loop waited on the config-space read"
    finally:
        with contextlib.suppress(OSError):  # ENXIO: no read waits
            os.close(os.open(config, os.O_WRONLY | os.O_NONBLOCK))  # a reader waits: this ends its wait
        runner.join(5)
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert gaps and max(gaps) < 0.4, f"the loop stood still for {max(gaps, default=0):.2f} s"
    assert watching == [True]
