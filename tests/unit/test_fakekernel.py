"""The simulated kernel answers sysfs writes as Linux does, inside the system call: each test makes
the real syscalls against the FUSE files mounted over a fixture tree, in the private mount
namespace the test run has (make unit). `tests/` on a real kernel under QEMU runs the same cases."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e import fakekernel
from e2e.fakekernel import VFIO_GROUP_SET_CONTAINER, FakeKernel, KernelUnavailable
from e2e.fakesysfs import FakeHost, gpu_node, mounts_under, synthetic_host
from passthrough.pci import sysfs
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds
from passthrough.pci.sysfs import SysfsWriteError

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
BLOCKED = 0.3  # s a write must still be blocked after, to count as blocked


def require_kernel(path: Path) -> None:
    """Outside a private mount namespace (pytest run by hand) the kernel cannot run: a skip that
    says what to run, but a failure under CI, where `make test` must have made one."""
    problem = FakeKernel.unavailable(path)
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(problem)
        pytest.skip(problem)


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    require_kernel(tmp_path)
    with FakeKernel(gpu_node(tmp_path)) as kernel:
        yield kernel
    assert not kernel.errors


def write(host: FakeHost, relative: str, text: str) -> None:
    sysfs.write_text(host.sysfs / relative, text)


def refused(host: FakeHost, relative: str, text: str) -> int:
    """The errno of a write the kernel refuses."""
    with pytest.raises(SysfsWriteError) as refusal:
        write(host, relative, text)
    return refusal.value.errno


def override(host: FakeHost, address: str) -> str:
    return (host.sysfs / "bus/pci/devices" / address / "driver_override").read_text()


class Call(threading.Thread):
    """A system call made in a thread of its own, so the test can see it block."""

    def __init__(self, call: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.call, self.result, self.error, self.took = call, None, None, 0.0
        self.start()

    def run(self) -> None:
        started = time.monotonic()
        try:
            self.result = self.call()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e
        self.took = time.monotonic() - started

    def blocked(self) -> bool:
        self.join(BLOCKED)
        return self.is_alive()

    def returned(self, timeout: float = 5.0) -> object:
        self.join(timeout)
        assert not self.is_alive(), f"still blocked after {timeout} s"
        if self.error:
            raise self.error
        return self.result


def on_vfio(host: FakeHost, *addresses: str) -> None:
    for address in addresses:
        write(host, f"bus/pci/devices/{address}/driver_override", "vfio-pci")
        write(host, f"bus/pci/drivers/{host.driver(address)}/unbind", address)
        write(host, "bus/pci/drivers_probe", address)


# --- Writes are done when they return ------------------------------------------------------


def test_each_write_has_had_its_effect_when_it_returns(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    assert override(host, GPU) == "vfio-pci\n"
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    assert host.driver(GPU) == "" and not (host.sysfs / "bus/pci/drivers/nvidia" / GPU).exists()
    write(host, "bus/pci/drivers_probe", GPU)
    assert host.driver(GPU) == "vfio-pci" and host.vfio_node(20).exists()
    write(host, f"bus/pci/devices/{GPU}/driver_override", "\n")
    write(host, "bus/pci/drivers/vfio-pci/unbind", GPU)
    write(host, "bus/pci/drivers_probe", GPU)
    assert host.driver(GPU) == "nvidia" and not host.vfio_node(20).exists()


def test_driver_override_keeps_what_comes_before_a_newline_and_a_blank_write_clears_it(kernel):
    host = kernel.host
    assert override(host, GPU) == "(null)\n"
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci\nrest")
    assert override(host, GPU) == "vfio-pci\n"
    write(host, f"bus/pci/devices/{GPU}/driver_override", "\n")
    assert override(host, GPU) == "(null)\n"
    assert refused(host, f"bus/pci/devices/{GPU}/driver_override", "x" * 4095) == errno.EINVAL


def test_the_control_files_are_write_only(kernel):
    with pytest.raises(PermissionError):
        (kernel.host.sysfs / "bus/pci/drivers/nvidia/unbind").read_text()
    with pytest.raises(PermissionError):
        (kernel.host.sysfs / "bus/pci/drivers_probe").read_text()


# --- Unbinding a held device blocks; it never refuses --------------------------------------


def test_unbinding_a_held_device_blocks_until_its_holder_lets_go(kernel):
    host = kernel.host
    host.hold(GPU)  # nvidia-persistenced, or a CUDA process
    unbind = Call(lambda: write(host, "bus/pci/drivers/nvidia/unbind", GPU))
    # The driver links go before the driver's remove waits (as on Linux: __device_release_driver).
    assert unbind.blocked() and host.driver(GPU) == ""
    host.release(GPU)
    unbind.returned()
    assert host.driver(GPU) == ""


def test_driver_override_reads_and_writes_wait_while_an_unbind_holds_the_device_lock(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    host.hold(GPU)
    unbind = Call(lambda: write(host, "bus/pci/drivers/nvidia/unbind", GPU))
    assert unbind.blocked()
    read = Call(lambda: override(host, GPU))
    assert read.blocked()
    assert override(host, AUDIO) == "(null)\n"  # another device of the group is not locked
    host.release(GPU)
    unbind.returned()
    assert read.returned() == "vfio-pci\n"

    write(host, "bus/pci/drivers_probe", GPU)
    host.hold(GPU)  # a VM has it now
    unbind = Call(lambda: write(host, "bus/pci/drivers/vfio-pci/unbind", GPU))
    assert unbind.blocked()
    change = Call(lambda: write(host, f"bus/pci/devices/{GPU}/driver_override", "\n"))
    assert change.blocked()
    host.release(GPU)
    unbind.returned()
    change.returned()
    assert override(host, GPU) == "(null)\n"


def test_an_unbind_blocked_on_one_device_holds_up_no_write_of_another_driver(kernel):
    """Writes to the same control file wait for each other (FUSE's inode lock; the kernel's own
    notes say so), but a write blocked on one device holds up no other control file."""
    host = kernel.host
    with host.holding(GPU):
        unbind = Call(lambda: write(host, "bus/pci/drivers/nvidia/unbind", GPU))
        assert unbind.blocked()
        Call(lambda: write(host, "bus/pci/drivers/snd_hda_intel/unbind", AUDIO)).returned(timeout=BLOCKED)
        Call(lambda: write(host, f"bus/pci/devices/{AUDIO}/driver_override", "vfio-pci")).returned(timeout=BLOCKED)
        assert host.driver(AUDIO) == "" and unbind.is_alive()
    unbind.returned()


def test_a_holder_that_lets_go_when_asked_ends_the_unbind_by_itself(kernel):
    host = kernel.host
    host.hold(GPU, lets_go_after=0.5)  # QEMU hot-unplugs the device when vfio-pci asks
    unbind = Call(lambda: write(host, "bus/pci/drivers/nvidia/unbind", GPU))
    unbind.returned()
    assert unbind.took >= 0.5 and host.driver(GPU) == "" and not host.is_held(GPU)


def test_unbinding_from_a_driver_the_device_is_not_on_is_ENODEV(kernel):
    host = kernel.host
    assert refused(host, "bus/pci/drivers/snd_hda_intel/unbind", GPU) == errno.ENODEV
    assert refused(host, "bus/pci/drivers/nvidia/unbind", "0000:99:00.0") == errno.ENODEV
    assert host.driver(GPU) == "nvidia"


def test_a_fragile_device_falls_off_the_bus_when_unbound(kernel):
    host = kernel.host
    host.set_fragile(AUDIO)
    write(host, "bus/pci/drivers/snd_hda_intel/unbind", AUDIO)
    assert not os.path.lexists(host.sysfs / "bus/pci/devices" / AUDIO)
    assert not mounts_under(host.sysfs / "devices" / "pci0000:00" / "0000:00:03.0" / AUDIO)


def test_stopping_fails_the_writes_still_blocked(tmp_path):
    require_kernel(tmp_path)
    host = gpu_node(tmp_path)
    kernel = FakeKernel(host).start()
    host.hold(GPU)
    unbind = Call(lambda: write(host, "bus/pci/drivers/nvidia/unbind", GPU))
    assert unbind.blocked()
    kernel.stop()
    with pytest.raises(SysfsWriteError) as failed:
        unbind.returned()
    assert failed.value.errno == errno.EIO


# --- Probing and binding ----------------------------------------------------------------


def test_probing_with_an_override_naming_a_driver_not_loaded_leaves_the_device_without_one(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "nouveau")
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    write(host, "bus/pci/drivers_probe", GPU)  # succeeds
    assert host.driver(GPU) == ""


def test_binding_a_driver_other_than_the_override_is_ENODEV(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    assert refused(host, "bus/pci/drivers/nvidia/bind", GPU) == errno.ENODEV
    assert host.driver(GPU) == ""
    write(host, "bus/pci/drivers/vfio-pci/bind", GPU)
    assert host.driver(GPU) == "vfio-pci"


def test_binding_without_an_override_takes_only_a_driver_whose_ids_match(kernel):
    host = kernel.host
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    assert refused(host, "bus/pci/drivers/vfio-pci/bind", GPU) == errno.ENODEV  # vfio-pci has no IDs
    write(host, "bus/pci/drivers/nvidia/bind", GPU)
    assert host.driver(GPU) == "nvidia"


def test_binding_a_device_that_has_a_driver_is_EBUSY(kernel):
    assert refused(kernel.host, "bus/pci/drivers/nvidia/bind", GPU) == errno.EBUSY


def test_probing_or_binding_a_missing_device_is_ENODEV(kernel):
    assert refused(kernel.host, "bus/pci/drivers_probe", "0000:99:00.0") == errno.ENODEV
    assert refused(kernel.host, "bus/pci/drivers/nvidia/bind", "0000:99:00.0") == errno.ENODEV


def test_vfio_pci_does_not_take_a_device_without_an_iommu_group(tmp_path):
    require_kernel(tmp_path)
    host = FakeHost(tmp_path)
    host.add_device("0000:01:00.0", "10de", "2236", "030200", driver="nvidia")
    with FakeKernel(host):
        write(host, "bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci")
        write(host, "bus/pci/drivers/nvidia/unbind", "0000:01:00.0")
        write(host, "bus/pci/drivers_probe", "0000:01:00.0")  # the probe's failure is not the write's
        assert host.driver("0000:01:00.0") == ""
        assert refused(host, "bus/pci/drivers/vfio-pci/bind", "0000:01:00.0") == errno.EINVAL


def test_a_slow_probe_holds_the_device_lock(kernel):
    host = kernel.host
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    host.set_probe_time(GPU, 0.6)
    probe = Call(lambda: write(host, "bus/pci/drivers_probe", GPU))
    time.sleep(0.05)
    read = Call(lambda: override(host, GPU))
    assert read.blocked()
    probe.returned()
    assert read.returned() == "(null)\n" and host.driver(GPU) == "nvidia"


# --- /dev/vfio/<group> ----------------------------------------------------------------------


def test_the_group_node_exists_while_any_member_is_on_vfio_pci(kernel):
    host = kernel.host
    on_vfio(host, GPU, AUDIO)
    assert host.vfio_node(20).exists()
    write(host, "bus/pci/drivers/vfio-pci/unbind", GPU)
    assert host.vfio_node(20).exists()
    write(host, "bus/pci/drivers/vfio-pci/unbind", AUDIO)
    assert not host.vfio_node(20).exists() and sorted(os.listdir(host.dev / "vfio")) == ["vfio"]


def test_the_group_node_opens_once(kernel):
    host = kernel.host
    on_vfio(host, GPU, AUDIO)
    first = os.open(host.vfio_node(20), os.O_RDWR)
    with pytest.raises(OSError) as second:
        os.open(host.vfio_node(20), os.O_RDWR)
    assert second.value.errno == errno.EBUSY
    os.close(first)
    os.close(os.open(host.vfio_node(20), os.O_RDWR))  # free again once closed


def test_a_vmm_cannot_use_a_group_with_a_member_on_another_driver(kernel):
    host = kernel.host
    on_vfio(host, GPU)  # the audio function stays on snd_hda_intel

    def set_container() -> int:
        group = os.open(host.vfio_node(20), os.O_RDWR)  # opens: the group is there
        container = os.open(host.dev / "vfio" / "vfio", os.O_RDWR)
        try:
            fcntl.ioctl(group, VFIO_GROUP_SET_CONTAINER, struct.pack("i", container))
            return 0
        except OSError as e:
            return e.errno
        finally:
            os.close(container)
            os.close(group)

    assert set_container() == errno.EPERM
    write(host, "bus/pci/drivers/snd_hda_intel/unbind", AUDIO)
    assert set_container() == 0  # a member without a driver does not stop VFIO
    write(host, "bus/pci/drivers_probe", AUDIO)
    assert host.driver(AUDIO) == "snd_hda_intel" and set_container() == errno.EPERM
    on_vfio(host, AUDIO)
    assert set_container() == 0


# --- The fixture while a kernel runs ---------------------------------------------------------


def test_devices_and_drivers_added_while_it_runs_answer_at_once(tmp_path):
    require_kernel(tmp_path)
    host = FakeHost(tmp_path, vfio=False)
    with FakeKernel(host):
        host.add_device("0000:01:00.0", "15b3", "101d", "020000", driver="mlx5_core", iommu_group=3)
        host.load_vfio()
        on_vfio(host, "0000:01:00.0")
        assert host.driver("0000:01:00.0") == "vfio-pci" and host.vfio_node(3).exists()
        write(host, "bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
        assert not host.vfio_node(3).exists()
        host.remove_device("0000:01:00.0")  # its driver_override was a mount point
        assert not os.path.lexists(host.sysfs / "bus/pci/devices/0000:01:00.0")


def test_stopping_unmounts_everything_and_leaves_the_tree_as_the_kernel_left_it(tmp_path):
    require_kernel(tmp_path)
    host = gpu_node(tmp_path)
    with FakeKernel(host):
        drivers, devices = (os.listdir(host.sysfs / "bus/pci" / d) for d in ("drivers", "devices"))
        assert len(mounts_under(tmp_path)) == 3 + 2 * len(drivers) + len(devices)  # FUSE, dev/, drivers_probe
        on_vfio(host, GPU)
    assert mounts_under(tmp_path) == []
    assert override(host, GPU) == "vfio-pci\n" and host.driver(GPU) == "vfio-pci" and host.vfio_node(20).exists()


def test_a_discovery_reads_the_same_tree_through_the_kernels_mounts(tmp_path):
    require_kernel(tmp_path)
    host = synthetic_host(tmp_path, 40)
    ids = PciIds.load()
    plain = discover(host.sysfs, host.proc, ids).to_json()
    with FakeKernel(host):
        assert discover(host.sysfs, host.proc, ids).to_json() == plain


def test_fake_host_keeps_dev_vfio_in_step_with_its_bindings(tmp_path):
    host = synthetic_host(tmp_path, 12)  # A10s on vfio-pci at boot, as with vfio-pci.ids=
    bound = {host.iommu_group(a) for a in os.listdir(host.sysfs / "bus/pci/devices") if host.driver(a) == "vfio-pci"}
    assert bound and {int(n) for n in os.listdir(host.dev / "vfio") if n != "vfio"} == bound
    assert (host.dev / "vfio" / "vfio").exists()
    host.remove_device("0000:01:00.0")
    host.remove_device("0000:01:00.1")
    assert not host.vfio_node(1).exists()


def test_removing_a_bridge_removes_the_group_nodes_of_the_devices_behind_it(tmp_path):
    host = gpu_node(tmp_path)
    host.bind(GPU, "vfio-pci")
    assert host.vfio_node(20).exists()
    host.remove_device("0000:00:03.0")  # the root port the A10 sits behind
    assert not host.vfio_node(20).exists() and host.default_driver(GPU) is None


def test_runs_as_its_own_process_until_sigterm(tmp_path):
    require_kernel(tmp_path)
    host = gpu_node(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "e2e.fakekernel", str(tmp_path)], stderr=subprocess.PIPE,
                            env=env, text=True)  # fmt: skip
    try:
        assert "answering sysfs writes" in proc.stderr.readline()
        write(host, "bus/pci/drivers/nvidia/unbind", GPU)
        assert host.driver(GPU) == ""
        host.add_device("0000:3b:00.2", "10de", "1ad8", "0c0330", driver="xhci_hcd", iommu_group=20)
        assert refused(host, "bus/pci/drivers/xhci_hcd/bind", "0000:3b:00.2") == errno.EBUSY
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert mounts_under(tmp_path) == []
    finally:
        proc.kill()
        proc.wait()


# --- Where it may run ----------------------------------------------------------------------


def test_it_refuses_to_mount_in_a_namespace_it_shares_with_the_processes_that_started_it(tmp_path, monkeypatch):
    kernel = FakeKernel(gpu_node(tmp_path))
    monkeypatch.setattr(fakekernel.os, "readlink", lambda path: "mnt:[4026531832]")  # every process's
    problem = fakekernel.mount_namespace_problem(tmp_path)
    assert problem and "shares its mount namespace" in problem
    with pytest.raises(KernelUnavailable, match="unshare --mount --propagation private"):
        kernel.start()


def test_it_refuses_to_mount_below_a_shared_mount(tmp_path):
    require_kernel(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    probe = f"from e2e.fakekernel import mount_namespace_problem as p; print(p({str(tmp_path)!r}))"
    shared = subprocess.run(["unshare", "--mount", "--propagation", "shared", sys.executable, "-c", probe],
                            env=env, capture_output=True, text=True, check=True)  # fmt: skip
    assert "a shared mount" in shared.stdout
    private = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert private.stdout.strip() == "None"
