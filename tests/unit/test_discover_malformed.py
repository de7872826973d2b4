"""A malformed sysfs entry never stops discovery: the device is listed as ineligible with the
file and the problem named, and every other device is judged as usual."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.fakesysfs import FakeHost, gpu_node, storage_node
from passthrough.pci.discovery import Device, Discovery, discover
from passthrough.pci.pciids import PciIds

DB = PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11")
BAD, GOOD = "0000:3b:00.0", "0000:af:00.0"


def scan(host: FakeHost) -> tuple[Discovery, dict[str, Device]]:
    found = discover(host.sysfs, host.proc, DB)
    return found, {d.address: d for d in found.devices}


def assert_others_unharmed(devices: dict[str, Device]) -> None:
    assert devices[GOOD].eligible and devices[GOOD].resource_name == "nvidia.com/GA102GL_A10"
    assert devices["0000:af:00.1"].eligible


@pytest.mark.parametrize("content", ["garbage\n", "0x10d\n", "", "0x10de 0x10de\n"])
def test_a_garbled_vendor_file_is_named_and_hides_no_other_device(tmp_path, content):
    host = gpu_node(tmp_path)
    host.write_attribute(BAD, "vendor", content)
    found, devices = scan(host)
    bad = devices[BAD]
    assert not bad.eligible and not bad.reported and bad.vendor_id == ""
    assert f"{BAD}/vendor" in bad.reason
    assert any(f"{BAD}/vendor" in p for p in found.problems)
    # Its IOMMU group is held back with it; the other card is not.
    assert not devices["0000:3b:00.1"].eligible and BAD in devices["0000:3b:00.1"].reason
    assert_others_unharmed(devices)


def test_binary_garbage_in_an_id_file_does_not_raise(tmp_path):
    host = gpu_node(tmp_path)
    (host.device_dir(BAD) / "device").write_bytes(b"\xff\xfe\x00\x81garbage")
    _, devices = scan(host)
    assert not devices[BAD].eligible and f"{BAD}/device" in devices[BAD].reason
    assert_others_unharmed(devices)


def test_an_unreadable_class_file_is_named(tmp_path):
    host = gpu_node(tmp_path)
    host.remove_attribute(BAD, "class")
    (host.device_dir(BAD) / "class").mkdir()
    _, devices = scan(host)
    assert "class is unreadable" in devices[BAD].reason
    assert_others_unharmed(devices)


@pytest.mark.parametrize(("link", "field"), [("driver", "driver"), ("iommu_group", "iommu_group")])
def test_a_dangling_link_is_named_and_the_device_still_reported(tmp_path, link, field):
    host = gpu_node(tmp_path)
    host.break_link(BAD, link)
    found, devices = scan(host)
    bad = devices[BAD]
    assert bad.reported and not bad.eligible
    assert f"{BAD}/{link}" in bad.reason and "does not exist" in bad.reason
    assert bad.vendor_id == "10de" and bad.name == "GA102GL [A10]"
    assert any(f"{BAD}/{link}" in p for p in found.problems)
    assert_others_unharmed(devices)


def test_a_non_numeric_numa_node_is_named(tmp_path):
    host = gpu_node(tmp_path)
    host.write_attribute(BAD, "numa_node", "zero\n")
    _, devices = scan(host)
    assert devices[BAD].numa_node == -1 and not devices[BAD].eligible
    assert f"{BAD}/numa_node" in devices[BAD].reason and "'zero'" in devices[BAD].reason
    assert_others_unharmed(devices)


def test_no_numa_node_file_is_a_kernel_without_numa_not_a_problem(tmp_path):
    host = gpu_node(tmp_path)
    host.remove_attribute(BAD, "numa_node")
    found, devices = scan(host)
    assert devices[BAD].numa_node == -1 and devices[BAD].eligible and found.problems == ()


def test_a_dangling_bus_entry_is_listed_by_its_address(tmp_path):
    host = gpu_node(tmp_path)
    shutil.rmtree(host.device_dir(BAD))  # the device's directory went, its link did not
    found, devices = scan(host)
    assert not devices[BAD].eligible and not devices[BAD].reported
    assert any(BAD in p for p in found.problems)
    assert devices[GOOD].eligible


def test_an_entry_not_named_like_an_address_is_ignored_with_a_problem(tmp_path):
    host = gpu_node(tmp_path)
    (host.sysfs / "bus" / "pci" / "devices" / "junk").symlink_to("../../../devices/pci0000:00")
    found, devices = scan(host)
    assert "junk" not in devices and any("junk" in p for p in found.problems)
    assert_others_unharmed(devices)


def test_unreadable_mounts_make_block_devices_unknown_not_free(tmp_path):
    host = storage_node(tmp_path)
    (host.proc / "mounts").unlink()
    found, devices = scan(host)
    assert not devices["0000:3d:00.0"].eligible and "cannot be told" in devices["0000:3d:00.0"].reason
    assert devices["0000:18:00.1"].eligible
    assert any("mounts" in p for p in found.problems)


ATTRIBUTES = ["vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(ATTRIBUTES), st.binary(max_size=24))
def test_any_bytes_in_any_attribute_never_raise_or_hide_the_other_card(tmp_path_factory, attribute, content):
    host = gpu_node(tmp_path_factory.mktemp("host"))
    (host.device_dir(BAD) / attribute).write_bytes(content)
    _, devices = scan(host)
    assert BAD in devices
    assert_others_unharmed(devices)
