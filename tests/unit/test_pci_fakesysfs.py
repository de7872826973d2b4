"""The fixture hosts keep the kernel's layout, so code tested on them reads a real /sys alike."""

from __future__ import annotations

import os
from pathlib import Path

from e2e.fakesysfs import gpu_node, storage_node, synthetic_host


def is_relative_link_into(link: Path, folder: Path) -> bool:
    return link.is_symlink() and not os.readlink(link).startswith("/") and folder in link.resolve().parents


def test_bus_entries_driver_and_group_links_are_relative_and_resolve_into_the_tree(tmp_path):
    host = gpu_node(tmp_path)
    devices = host.sysfs / "devices"
    entry = host.sysfs / "bus" / "pci" / "devices" / "0000:3b:00.0"
    assert is_relative_link_into(entry, devices)
    # Behind its root port, as lspci -t would draw it.
    assert entry.resolve() == (devices / "pci0000:00" / "0000:00:03.0" / "0000:3b:00.0").resolve()
    assert is_relative_link_into(entry / "driver", host.sysfs / "bus" / "pci" / "drivers")
    assert os.path.basename(os.readlink(entry / "driver")) == "nvidia"
    assert os.path.basename(os.readlink(entry / "iommu_group")) == "20"
    group = host.sysfs / "kernel" / "iommu_groups" / "20" / "devices"
    assert sorted(os.listdir(group)) == ["0000:3b:00.0", "0000:3b:00.1"]
    assert (group / "0000:3b:00.0").resolve() == entry.resolve()
    assert (entry / "vendor").read_text() == "0x10de\n" and (entry / "numa_node").read_text() == "0\n"


def test_net_and_block_are_reached_through_their_class_links(tmp_path):
    host = storage_node(tmp_path)
    nic = host.device_dir("0000:18:00.0")
    assert (host.sysfs / "class" / "net" / "eth0").resolve() == (nic / "net" / "eth0").resolve()
    assert (host.sysfs / "class" / "net" / "eth0" / "flags").read_text() == "0x1003\n"
    nvme = host.device_dir("0000:3d:00.0")
    disk = (host.sysfs / "class" / "block" / "nvme0n1").resolve()
    part = (host.sysfs / "class" / "block" / "nvme0n1p2").resolve()
    assert disk == (nvme / "nvme" / "nvme0" / "nvme0n1").resolve() and part.parent == disk
    assert (part / "holders").is_dir() and not any((part / "holders").iterdir())


def test_holders_mounts_and_swaps_are_written_as_the_kernel_writes_them(tmp_path):
    host = storage_node(tmp_path)
    host.hold("nvme0n1p2", "dm-0")
    host.mount("nvme0n1p1", "/mnt/my disk")
    host.swapon("nvme0n1p2")
    part = (host.sysfs / "class" / "block" / "nvme0n1p2").resolve()
    assert (part / "holders" / "dm-0").resolve() == (host.sysfs / "devices" / "virtual" / "block" / "dm-0").resolve()
    assert "/dev/nvme0n1p1 /mnt/my\\040disk ext4" in (host.proc / "mounts").read_text()
    swaps = (host.proc / "swaps").read_text().splitlines()
    assert swaps[0].startswith("Filename") and swaps[1].split()[0] == "/dev/nvme0n1p2"


def test_removing_a_device_removes_every_link_to_it(tmp_path):
    host = storage_node(tmp_path)
    host.remove_device("0000:00:01.0")  # the root port, and the NIC behind it
    for gone in ("bus/pci/devices/0000:00:01.0", "bus/pci/devices/0000:18:00.0", "class/net/eth0",
                 "kernel/iommu_groups/30", "bus/pci/drivers/ice/0000:18:00.1"):  # fmt: skip
        assert not os.path.lexists(host.sysfs / gone), gone
    assert (host.sysfs / "bus" / "pci" / "devices" / "0000:3d:00.0").exists()


def test_a_synthetic_host_has_about_the_devices_asked_for(tmp_path):
    host = synthetic_host(tmp_path, 300)
    entries = os.listdir(host.sysfs / "bus" / "pci" / "devices")
    assert 300 <= len(entries) <= 302
    assert all((host.sysfs / "bus" / "pci" / "devices" / e).exists() for e in entries)
