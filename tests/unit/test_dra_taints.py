"""Health the 1.37 way: an ill device stays in the ResourceSlice, tainted (NoSchedule; NoExecute
once it fell off the bus), one gone from the bus leaves it; the slice is written only when a
taint comes or goes, never again for the time the API server stamps on it; and a claim allocated
the device before it fell ill is not prepared until it recovers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from e2e.fakesysfs import gpu_node
from passthrough.dra import health as dra_health
from passthrough.dra import slice as dra_slice
from passthrough.dra.driver import Driver
from passthrough.dra.preparer import PrepareError
from passthrough.pci.discovery import discover
from passthrough.pci.health import Health
from passthrough.pci.pciids import PciIds
from tests.unit.test_dra import NODE, FakeSession
from tests.unit.test_dra_slices import offered as items

GPU, AUDIO, GROUP = "0000:3b:00.0", "0000:3b:00.1", 20


def test_each_hardware_problem_has_its_taint_and_a_device_gone_has_none(tmp_path):
    host = gpu_node(tmp_path)
    health = Health(host.sysfs, host.dev)
    assert dra_health.taint(health.hardware_problem(GPU, GROUP)) is None  # healthy
    host.write_attribute(AUDIO, "current_link_width", "0")
    assert dra_health.taint(health.hardware_problem(GPU, GROUP)) == ("passthrough.io/unhealthy", "LinkDown", "NoSchedule")
    (host.device_dir(AUDIO) / "config").write_bytes(b"\xff" * 64)
    assert dra_health.taint(health.hardware_problem(GPU, GROUP)) == ("passthrough.io/unhealthy", "FellOffBus", "NoExecute")
    host.remove_device(GPU)
    assert "vanished" in health.hardware_problem(GPU, GROUP) and dra_health.taint(health.hardware_problem(GPU, GROUP)) is None


def test_a_tainted_device_is_written_once_and_its_taint_keeps_the_time_the_api_server_stamped():
    [item] = items(1)
    ill = dataclasses.replace(item, taint=("passthrough.io/unhealthy", "LinkDown", "NoSchedule"))
    desired = dra_slice.spec("node-1", [ill])
    assert desired["devices"][0]["taints"] == [{"key": "passthrough.io/unhealthy", "value": "LinkDown", "effect": "NoSchedule"}]
    [body] = dra_slice.pool_bodies("node-1", "uid-1", [desired], [None])
    # What the API server keeps: the taint stamped with the time it was added.
    live = {**body, "spec": {**body["spec"], "devices": [
        {**body["spec"]["devices"][0], "taints": [{**body["spec"]["devices"][0]["taints"][0], "timeAdded": "2026-12-05T21:00:00Z"}]}]}}  # fmt: skip
    assert not dra_slice.changed(desired, live, "uid-1")
    # Healthy again: the taint goes, and that is a change.
    assert dra_slice.changed(dra_slice.spec("node-1", [item]), live, "uid-1")
    # Written again for another reason (a second device): the taint keeps its time.
    [other] = items(2)[1:]
    [again] = dra_slice.pool_bodies("node-1", "uid-1", [dra_slice.spec("node-1", [ill, other])], [live])
    taints = {d["name"]: d.get("taints") for d in again["spec"]["devices"]}
    assert taints[ill.name][0]["timeAdded"] == "2026-12-05T21:00:00Z" and taints[other.name] is None


def test_a_claim_allocated_a_device_that_fell_ill_is_not_prepared_until_it_recovers(tmp_path):
    host = gpu_node(tmp_path / "host")
    claim = {"metadata": {"name": "vm", "namespace": "team-a", "uid": "u-1"},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": dra_slice.DRIVER, "pool": NODE, "device": "pci-0000-3b-00-0"}]}}}}  # fmt: skip
    driver = Driver(FakeSession(claim), NODE, sysfs_root=host.sysfs, dev_root=host.dev, kubelet_dir=tmp_path / "kubelet",
                    cdi_dir=tmp_path / "cdi", pci_ids=PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11"))  # fmt: skip
    [gpu] = [d for d in discover(host.sysfs, host.proc, driver.pci_ids).devices if d.address == GPU]
    driver.preparer.inventory = dra_slice.by_name([dra_slice.Published(gpu, "npci", "team-a")])
    driver.health.unhealthy = {GPU: f"{AUDIO}'s PCIe link is down (current_link_width 0)"}
    with pytest.raises(PrepareError, match=r"pci-0000-3b-00-0 \(0000:3b:00.0\) is unhealthy: 0000:3b:00.1's PCIe link is down"):
        asyncio.run(driver.preparer.prepare("team-a", "vm", "u-1"))
    assert driver.preparer.prepared == {} and not (tmp_path / "cdi").exists()
