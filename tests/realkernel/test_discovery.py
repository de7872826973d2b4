"""Discovery on a real kernel: `passthrough discover --all` says what the guest's own sysfs says."""

from __future__ import annotations

import json

import pytest

from e2e.guest.kernel import SERIES
from e2e.guest.machine import expected

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
