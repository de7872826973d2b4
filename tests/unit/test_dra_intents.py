"""DRA mode keeps what it moved to vfio-pci across a restart, as the device plugins do: each bind
of an IOMMU group is recorded as intended before the job (`agent.bound.Bound`, in the plugin
directory) and settled from the driver links at the next pass, so a bind whose answer was lost
(the agent restarted while the write was blocked, and the binder finished it for nobody) is
still the driver's to give back. The binder itself is another test's (tests/unit/test_binder.py,
tests/realkernel/test_binder_restart.py); here it is the kernel's side of one job: the members
moved, the answer never heard."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from e2e.fakesysfs import gpu_node
from passthrough.dra import slice as dra_slice
from passthrough.dra.driver import DRIVER, Driver
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds
from tests.unit.test_dra import NODE

GPU, AUDIO, GROUP = "0000:3b:00.0", "0000:3b:00.1", 20
PCI_IDS = Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11"


def _driver(host, tmp_path: Path) -> Driver:
    made = Driver(object(), NODE, sysfs_root=host.sysfs, proc_root=host.proc, dev_root=host.dev,
                  kubelet_dir=tmp_path / "kubelet", cdi_dir=tmp_path / "cdi", pci_ids=PciIds.load(PCI_IDS))  # fmt: skip
    made.preparer.discovery = discover(host.sysfs, host.proc, made.pci_ids)
    return made


def _drivers(host) -> dict[str, str]:
    return {a: (host.device_dir(a) / "driver").resolve().name for a in (GPU, AUDIO)}


def test_a_bind_whose_answer_was_lost_is_given_back_by_the_driver_that_starts_next(tmp_path):
    host = gpu_node(tmp_path / "host")
    before = _drivers(host)
    assert before[GPU] != "vfio-pci" and before[AUDIO] != "vfio-pci"
    first = _driver(host, tmp_path)

    async def answer_lost(sysfs_root, dev_root, group, members, timeout):
        for address in members:
            host.bind(address, "vfio-pci")  # the kernel moved them ...
        raise asyncio.CancelledError  # ... and the agent stopped before the answer came

    first.binder.bind = answer_lost
    [gpu] = [d for d in first.preparer.discovery.devices if d.address == GPU]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(first.preparer.bind_groups([dra_slice.Published(gpu, "npci", "team-a")]))
    assert first.preparer.bound.devices == {}  # no answer: nothing known as moved
    state = tmp_path / "kubelet" / "plugins" / DRIVER
    assert json.loads((state / "binding.json").read_text()) == {GPU: "", AUDIO: ""}  # the intent, written first

    restarted = _driver(host, tmp_path)
    released = []

    async def release(sysfs_root, dev_root, group, members, timeout, overrides):
        released.append((group, sorted(members), overrides))
        for address in members:
            host.bind(address, before[address])

    restarted.binder.release = release
    asyncio.run(restarted.preparer.give_back([]))  # nothing published needs the group, no claim holds it
    assert released == [(GROUP, [GPU, AUDIO], {GPU: "", AUDIO: ""})]
    assert _drivers(host) == before
    assert restarted.preparer.bound.devices == {} and restarted.preparer.bound.intended == {}


def test_a_group_an_admin_pinned_to_vfio_pci_is_never_taken_for_the_drivers_own(tmp_path):
    host = gpu_node(tmp_path / "host")
    host.bind(GPU, "vfio-pci")
    host.bind(AUDIO, "vfio-pci")  # driverctl, vfio-pci.ids=: it looks as a bind of ours does
    first = _driver(host, tmp_path)

    async def answer_lost(sysfs_root, dev_root, group, members, timeout):
        raise asyncio.CancelledError

    first.binder.bind = answer_lost
    [gpu] = [d for d in first.preparer.discovery.devices if d.address == GPU]
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(first.preparer.bind_groups([dra_slice.Published(gpu, "npci", "team-a")]))
    restarted = _driver(host, tmp_path)
    released = []

    async def release(*args):
        released.append(args)

    restarted.binder.release = release
    asyncio.run(restarted.preparer.give_back([]))
    assert released == [] and _drivers(host) == {GPU: "vfio-pci", AUDIO: "vfio-pci"}
