"""Binding IOMMU groups to vfio-pci and giving them back, on fixture hosts with a simulated kernel."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.fakekernel import FakeKernel
from e2e.fakesysfs import FakeHost, detach_mounts, gpu_node
from passthrough.pci import sysfs, vfio
from passthrough.pci.vfio import BindError

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
GROUP = 20
# Failures wait this long for the kernel's reaction; the simulated kernel's takes milliseconds.
SHORT = 0.3


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    with FakeKernel(gpu_node(tmp_path)) as kernel:
        yield kernel


@pytest.fixture
def host(kernel: FakeKernel) -> FakeHost:
    return kernel.host


def snapshot(host: FakeHost) -> dict[str, str]:
    """Every file and link of the tree, with its content or target (write-only control files,
    `bind`, `unbind`, `drivers_probe`, as names only: the kernel refuses to read them)."""
    found = {}
    for folder, dirs, files in os.walk(host.root):
        for name in dirs + files:
            path = Path(folder) / name
            if path.is_symlink():
                found[str(path)] = "-> " + os.readlink(path)
            elif path.is_file():
                try:
                    found[str(path)] = path.read_text()
                except OSError:
                    found[str(path)] = "(write-only)"
    return found


def override(host: FakeHost, address: str) -> str:
    return (host.device_dir(address) / "driver_override").read_text().strip()


def as_it_was(kernel: FakeKernel) -> bool:
    kernel.sync()  # the last write of a rollback is not waited for: its effect is the kernel's
    host = kernel.host
    return (
        host.driver(GPU) == "nvidia"
        and host.driver(AUDIO) == "snd_hda_intel"
        and override(host, GPU) == override(host, AUDIO) == "(null)"
        and not host.vfio_node(GROUP).exists()
    )


# --- Binding ------------------------------------------------------------------------------


def test_binding_an_a10_and_its_audio_function_moves_both_to_vfio_pci_and_creates_the_group_node(host):
    writes = vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    # Per function: driver_override, unbind from its driver, drivers_probe.
    assert writes == 6
    assert host.driver(GPU) == host.driver(AUDIO) == "vfio-pci"
    assert override(host, GPU) == override(host, AUDIO) == "vfio-pci"
    assert host.vfio_node(GROUP).exists() and (host.dev / "vfio" / "vfio").exists()
    assert (host.sysfs / "bus" / "pci" / "drivers" / "vfio-pci" / GPU).resolve() == host.device_dir(GPU)
    assert host.driver("0000:af:00.0") == "nvidia" and not host.vfio_node(21).exists()


def test_binding_a_group_already_on_vfio_pci_costs_no_write(host):
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    before = snapshot(host)
    assert vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 0
    assert snapshot(host) == before


def test_a_device_bound_statically_costs_no_write(host):
    # vfio-pci.ids= on the kernel command line: on vfio-pci without a driver_override.
    host.bind(GPU, "vfio-pci")
    assert vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 3
    assert override(host, GPU) == "(null)"


def test_group_members_leaves_bridges_out(tmp_path):
    host = FakeHost(tmp_path)
    host.add_device("0000:3a:00.0", "8086", "2030", "060400", driver="pcieport", iommu_group=5)
    host.add_device("0000:3b:00.0", "10de", "2236", "030200", driver="nvidia", iommu_group=5)
    host.add_device("0000:3b:00.1", "10de", "1aef", "040300", iommu_group=5)
    assert vfio.group_members(host.sysfs, 5) == ["0000:3b:00.0", "0000:3b:00.1"]
    assert vfio.group_members(host.sysfs, 6) == []


def test_vfio_pci_not_loaded_is_refused_before_any_write(tmp_path):
    host = FakeHost(tmp_path, vfio=False)
    host.add_device(GPU, "10de", "2236", "030200", driver="nvidia", iommu_group=GROUP)
    with FakeKernel(host):
        before = snapshot(host)
        with pytest.raises(BindError) as e:
            vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU])
        assert e.value.reason == "VfioNotLoaded"
        assert "modprobe vfio-pci" in str(e.value) and "/etc/modules-load.d" in str(e.value)
        assert snapshot(host) == before
        host.load_vfio()  # the admin did as told; the kernel sees the new driver
        assert vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU]) == 3
        assert host.driver(GPU) == "vfio-pci"


def test_a_member_of_another_group_is_refused_before_any_write(host, kernel):
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, "0000:af:00.0"])
    assert e.value.reason == "NotInGroup" and "0000:af:00.0 is in IOMMU group 21, not 20" in str(e.value)
    assert as_it_was(kernel)


def test_an_unbind_of_a_held_device_blocks_until_the_holder_lets_go_and_never_refuses(host):
    # Linux: the driver's remove waits for the holder (and the write with it); unbind never fails.
    host.hold(AUDIO, lets_go_after=0.6)
    started = time.monotonic()
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], timeout=SHORT)
    assert time.monotonic() - started >= 0.5
    assert host.driver(GPU) == host.driver(AUDIO) == "vfio-pci"


def install_nvidia_module(host: FakeHost, refcnt: int, holders: tuple[str, ...]) -> None:
    module = host.sysfs / "module" / "nvidia"
    (module / "holders").mkdir(parents=True, exist_ok=True)
    (module / "refcnt").write_text(f"{refcnt}\n")
    for holder in holders:
        (module / "holders" / holder).mkdir(exist_ok=True)


def test_a_gpu_whose_nvidia_driver_has_users_is_not_unbound_live(host):
    # nvidia_uvm and nvidia_modeset hold the module, and one more reference: nvidia-persistenced.
    install_nvidia_module(host, refcnt=3, holders=("nvidia_uvm", "nvidia_modeset"))
    before = snapshot(host)
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], timeout=SHORT)
    assert e.value.reason == "VendorDriverInUse"
    assert "0000:3b:00.0 is on the nvidia driver, which has 1 user(s)" in str(e.value)
    assert "vfio-pci.ids=10de:2236" in str(e.value) and "driverctl set-override 0000:3b:00.0 vfio-pci" in str(e.value)
    assert "nvidia.com/gpu.workload.config=vm-passthrough" in str(e.value)
    assert snapshot(host) == before
    # Only the modules built on it hold it now: nothing would wait, so it moves.
    install_nvidia_module(host, refcnt=2, holders=("nvidia_uvm", "nvidia_modeset"))
    assert vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 6


def test_a_refused_driver_override_write_names_the_file_and_is_rolled_back(host, kernel):
    host.refuse_writes(AUDIO, "driver_override")
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert e.value.reason == "BindFailed"
    assert f"{host.sysfs}/bus/pci/devices/{AUDIO}/driver_override" in str(e.value)
    assert "Is a directory" in str(e.value) and "rolled back" in str(e.value)
    kernel.sync()
    assert host.driver(GPU) == "nvidia" and override(host, GPU) == "(null)"
    assert not host.vfio_node(GROUP).exists()


def test_a_refused_first_write_changes_nothing(host):
    host.refuse_writes(GPU, "driver_override")
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert str(e.value).endswith("; nothing was changed")
    assert host.driver(GPU) == "nvidia" and host.driver(AUDIO) == "snd_hda_intel"


def test_a_device_that_falls_off_the_bus_mid_bind_is_device_gone(host):
    host.set_fragile(AUDIO)
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert e.value.reason == "DeviceGone" and f"{AUDIO} vanished" in str(e.value)
    assert "rolled back" in str(e.value)
    assert host.driver(GPU) == "nvidia" and not os.path.lexists(host.sysfs / "bus" / "pci" / "devices" / AUDIO)


def test_a_device_gone_before_the_bind_is_device_gone_with_no_write(host):
    host.remove_device(AUDIO)
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert e.value.reason == "DeviceGone" and "before anything was written" in str(e.value)
    assert host.driver(GPU) == "nvidia" and override(host, GPU) == "(null)"


def test_a_failed_rollback_says_what_is_left_half_bound(host):
    host.refuse_writes(AUDIO, "driver_override")  # the audio function fails after the GPU moved
    nvidia_bind = host.sysfs / "bus" / "pci" / "drivers" / "nvidia" / "bind"
    detach_mounts(nvidia_bind)  # the simulated kernel's file over it
    nvidia_bind.unlink()  # and the GPU cannot go back
    with pytest.raises(BindError) as e:
        vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], timeout=SHORT)
    message = str(e.value)
    assert e.value.reason == "BindFailed"
    assert "rolling back failed too, so IOMMU group 20 is half-bound: 0000:3b:00.0 is left on no driver, not nvidia" in (
        message
    )


def test_the_group_node_missing_is_vfio_device_missing(tmp_path):
    host = gpu_node(tmp_path / "host")
    with FakeKernel(host):
        with pytest.raises(BindError) as e:  # the agent looks at a /dev that is not the host's
            vfio.bind_group(host.sysfs, tmp_path / "dev", GROUP, [GPU, AUDIO], timeout=SHORT)
    assert e.value.reason == "VfioDeviceMissing" and f"{tmp_path}/dev/vfio/20 did not appear" in str(e.value)
    assert host.driver(GPU) == host.driver(AUDIO) == "vfio-pci"  # the group is whole: nothing to undo


# --- Giving back --------------------------------------------------------------------------


def test_release_gives_both_back_to_their_drivers_and_removes_the_group_node(host, kernel):
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    # Per function: clear driver_override, unbind from vfio-pci, drivers_probe.
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 6
    assert as_it_was(kernel)
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 0


def test_release_leaves_a_device_no_driver_claims_driverless(host):
    # A passthrough node without the NVIDIA driver: nothing claims the GPU, and that is fine.
    host.set_default_driver(GPU, None)
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], claim_wait=SHORT) == 6
    assert host.driver(GPU) == "" and host.driver(AUDIO) == "snd_hda_intel"
    assert override(host, GPU) == "(null)" and not host.vfio_node(GROUP).exists()


def test_release_of_a_device_vfio_pci_claims_by_default_is_give_back_failed(host):
    host.set_default_driver(GPU, "vfio-pci")  # vfio-pci.ids=10de:2236
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    with pytest.raises(BindError) as e:
        vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert e.value.reason == "GiveBackFailed"
    assert "0000:3b:00.0 went back to vfio-pci" in str(e.value) and "vfio-pci.ids=" in str(e.value)
    assert "(0000:3b:00.1 went back)" in str(e.value) and host.driver(AUDIO) == "snd_hda_intel"


def test_release_of_a_group_a_vmm_has_open_is_held_by_process_before_any_write(host, kernel):
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    vmm = os.open(host.vfio_node(GROUP), os.O_RDWR)  # a VMM holds the group: the next open is EBUSY
    try:
        before = snapshot(host)
        assert vfio.held_by_process(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == "/dev/vfio/20 is open"
        with pytest.raises(BindError) as e:
            vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], timeout=SHORT)
        assert e.value.reason == "HeldByProcess"
        assert "/dev/vfio/20 is open (a VMM or another process holds IOMMU group 20)" in str(e.value)
        assert snapshot(host) == before  # an unbind now would have blocked until the VMM let go
    finally:
        os.close(vmm)
    assert vfio.held_by_process(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == ""
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 6
    assert as_it_was(kernel)


def test_release_of_a_group_whose_member_is_enabled_is_held_by_process_before_any_write(host, kernel):
    # vfio-pci enables a device while a user has it open (through the group, or iommufd's
    # /dev/vfio/devices/vfioN, which leaves the group node free): the count says held.
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    host.write_attribute(GPU, "enable", "0\n")
    host.write_attribute(AUDIO, "enable", "1\n")
    before = snapshot(host)
    with pytest.raises(BindError) as e:
        vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO], timeout=SHORT)
    assert e.value.reason == "HeldByProcess"
    assert str(e.value).startswith("0000:3b:00.1 is in use (its enable count is 1: a VMM or another process has it open")
    assert snapshot(host) == before
    host.write_attribute(AUDIO, "enable", "0\n")
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 6


def test_the_enable_counts_judge_where_the_group_node_cannot_be_opened(host, tmp_path):
    # The chart's binder: its device cgroup refuses /dev/vfio/<group> (here: no such node at all).
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    elsewhere = tmp_path / "container-dev"
    host.write_attribute(GPU, "enable", "0\n")
    host.write_attribute(AUDIO, "enable", "0\n")
    assert vfio.held_by_process(host.sysfs, elsewhere, GROUP, [GPU, AUDIO]) == ""
    host.write_attribute(GPU, "enable", "2\n")
    assert "0000:3b:00.0 is in use (its enable count is 2" in vfio.held_by_process(host.sysfs, elsewhere, GROUP, [GPU, AUDIO])


def test_a_group_nothing_can_tell_about_is_held_unknown_and_kept(host, tmp_path):
    # Neither the group node nor a member's count can be read: kept, never read as "not held".
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    host.write_attribute(GPU, "enable", "0\n")
    before = snapshot(host)
    with pytest.raises(BindError) as e:
        vfio.release_group(host.sysfs, tmp_path / "container-dev", GROUP, [GPU, AUDIO], timeout=SHORT)
    assert e.value.reason == "HeldUnknown"
    assert "cannot tell whether something holds IOMMU group 20, so it stays on vfio-pci" in str(e.value)
    assert "(ENOENT) and the enable count of 0000:3b:00.1 cannot be read" in str(e.value)
    assert snapshot(host) == before
    # The host's own /dev/vfio, where the node is simply gone, is no refusal: nobody has it open.
    assert vfio.held_by_process(host.sysfs, host.dev, 99, []) == ""


def test_half_a_group_on_vfio_pci_is_not_healthy(host):
    # The kernel creates /dev/vfio/20 for one function, but the group is not viable: a VMM gets EPERM.
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU])
    assert host.vfio_node(GROUP).exists()
    assert not vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)
    assert vfio.group_problem(host.sysfs, host.dev, GROUP) == (
        "IOMMU group 20 is not viable: 0000:3b:00.1 is on snd_hda_intel, not vfio-pci (a VMM would get EPERM)"
    )
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP) and vfio.group_problem(host.sysfs, host.dev, GROUP) == ""


def test_release_of_a_device_that_vanished_is_no_failure(host):
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    host.set_fragile(GPU)  # it falls off the bus as vfio-pci lets go
    assert vfio.release_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO]) == 5
    assert host.driver(AUDIO) == "snd_hda_intel" and not host.vfio_node(GROUP).exists()


# --- Health -------------------------------------------------------------------------------


def test_device_healthy_flips_with_the_group_node_and_the_driver(host):
    assert not vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)
    vfio.bind_group(host.sysfs, host.dev, GROUP, [GPU, AUDIO])
    assert vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)
    host.vfio_node(GROUP).unlink()
    assert not vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)
    host.vfio_node(GROUP).touch()
    assert vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)
    host.remove_device(GPU)
    assert not vfio.device_healthy(host.sysfs, host.dev, GPU, GROUP)


# --- The write primitive ------------------------------------------------------------------


def test_a_refused_write_names_the_file_and_the_errno_text(tmp_path):
    (tmp_path / "driver_override").mkdir()
    with pytest.raises(sysfs.SysfsError, match=rf"writing 'vfio-pci' to {tmp_path}/driver_override failed "
                       r"\(Is a directory\)"):  # fmt: skip
        sysfs.write_text(tmp_path / "driver_override", "vfio-pci")
    with pytest.raises(sysfs.SysfsError, match=r"No such file or directory"):
        sysfs.write_text(tmp_path / "unbind", "0000:3b:00.0")
    assert not (tmp_path / "unbind").exists()  # sysfs attributes are never created by a write


# --- Properties ---------------------------------------------------------------------------

DRIVERS = st.sampled_from(["nvidia", "snd_hda_intel", "xhci_hcd", "vfio-pci", None])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=st.lists(st.lists(DRIVERS, min_size=1, max_size=3), min_size=1, max_size=3))
def test_bind_then_release_returns_every_device_to_its_driver(tmp_path_factory, groups):
    # A fresh tree per example, left for pytest to clean up (deleting it here would be the slowest part).
    host = FakeHost(tmp_path_factory.mktemp("host"))
    members: dict[int, list[str]] = {}
    for g, drivers in enumerate(groups):
        for fn, driver in enumerate(drivers):
            address = f"0000:{g + 1:02x}:00.{fn}"
            host.add_device(address, "10de", "2236", "030200", driver=driver, iommu_group=g)
            members.setdefault(g, []).append(address)
    initial = {a: host.driver(a) for m in members.values() for a in m}
    with FakeKernel(host):
        for g, addresses in members.items():
            expected = sum(3 if initial[a] else 2 for a in addresses if initial[a] != "vfio-pci")
            assert vfio.bind_group(host.sysfs, host.dev, g, addresses) == expected
            assert all(vfio.device_healthy(host.sysfs, host.dev, a, g) for a in addresses)
            assert vfio.bind_group(host.sysfs, host.dev, g, addresses) == 0
        for g, addresses in members.items():
            ours = [a for a in addresses if initial[a] != "vfio-pci"]
            vfio.release_group(host.sysfs, host.dev, g, ours, claim_wait=0.02)  # driverless ones stay so: don't wait long
            assert host.vfio_node(g).exists() == (len(ours) < len(addresses))
    assert {a: host.driver(a) for a in initial} == initial



def test_the_iommufd_device_is_named_only_when_it_and_dev_iommu_exist(tmp_path):
    host = gpu_node(tmp_path)
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == ""  # no vfio-dev: a kernel without the cdev
    (host.device_dir(GPU) / "vfio-dev" / "vfio3").mkdir(parents=True)
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == ""  # sysfs has it, /dev has neither node
    (host.dev / "vfio" / "devices").mkdir(parents=True, exist_ok=True)
    (host.dev / "vfio" / "devices" / "vfio3").write_text("")
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == ""  # no /dev/iommu (bookworm's 6.12, IOMMUFD off)
    (host.dev / "iommu").write_text("")
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == "vfio3"


def test_the_iommufd_device_is_named_where_sysfs_records_dev_iommu_and_the_container_has_no_node(tmp_path):
    # The chart's agent: the host's /sys and /dev/vfio, no /dev/iommu of its own.
    host = gpu_node(tmp_path)
    (host.device_dir(GPU) / "vfio-dev" / "vfio3").mkdir(parents=True)
    (host.dev / "vfio" / "devices").mkdir(parents=True, exist_ok=True)
    (host.dev / "vfio" / "devices" / "vfio3").write_text("")
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == ""
    (host.sysfs / "class" / "misc" / "iommu").mkdir(parents=True)  # iommufd's misc device
    assert not (host.dev / "iommu").exists()
    assert vfio.iommufd_device(host.sysfs, host.dev, GPU) == "vfio3"
