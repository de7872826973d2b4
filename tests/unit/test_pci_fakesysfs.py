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
    host.hold("nvme0n1p2", "dm-0", name="vg0-root")
    host.mount("nvme0n1p1", "/mnt/my disk")
    host.mount("dm-0", "/", source="/dev/root")
    host.swapon("nvme0n1p2")
    block = host.sysfs / "class" / "block"
    part, dm = (block / "nvme0n1p2").resolve(), (host.sysfs / "devices" / "virtual" / "block" / "dm-0").resolve()
    assert (part / "holders" / "dm-0").resolve() == dm and (dm / "slaves" / "nvme0n1p2").resolve() == part
    assert (block / "dm-0").resolve() == dm and (dm / "dm" / "name").read_text() == "vg0-root\n"
    assert (dm / "dev").read_text() == "253:0\n"
    assert "/dev/nvme0n1p1 /mnt/my\\040disk ext4" in (host.proc / "mounts").read_text()
    mountinfo = (host.proc / "self" / "mountinfo").read_text().splitlines()
    assert any(line.split()[2:5] == ["259:1", "/", "/mnt/my\\040disk"] and "- ext4 /dev/nvme0n1p1 " in line
               for line in mountinfo)  # fmt: skip
    assert any(line.split()[2:5] == ["253:0", "/", "/"] and "- ext4 /dev/root " in line for line in mountinfo)
    swaps = (host.proc / "swaps").read_text().splitlines()
    assert swaps[0].startswith("Filename") and swaps[1].split()[:2] == ["/dev/nvme0n1p2", "partition"]


def test_disks_and_partitions_carry_their_device_numbers(tmp_path):
    host = storage_node(tmp_path)
    host.add_block("0000:3d:00.0", "sdb", ("sdb1",))
    block = host.sysfs / "class" / "block"
    numbers = {name: (block / name / "dev").read_text().strip() for name in ("nvme0n1", "nvme0n1p1", "nvme0n1p2", "sdb", "sdb1")}
    assert numbers == {"nvme0n1": "259:0", "nvme0n1p1": "259:1", "nvme0n1p2": "259:2", "sdb": "8:16", "sdb1": "8:17"}
    assert (block / "nvme0n1p2" / "partition").read_text() == "2\n"
    assert "DEVTYPE=partition\nPARTN=2\n" in (block / "nvme0n1p2" / "uevent").read_text()
    assert (host.sysfs / "block" / "nvme0n1").resolve() == (block / "nvme0n1").resolve()


def test_a_multipath_disk_lives_in_its_subsystem_and_names_its_path(tmp_path):
    host = storage_node(tmp_path)
    host.add_root_port("0000:00:03.0", "5e", iommu_group=3)
    host.add_device("0000:5e:00.0", "144d", "a824", "010802", driver="nvme", iommu_group=33)
    host.add_block("0000:5e:00.0", "nvme1n1", ("nvme1n1p1",), multipath=True)
    block = host.sysfs / "class" / "block"
    path_disk = (block / "nvme1c1n1").resolve()
    assert path_disk.parent == (host.device_dir("0000:5e:00.0") / "nvme" / "nvme1").resolve()
    assert (path_disk / "hidden").read_text() == "1\n"
    head = (block / "nvme1n1").resolve()
    assert "nvme-subsystem" in head.parts and (block / "nvme1n1p1").resolve().parent == head
    assert (head / "multipath" / "nvme1c1n1").resolve() == path_disk


def test_btrfs_and_zfs_mounts_have_anonymous_device_numbers(tmp_path):
    host = storage_node(tmp_path)
    host.mount("nvme0n1p2", "/", fstype="btrfs", source="/dev/root")
    host.mount_zfs("tank/home", "/home")
    mountinfo = (host.proc / "self" / "mountinfo").read_text().splitlines()
    assert [line.split()[2].split(":")[0] for line in mountinfo if " - btrfs " in line or " - zfs " in line] == ["0", "0"]
    fsids = list((host.sysfs / "fs" / "btrfs").iterdir())
    assert len(fsids) == 1 and os.listdir(fsids[0] / "devices") == ["nvme0n1p2"]
    assert (host.proc / "spl" / "kstat" / "zfs" / "tank").is_dir()


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
