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


def test_unreadable_mountinfo_makes_block_devices_unknown_not_free(tmp_path):
    host = storage_node(tmp_path)
    (host.proc / "self" / "mountinfo").unlink()
    found, devices = scan(host)
    nvme = devices["0000:3d:00.0"]
    assert not nvme.eligible and nvme.reported
    assert nvme.reason.startswith("whether block device nvme0n1 is in use cannot be told (")
    assert "self/mountinfo is unreadable" in nvme.reason and "/host/proc" in nvme.reason
    assert devices["0000:18:00.1"].eligible  # no disks, nothing to tell
    assert any("mountinfo" in p for p in found.problems)


ATTRIBUTES = ["vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(ATTRIBUTES), st.binary(max_size=24))
def test_any_bytes_in_any_attribute_never_raise_or_hide_the_other_card(tmp_path_factory, attribute, content):
    host = gpu_node(tmp_path_factory.mktemp("host"))
    (host.device_dir(BAD) / attribute).write_bytes(content)
    _, devices = scan(host)
    assert BAD in devices
    assert_others_unharmed(devices)


def test_a_garbled_mountinfo_line_makes_block_devices_unknown(tmp_path):
    host = storage_node(tmp_path)
    with (host.proc / "self" / "mountinfo").open("a") as f:
        f.write("36 25 259:1 / /data rw,relatime\n")  # cut short: no "-" and no fstype
    nvme = scan(host)[1]["0000:3d:00.0"]
    assert not nvme.eligible and "is not a mountinfo line" in nvme.reason


@pytest.mark.parametrize("content", ["", "259\n", "nvme0n1p1\n", "259:1:0\n"])
def test_a_garbled_dev_file_makes_the_drive_unknown_not_free(tmp_path, content):
    host = storage_node(tmp_path)
    (host.sysfs / "class" / "block" / "nvme0n1p1" / "dev").write_text(content)
    nvme = scan(host)[1]["0000:3d:00.0"]
    assert not nvme.eligible and nvme.reported
    assert nvme.reason.startswith("whether block device nvme0n1p1 is in use cannot be told (")
    assert "nvme0n1p1/dev holds" in nvme.reason and "not a device number like 259:1" in nvme.reason


def test_a_garbled_dev_file_of_a_holder_makes_the_drive_unknown(tmp_path):
    host = storage_node(tmp_path)
    host.hold("nvme0n1p2", "dm-0", name="vg0-data")
    (host.sysfs / "class" / "block" / "dm-0" / "dev").unlink()
    nvme = scan(host)[1]["0000:3d:00.0"]
    assert nvme.reason.startswith("whether block device nvme0n1p2 → dm-0 (vg0-data) is in use cannot be told (")


def test_unreadable_holders_make_the_drive_unknown(tmp_path):
    host = storage_node(tmp_path)
    holders = host.sysfs / "class" / "block" / "nvme0n1p2" / "holders"
    holders.rmdir()
    holders.write_text("")  # not a directory: cannot be listed
    nvme = scan(host)[1]["0000:3d:00.0"]
    assert not nvme.eligible and "nvme0n1p2/holders cannot be listed" in nvme.reason


def test_a_loop_of_holders_ends_and_the_drive_is_not_offered(tmp_path):
    host = storage_node(tmp_path)
    host.hold("nvme0n1p2", "dm-0")
    host.hold("dm-0", "dm-1")
    host.hold("dm-1", "dm-0")  # no kernel builds this
    found, devices = scan(host)
    nvme = devices["0000:3d:00.0"]
    assert not nvme.eligible
    assert nvme.reason.startswith("whether block device nvme0n1p2 → dm-0 → dm-1 is in use cannot be told: "
                                  "its holders loop back to dm-0")  # fmt: skip
    assert_others_unharmed(scan(gpu_node(tmp_path / "other"))[1])


def test_a_swap_that_names_no_block_device_makes_disks_unknown(tmp_path):
    host = storage_node(tmp_path)
    host.swapon("nvme0n1p2", path="/dev/disk/by-partlabel/swap")
    nvme = scan(host)[1]["0000:3d:00.0"]
    assert not nvme.eligible and "names no block device" in nvme.reason
    assert "swapoff /dev/disk/by-partlabel/swap" in nvme.reason


def test_a_swap_file_is_no_disk_of_its_own(tmp_path):
    host = storage_node(tmp_path)
    with (host.proc / "swaps").open("a") as f:
        f.write("/swapfile                               file\t\t2097148\t\t0\t\t-2\n")
    assert scan(host)[1]["0000:3d:00.0"].eligible


def test_a_class_block_that_cannot_be_listed_keeps_storage_controllers_back(tmp_path):
    host = storage_node(tmp_path)
    shutil.rmtree(host.sysfs / "class" / "block")
    (host.sysfs / "class" / "block").write_text("")
    found, devices = scan(host)
    nvme = devices["0000:3d:00.0"]
    assert nvme.reason.startswith("whether any of its disks is in use cannot be told (")
    assert "class/block cannot be listed" in nvme.reason
    assert devices["0000:18:00.1"].eligible
    assert sum("class/block" in p for p in found.problems) == 1
