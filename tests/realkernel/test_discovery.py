"""Discovery on a real kernel: `passthrough discover --all` says what the guest's own sysfs says."""

from __future__ import annotations

import json

import pytest

from e2e.guest.kernel import DEFAULT_SERIES, SERIES, RigUnavailable, kernel
from e2e.guest.machine import TOPOLOGY, boot, expected
from tests.realkernel.conftest import _absent as absent

# Read in the guest, straight from its sysfs: what discovery must agree with.
READ_SYSFS = """
import os
root = '/sys/bus/pci/devices'
def attr(address, name):
    with open(f'{root}/{address}/{name}') as f:
        return f.read().strip()
def link(address, name):
    path = f'{root}/{address}/{name}'
    return os.path.basename(os.readlink(path)) if os.path.islink(path) else ''
result = {
    address: {
        'vendorID': attr(address, 'vendor')[2:],
        'deviceID': attr(address, 'device')[2:],
        'class': attr(address, 'class')[2:],
        'driver': link(address, 'driver'),
        'iommuGroup': int(link(address, 'iommu_group') or -1),
    }
    for address in sorted(os.listdir(root))
}
"""
FIELDS = ("vendorID", "deviceID", "class", "driver", "iommuGroup")


@pytest.mark.parametrize("series", list(SERIES))
def test_discovery_equals_sysfs(request, guests, series):
    guest = guests.get(request, series)
    run = guest.passthrough("discover", "--all", "--output", "json", timeout=240)
    found = json.loads(run.stdout)
    sysfs = guest.python(READ_SYSFS)

    assert found["node"] == {"iommuEnabled": True, "vfioAvailable": True}
    reported = {d["pciAddress"]: {f: d[f] for f in FIELDS} for d in found["devices"]}
    assert sorted(reported) == sorted(sysfs), "discovery --all lists other functions than sysfs has"
    assert reported == sysfs
    print(f"{guest.kernel.package}: discover --all took {run.seconds:.1f}s in the guest, {len(sysfs)} functions")


def test_rig_topology(guest):
    """The rig builds what its TOPOLOGY says: tests rely on these addresses, drivers and groups."""
    sysfs = guest.python(READ_SYSFS)
    groups: dict[str, set[int]] = {}
    for address, (slot, function) in expected().items():
        seen = sysfs.get(address)
        assert seen is not None, f"{address} ({slot}: {function.model}) is missing from the guest"
        assert (seen["vendorID"], seen["deviceID"], seen["class"], seen["driver"]) == (
            function.vendor_id, function.device_id, function.class_code, function.driver,
        ), address  # fmt: skip
        assert seen["iommuGroup"] >= 0, f"{address} has no IOMMU group"
        groups.setdefault(slot, set()).add(seen["iommuGroup"])
    # The functions of one slot share a group; each slot's group is its own.
    assert all(len(g) == 1 for g in groups.values()), groups
    assert len({next(iter(g)) for g in groups.values()}) == len(groups), groups
    members = {
        address for address, seen in sysfs.items() if seen["iommuGroup"] in {next(iter(g)) for g in groups.values()}
    }
    assert members == set(expected()), "a slot's IOMMU group holds a function from elsewhere"


def test_a_kernel_without_an_iommu_rules_every_device_out_with_what_to_do(request, tmp_path):
    """intel_iommu=off (the IOMMU in the machine, the kernel told not to use it): no IOMMU groups,
    and no device is eligible; each says why and what to do, and nothing crashes."""
    topology = tuple(s for s in TOPOLOGY if s.name in ("testdev", "gpu"))
    try:
        found_kernel = kernel(DEFAULT_SERIES)
    except RigUnavailable as exc:
        absent(request, str(exc))
    with boot(found_kernel, tmp_path / "guest", topology=topology, append="intel_iommu=off") as guest:
        assert guest.run("ls", "/sys/kernel/iommu_groups").stdout.strip() == ""
        run = guest.passthrough("discover", "--all", "--output", "json", timeout=240)
        found = json.loads(run.stdout)
        assert found["node"]["iommuEnabled"] is False
        devices = {d["pciAddress"]: d for d in found["devices"]}
        assert set(expected(topology)) <= set(devices), devices
        for address in expected(topology):
            device = devices[address]
            why, _, todo = device["reason"].partition("; ")
            assert device["eligible"] is False and "IOMMU is not enabled" in why, device
            assert "intel_iommu=on" in todo, device
            assert device["iommuGroup"] == -1, device
        # The drivers the kernel bound stay bound: discovery only reads.
        drivers = {a: guest.run("sh", "-c", f"basename $(readlink /sys/bus/pci/devices/{a}/driver) 2>/dev/null", check=False).stdout.strip()
                   for a in expected(topology)}  # fmt: skip
        assert drivers == {a: fn.driver for a, (_, fn) in expected(topology).items()}
