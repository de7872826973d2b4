"""Each eligibility rule of DESIGN.md, on fixture hosts laid out as the kernel lays out sysfs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from e2e.fakesysfs import FakeHost, gpu_node, storage_node
from passthrough.pci.discovery import Device, discover
from passthrough.pci.pciids import PciIds

DB_PATH = Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11"
DB = PciIds.load(DB_PATH)
GPU, AUDIO, NIC = ("10de", "2236", "030200"), ("10de", "1aef", "040300"), ("8086", "1593", "020000")


def scan(host: FakeHost) -> dict[str, Device]:
    return {d.address: d for d in discover(host.sysfs, host.proc, DB).devices}


def host_with(tmp_path, *devices, **options) -> FakeHost:
    """A host with a root port on bus 00 and the given (address, ids, group) devices below it."""
    host = FakeHost(tmp_path, **options)
    host.add_root_port("0000:00:01.0", "3b", iommu_group=1 if host.iommu else None)
    for address, ids, group in devices:
        host.add_device(address, *ids, iommu_group=group)
    return host


def test_free_gpus_with_their_audio_function_are_eligible_and_pooled(tmp_path):
    devices = scan(gpu_node(tmp_path))
    for address in ("0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0", "0000:af:00.1"):
        assert devices[address].eligible and devices[address].reported and devices[address].reason == ""
    assert devices["0000:3b:00.0"].resource_name == "nvidia.com/GA102GL_A10"
    assert devices["0000:3b:00.1"].resource_name == ""
    assert devices["0000:af:00.0"].numa_node == 1 and devices["0000:af:00.0"].iommu_group == 21
    assert devices["0000:3b:00.0"].driver == "nvidia"
    assert devices["0000:3b:00.0"].name == "GA102GL [A10]"
    assert devices["0000:3b:00.0"].vendor_name == "NVIDIA Corporation"


def test_a_display_controller_of_another_vendor_is_eligible_without_a_pool(tmp_path):
    devices = scan(host_with(tmp_path, ("0000:3b:00.0", ("102b", "0536", "030000"), 5)))
    assert devices["0000:3b:00.0"].eligible and devices["0000:3b:00.0"].resource_name == ""


def test_without_iommu_nothing_is_eligible_and_the_reason_says_how_to_turn_it_on(tmp_path):
    found = discover(*_roots(host_with(tmp_path, ("0000:3b:00.0", GPU, None), iommu=False)), DB)
    assert not found.node.iommu_enabled
    gpu = {d.address: d for d in found.devices}["0000:3b:00.0"]
    assert not gpu.eligible and gpu.reported
    assert "IOMMU is not enabled" in gpu.reason and "intel_iommu=on" in gpu.reason and "amd_iommu=on" in gpu.reason


def test_a_device_without_an_iommu_group_on_an_iommu_host_is_not_eligible(tmp_path):
    devices = scan(host_with(tmp_path, ("0000:3b:00.0", GPU, None), ("0000:3b:00.1", AUDIO, 7)))
    assert not devices["0000:3b:00.0"].eligible and "no IOMMU group" in devices["0000:3b:00.0"].reason
    assert devices["0000:3b:00.0"].iommu_group == -1
    assert devices["0000:3b:00.1"].eligible


def test_a_device_on_bus_00_is_left_out(tmp_path):
    host = host_with(tmp_path)
    host.add_device("0000:00:02.0", "8086", "3e92", "030000", iommu_group=2)  # an integrated GPU
    device = scan(host)["0000:00:02.0"]
    assert not device.reported and not device.eligible and "bus 00" in device.reason


@pytest.mark.parametrize(
    ("class_code", "what"),
    [("060400", "bridge"), ("050000", "memory controller"), ("088000", "system peripheral")],
)
def test_bridges_memory_controllers_and_system_peripherals_are_left_out(tmp_path, class_code, what):
    device = scan(host_with(tmp_path, ("0000:3b:00.0", ("8086", "2021", class_code), 5)))["0000:3b:00.0"]
    assert not device.reported and not device.eligible and what in device.reason


def test_a_nic_with_an_interface_up_is_not_eligible(tmp_path):
    devices = scan(storage_node(tmp_path))
    assert not devices["0000:18:00.0"].eligible and devices["0000:18:00.0"].reported
    assert devices["0000:18:00.0"].reason.startswith("network interface eth0 is up;")
    assert "ip link set eth0 down" in devices["0000:18:00.0"].reason
    assert devices["0000:18:00.1"].eligible


def test_bringing_the_interface_down_makes_the_nic_eligible(tmp_path):
    host = storage_node(tmp_path)
    host.set_netdev("eth0", up=False)
    assert scan(host)["0000:18:00.0"].eligible


def test_an_interface_set_up_without_a_cable_is_still_in_use(tmp_path):
    host = storage_node(tmp_path)
    host.set_netdev("eth1", up=True, carrier=False)  # operstate "down", IFF_UP set
    assert "eth1 is up" in scan(host)["0000:18:00.1"].reason


def test_operstate_decides_when_there_are_no_flags(tmp_path):
    host = storage_node(tmp_path)
    for ifname in ("eth0", "eth1"):
        (host.sysfs / "class" / "net" / ifname / "flags").unlink()
    devices = scan(host)
    assert not devices["0000:18:00.0"].eligible and "eth0 is up" in devices["0000:18:00.0"].reason
    assert devices["0000:18:00.1"].eligible


def test_a_free_nvme_drive_is_eligible(tmp_path):
    assert scan(storage_node(tmp_path))["0000:3d:00.0"].eligible


@pytest.mark.parametrize(
    ("use", "said"),
    [
        (lambda h: h.mount("nvme0n1p1", "/var/lib/data"), "nvme0n1p1 is mounted on /var/lib/data"),
        (lambda h: h.mount("nvme0n1", "/srv"), "nvme0n1 is mounted on /srv"),
        (lambda h: h.swapon("nvme0n1p2"), "nvme0n1p2 is used as swap"),
        (lambda h: h.hold("nvme0n1p2", "dm-0"), "nvme0n1p2 is held by dm-0"),
        (lambda h: h.hold("nvme0n1", "md127"), "nvme0n1 is held by md127"),
    ],
    ids=["partition mounted", "disk mounted", "swap", "held by dm", "held by raid"],
)
def test_a_storage_controller_with_a_block_device_in_use_is_not_eligible(tmp_path, use, said):
    host = storage_node(tmp_path)
    use(host)
    nvme = scan(host)["0000:3d:00.0"]
    assert not nvme.eligible and nvme.reported
    assert nvme.reason.startswith(f"block device {said}")


def test_a_block_device_in_use_keeps_any_controller_from_passthrough(tmp_path):
    host = host_with(tmp_path, ("0000:3b:00.0", ("8086", "a36d", "0c0330"), 5))  # a USB controller
    host.add_block("0000:3b:00.0", "sda", ("sda1",))
    host.mount("sda1", "/boot")
    assert "sda1 is mounted on /boot" in scan(host)["0000:3b:00.0"].reason


def test_bridges_in_the_group_do_not_count(tmp_path):
    host = FakeHost(tmp_path)
    host.add_root_port("0000:00:01.0", "3b", iommu_group=9)
    host.add_device("0000:3b:00.0", *GPU, iommu_group=9)
    devices = scan(host)
    assert devices["0000:3b:00.0"].eligible and not devices["0000:00:01.0"].reported


def test_one_busy_member_makes_the_whole_group_ineligible(tmp_path):
    host = host_with(tmp_path, ("0000:3b:00.0", NIC, 12), ("0000:3b:00.1", NIC, 12), ("0000:3b:00.2", NIC, 12))
    host.add_netdev("0000:3b:00.0", "eth0", up=False)
    host.add_netdev("0000:3b:00.1", "eth1", up=False)
    host.add_netdev("0000:3b:00.2", "eth2", up=True)
    devices = scan(host)
    assert devices["0000:3b:00.2"].reason.startswith("network interface eth2 is up")
    for free in ("0000:3b:00.0", "0000:3b:00.1"):
        assert not devices[free].eligible
        # The reason names the member that is busy for its own reason, not another held one.
        assert devices[free].reason.startswith("IOMMU group 12 also holds 0000:3b:00.2 (network interface eth2 is up);")
        assert "passed through whole" in devices[free].reason


def test_a_left_out_member_that_is_not_a_bridge_holds_its_group_back(tmp_path):
    host = host_with(tmp_path, ("0000:3b:00.0", GPU, 4))
    host.add_device("0000:00:1f.4", "8086", "a323", "0c0500", iommu_group=4)  # SMBus, on bus 00
    gpu = scan(host)["0000:3b:00.0"]
    assert not gpu.eligible and "0000:00:1f.4" in gpu.reason and "bus 00" in gpu.reason


def test_a_group_member_that_is_not_a_pci_device_holds_the_group_back(tmp_path):
    host = host_with(tmp_path, ("0000:3b:00.0", GPU, 4))
    platform = tmp_path / "sys" / "devices" / "platform" / "80860F28:00"
    platform.mkdir(parents=True)
    (host.sysfs / "kernel" / "iommu_groups" / "4" / "devices" / "80860F28:00").symlink_to(
        "../../../../devices/platform/80860F28:00"
    )
    gpu = scan(host)["0000:3b:00.0"]
    assert not gpu.eligible and "80860F28:00" in gpu.reason


def test_without_vfio_pci_the_node_says_so_and_devices_stay_eligible(tmp_path):
    found = discover(*_roots(host_with(tmp_path, ("0000:3b:00.0", GPU, 4), vfio=False)), DB)
    assert found.node.iommu_enabled and not found.node.vfio_available
    assert all(d.eligible for d in found.devices if d.reported)


def test_vfio_pci_counts_as_available_when_only_the_module_is_loaded(tmp_path):
    host = host_with(tmp_path, vfio=False)
    (host.sysfs / "module" / "vfio_pci").mkdir()
    assert discover(*_roots(host), DB).node.vfio_available


def test_a_vanished_device_is_no_longer_listed(tmp_path):
    host = gpu_node(tmp_path)
    host.remove_device("0000:af:00.0")
    devices = scan(host)
    assert "0000:af:00.0" not in devices
    assert devices["0000:af:00.1"].eligible and devices["0000:3b:00.0"].eligible


def test_devices_are_sorted_by_address(tmp_path):
    addresses = [d.address for d in discover(*_roots(gpu_node(tmp_path)), DB).devices]
    assert addresses == sorted(addresses) and len(addresses) == 7


def _roots(host: FakeHost) -> tuple[Path, Path]:
    return host.sysfs, host.proc


def test_a_disk_mounted_only_on_the_host_counts_from_inside_a_container(tmp_path):
    """The agent reads the host's /proc at /host/proc: its `self/mountinfo` is the container's
    own namespace there, so the host's table is PID 1's."""
    host = storage_node(tmp_path)
    major, minor = host.devnum("nvme0n1p1")
    (host.proc / "1").mkdir()
    (host.proc / "1" / "mountinfo").write_text(
        f"25 1 {major}:{minor} / /var/lib/host-data rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n"
    )
    nvme = scan(host)["0000:3d:00.0"]
    assert not nvme.eligible and "nvme0n1p1 is mounted on /var/lib/host-data" in nvme.reason


# --- Disks in use, by device number and through holders ---------------------------------


def two_drive_node(tmp_path) -> FakeHost:
    """`storage_node` plus a second NVMe drive (nvme1n1, 0000:5e:00.0) in its own group."""
    host = storage_node(tmp_path)
    host.add_root_port("0000:00:03.0", "5e", iommu_group=3)
    host.add_device("0000:5e:00.0", "144d", "a808", "010802", driver="nvme", iommu_group=33)
    host.add_block("0000:5e:00.0", "nvme1n1", ("nvme1n1p1", "nvme1n1p2"))
    return host


def test_a_root_the_kernel_mounted_as_dev_root_is_found_by_its_device_number(tmp_path):
    host = storage_node(tmp_path)
    host.mount("nvme0n1p1", "/", source="/dev/root")  # root=/dev/nvme0n1p1 without an initramfs
    nvme = scan(host)["0000:3d:00.0"]
    assert not nvme.eligible
    assert nvme.reason == "block device nvme0n1p1 holds the root filesystem; this device stays with the host"


def test_a_filesystem_mounted_by_a_link_name_is_found_by_its_device_number(tmp_path):
    host = storage_node(tmp_path)
    host.mount("nvme0n1p2", "/var/lib/data", source="/dev/disk/by-uuid/0b5c1f4e-8a8e-4f4e-9a1c-2b7d0e6f3a11")
    assert scan(host)["0000:3d:00.0"].reason.startswith("block device nvme0n1p2 is mounted on /var/lib/data;")


def test_an_lvm_root_on_a_partition_is_found_through_its_holder(tmp_path):
    host = storage_node(tmp_path)
    host.hold("nvme0n1p2", "dm-0", name="vg0-root")
    host.mount("dm-0", "/", source="/dev/mapper/vg0-root")
    nvme = scan(host)["0000:3d:00.0"]
    assert not nvme.eligible
    assert nvme.reason.startswith("block device nvme0n1p2 → dm-0 (vg0-root) holds the root filesystem;")


def test_a_stack_is_followed_to_its_top(tmp_path):
    host = storage_node(tmp_path)  # dm-crypt on an LVM volume on the partition
    host.hold("nvme0n1p2", "dm-0", name="vg0-home")
    host.hold("dm-0", "dm-1", name="luks-home")
    host.mount("dm-1", "/home", source="/dev/mapper/luks-home")
    reason = scan(host)["0000:3d:00.0"].reason
    assert reason.startswith("block device nvme0n1p2 → dm-0 (vg0-home) → dm-1 (luks-home) is mounted on /home;")
    assert "umount /home" in reason and "take nvme0n1p2 out of dm-0" in reason


def test_a_raid_member_is_found_through_its_array_on_every_drive(tmp_path):
    host = two_drive_node(tmp_path)
    host.hold("nvme0n1p1", "md0")
    host.hold("nvme1n1p1", "md0")
    host.mount("md0", "/srv")
    devices = scan(host)
    for address, part in (("0000:3d:00.0", "nvme0n1p1"), ("0000:5e:00.0", "nvme1n1p1")):
        assert not devices[address].eligible
        assert devices[address].reason.startswith(f"block device {part} → md0 is mounted on /srv;")
        assert f"take {part} out of md0 (mdadm --remove)" in devices[address].reason


def test_swap_on_a_partition_is_found(tmp_path):
    host = storage_node(tmp_path)
    host.swapon("nvme0n1p2")
    reason = scan(host)["0000:3d:00.0"].reason
    assert reason.startswith("block device nvme0n1p2 is used as swap;") and "swapoff /dev/nvme0n1p2" in reason


@pytest.mark.parametrize("shown", ["/dev/dm-1", "/dev/mapper/vg0-swap"])
def test_swap_on_a_logical_volume_is_found_through_its_holder(tmp_path, shown):
    host = storage_node(tmp_path)
    host.hold("nvme0n1p2", "dm-1", name="vg0-swap")
    host.swapon("dm-1", path=shown)
    reason = scan(host)["0000:3d:00.0"].reason
    assert reason.startswith("block device nvme0n1p2 → dm-1 (vg0-swap) is used as swap;")
    assert "swapoff /dev/dm-1" in reason


def test_the_root_filesystem_is_named_before_other_mounts_of_the_drive(tmp_path):
    host = storage_node(tmp_path)
    host.mount("nvme0n1p1", "/boot/efi", fstype="vfat")
    host.mount("nvme0n1p2", "/")
    assert "nvme0n1p2 holds the root filesystem" in scan(host)["0000:3d:00.0"].reason


def test_an_unmounted_drive_is_offered_beside_a_busy_one(tmp_path):
    host = two_drive_node(tmp_path)
    host.mount("nvme0n1p1", "/", source="/dev/root")
    host.hold("nvme0n1p2", "dm-0", name="vg0-swap")
    host.swapon("dm-0")
    devices = scan(host)
    assert not devices["0000:3d:00.0"].eligible
    assert devices["0000:5e:00.0"].eligible and devices["0000:5e:00.0"].reason == ""


def test_a_btrfs_root_is_found_by_its_source_and_by_its_fsid(tmp_path):
    host = two_drive_node(tmp_path)
    host.mount("nvme0n1p2", "/", fstype="btrfs")  # st_dev 0:N, the source names the disk
    host.mount("nvme1n1p2", "/data", fstype="btrfs", source="/dev/root")  # only sys/fs/btrfs names it
    devices = scan(host)
    assert "nvme0n1p2 holds the root filesystem" in devices["0000:3d:00.0"].reason
    assert devices["0000:5e:00.0"].reason.startswith("block device nvme1n1p2 is in a mounted btrfs filesystem (")


def test_a_root_on_an_nvme_multipath_disk_keeps_its_controller(tmp_path):
    host = storage_node(tmp_path)
    host.add_root_port("0000:00:03.0", "5e", iommu_group=3)
    host.add_device("0000:5e:00.0", "144d", "a824", "010802", driver="nvme", iommu_group=33)
    host.add_block("0000:5e:00.0", "nvme1n1", ("nvme1n1p1",), multipath=True)
    assert scan(host)["0000:5e:00.0"].eligible
    host.mount("nvme1n1p1", "/")
    assert "nvme1n1p1 holds the root filesystem" in scan(host)["0000:5e:00.0"].reason


def test_a_zfs_whole_disk_is_known_by_its_partition_name(tmp_path):
    host = two_drive_node(tmp_path)
    host.name_partition("nvme1n1p1", "zfs-6a1c2b3d4e5f6071")
    host.mount_zfs("tank/data", "/tank/data")
    reason = scan(host)["0000:5e:00.0"].reason
    assert reason.startswith("block device nvme1n1p1 is a ZFS disk (partition zfs-6a1c2b3d4e5f6071; ZFS pool tank is imported)")  # fmt: skip


def test_with_a_zfs_pool_imported_a_partition_nothing_visibly_uses_is_not_offered(tmp_path):
    host = storage_node(tmp_path)
    host.add_root_port("0000:00:03.0", "5e", iommu_group=3)
    host.add_device("0000:5e:00.0", "144d", "a808", "010802", driver="nvme", iommu_group=33)
    host.add_block("0000:5e:00.0", "nvme1n1")  # no partitions: ZFS would have made some
    assert scan(host)["0000:3d:00.0"].eligible  # no pool: a partition of nothing is free
    host.import_zfs_pool("rpool")
    devices = scan(host)
    assert devices["0000:3d:00.0"].reason.startswith(
        "whether block device nvme0n1p1 is in a ZFS pool cannot be told (ZFS pool rpool is imported"
    )
    assert "zpool status -P" in devices["0000:3d:00.0"].reason
    assert devices["0000:5e:00.0"].eligible


# -- SR-IOV and the boot display ---------------------------------------------------------------
# The kernel's layout: a VF's directory sits beside its PF's, with a `physfn` link to the PF;
# the PF has `sriov_numvfs`, `sriov_totalvfs` and a `virtfn<N>` link to each VF.

E810_VF = ("8086", "1889", "020000")


def with_vfs(tmp_path, count: int, *, driver: str | None = "iavf", netdevs: bool = True) -> FakeHost:
    """An E810 PF at 3b:00.0 (its interface down) with `count` VFs at 3b:01.<n>, each in its own group."""
    host = host_with(tmp_path)
    host.add_device("0000:3b:00.0", *NIC, driver="ice", iommu_group=4)
    host.add_netdev("0000:3b:00.0", "ens1f0", up=False)
    pf = host.device_dir("0000:3b:00.0")
    (pf / "sriov_totalvfs").write_text("64\n")
    (pf / "sriov_numvfs").write_text(f"{count}\n")
    for n in range(count):
        address = f"0000:3b:01.{n}"
        vf = host.add_device(address, *E810_VF, driver=driver, iommu_group=40 + n)
        (vf / "physfn").symlink_to("../0000:3b:00.0")
        (pf / f"virtfn{n}").symlink_to(f"../{address}")
        if driver and netdevs:
            host.add_netdev(address, f"ens1f0v{n}", up=False)
    return host


def test_a_physical_function_with_virtual_functions_enabled_stays_with_the_host(tmp_path):
    pf = scan(with_vfs(tmp_path, 2))["0000:3b:00.0"]
    assert not pf.eligible and pf.reported
    assert pf.reason.startswith(
        "SR-IOV is on: 2 virtual functions are enabled, and unbinding this physical function would destroy them"
    )
    assert "echo 0 > /sys/bus/pci/devices/0000:3b:00.0/sriov_numvfs" in pf.reason


def test_a_physical_function_with_sriov_off_is_eligible(tmp_path):
    host = with_vfs(tmp_path, 0)
    assert scan(host)["0000:3b:00.0"].eligible


def test_virtual_functions_are_left_out_unless_the_admin_opts_in(tmp_path):
    host = with_vfs(tmp_path, 2)
    vf = scan(host)["0000:3b:01.0"]
    assert not vf.eligible and not vf.reported
    assert vf.reason.startswith("it is an SR-IOV virtual function of 0000:3b:00.0")
    assert "--sriov-virtual-functions" in vf.reason
    opted_in = {d.address: d for d in discover(host.sysfs, host.proc, DB, virtual_functions=True).devices}
    assert opted_in["0000:3b:01.0"].eligible and opted_in["0000:3b:01.0"].reported
    assert opted_in["0000:3b:01.1"].eligible
    assert not opted_in["0000:3b:00.0"].eligible  # the PF stays with the host either way


def test_a_virtual_function_whose_interface_moved_into_a_pod_is_in_use(tmp_path):
    # The SR-IOV CNI moved ens1f0v0 into a pod's network namespace: the host's sysfs no longer lists it.
    host = with_vfs(tmp_path, 2)
    moved = host.device_dir("0000:3b:01.0") / "net" / "ens1f0v0"
    (host.sysfs / "class" / "net" / "ens1f0v0").unlink()
    for f in moved.iterdir():
        f.unlink()
    moved.rmdir()
    devices = {d.address: d for d in discover(host.sysfs, host.proc, DB, virtual_functions=True).devices}
    assert not devices["0000:3b:01.0"].eligible
    assert devices["0000:3b:01.0"].reason.startswith(
        "its network interface (driver iavf) is not in the host's network namespace: it was moved into a pod or container"
    )
    assert devices["0000:3b:01.1"].eligible


def test_a_virtual_function_on_vfio_pci_or_on_no_driver_has_no_interface_to_miss(tmp_path):
    for driver, folder in (("vfio-pci", "vfio"), (None, "none")):
        host = with_vfs(tmp_path / folder, 1, driver=driver, netdevs=False)
        assert {d.address: d for d in discover(host.sysfs, host.proc, DB, virtual_functions=True).devices}["0000:3b:01.0"].eligible


def test_the_boot_display_stays_with_the_host(tmp_path):
    host = gpu_node(tmp_path)
    host.write_attribute("0000:3b:00.0", "boot_vga", "1\n")
    host.write_attribute("0000:af:00.0", "boot_vga", "0\n")
    devices = scan(host)
    gpu = devices["0000:3b:00.0"]
    assert not gpu.eligible and gpu.reported
    assert gpu.reason == (
        "it is the boot display (boot_vga is 1): the host's console, which the firmware and kernel draw on; "
        "it stays with the host; pass through another GPU"
    )
    assert devices["0000:af:00.0"].eligible
    # Its group goes with it: the audio function is held back too.
    assert devices["0000:3b:00.1"].reason.startswith("IOMMU group")


def test_passthrough_discover_takes_the_opt_in_as_the_agent_does(tmp_path, capsys):
    from passthrough import cli

    host = with_vfs(tmp_path, 1)
    args = ["discover", f"--sysfs-root={host.sysfs}", f"--proc-root={host.proc}", f"--pci-ids={DB_PATH}", "-o", "json"]
    for extra, listed in (([], False), (["--sriov-virtual-functions"], True)):
        assert cli.main([*args, *extra]) == 0
        devices = {d["pciAddress"]: d for d in json.loads(capsys.readouterr().out)["devices"]}
        assert ("0000:3b:01.0" in devices) is listed
    assert cli.build_parser().parse_args(["agent", "--sriov-virtual-functions"]).sriov_virtual_functions
