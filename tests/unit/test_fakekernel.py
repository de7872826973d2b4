"""The simulated kernel answers sysfs writes as the kernel does, so the bind sequence is tested
against something that behaves, not against files that only hold what was written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from e2e.fakekernel import FakeKernel
from e2e.fakesysfs import FakeHost, gpu_node, synthetic_host
from passthrough.pci import sysfs

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[FakeKernel]:
    with FakeKernel(gpu_node(tmp_path)) as kernel:
        yield kernel


def write(host: FakeHost, relative: str, text: str) -> None:
    sysfs.write_text(host.sysfs / relative, text)


def eventually(check: Callable[[], bool], timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def test_a_blank_driver_override_write_clears_it_to_null(kernel):
    host = kernel.host
    override = host.device_dir(GPU) / "driver_override"
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    kernel.sync()
    assert override.read_text().strip() == "vfio-pci"
    write(host, f"bus/pci/devices/{GPU}/driver_override", "\n")
    kernel.sync()
    assert override.read_text() == "(null)\n"


def test_unbind_then_probe_binds_the_override_or_else_the_default_driver(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "vfio-pci")
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    kernel.sync()
    assert host.driver(GPU) == "" and not (host.sysfs / "bus/pci/drivers/nvidia" / GPU).exists()
    write(host, "bus/pci/drivers_probe", GPU)
    kernel.sync()
    assert host.driver(GPU) == "vfio-pci" and host.vfio_node(20).exists()
    write(host, f"bus/pci/devices/{GPU}/driver_override", "\n")
    write(host, "bus/pci/drivers/vfio-pci/unbind", GPU)
    write(host, "bus/pci/drivers_probe", GPU)
    kernel.sync()
    assert host.driver(GPU) == "nvidia" and not host.vfio_node(20).exists()


def test_a_control_file_is_consumed_so_the_same_write_is_seen_again(kernel):
    host = kernel.host
    for _ in range(3):
        write(host, "bus/pci/drivers/nvidia/unbind", GPU)
        kernel.sync()
        assert host.driver(GPU) == ""
        assert (host.sysfs / "bus/pci/drivers/nvidia/unbind").read_text() == ""
        write(host, "bus/pci/drivers/nvidia/bind", GPU)
        kernel.sync()
        assert host.driver(GPU) == "nvidia"


def test_an_override_naming_a_driver_not_loaded_leaves_the_device_driverless(kernel):
    host = kernel.host
    write(host, f"bus/pci/devices/{GPU}/driver_override", "nouveau")
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    write(host, "bus/pci/drivers_probe", GPU)
    write(host, "bus/pci/drivers/nvidia/bind", GPU)  # another driver than the override: no match
    kernel.sync()
    assert host.driver(GPU) == ""


def test_vfio_pci_does_not_take_a_device_without_an_iommu_group(tmp_path):
    host = FakeHost(tmp_path)
    host.add_device("0000:01:00.0", "10de", "2236", "030200", driver="nvidia")
    with FakeKernel(host) as kernel:
        write(host, "bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci")
        write(host, "bus/pci/drivers/nvidia/unbind", "0000:01:00.0")
        write(host, "bus/pci/drivers_probe", "0000:01:00.0")
        kernel.sync()
    assert host.driver("0000:01:00.0") == ""


def test_the_group_node_exists_while_any_member_is_on_vfio_pci(kernel):
    host = kernel.host
    for address in (GPU, AUDIO):
        write(host, f"bus/pci/devices/{address}/driver_override", "vfio-pci")
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    write(host, "bus/pci/drivers/snd_hda_intel/unbind", AUDIO)
    kernel.sync()
    for address in (GPU, AUDIO):
        write(host, "bus/pci/drivers_probe", address)
        kernel.sync()
    assert host.vfio_node(20).exists()
    write(host, "bus/pci/drivers/vfio-pci/unbind", GPU)
    kernel.sync()
    assert host.vfio_node(20).exists()
    write(host, "bus/pci/drivers/vfio-pci/unbind", AUDIO)
    kernel.sync()
    assert not host.vfio_node(20).exists()


def test_a_busy_device_stays_bound_though_the_unbind_write_is_accepted(kernel):
    host = kernel.host
    host.set_busy(GPU)
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    kernel.sync()
    assert host.driver(GPU) == "nvidia"
    host.set_busy(GPU, False)
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    kernel.sync()
    assert host.driver(GPU) == ""


def test_a_fragile_device_falls_off_the_bus_when_unbound(kernel):
    host = kernel.host
    host.set_fragile(AUDIO)
    write(host, "bus/pci/drivers/snd_hda_intel/unbind", AUDIO)
    kernel.sync()
    assert not os.path.lexists(host.sysfs / "bus/pci/devices" / AUDIO)
    assert not kernel.errors


def test_devices_and_drivers_that_appear_after_start_are_watched(tmp_path):
    host = FakeHost(tmp_path, vfio=False)
    with FakeKernel(host) as kernel:
        host.add_device("0000:01:00.0", "15b3", "101d", "020000", driver="mlx5_core", iommu_group=3)
        host.load_vfio()
        kernel.sync()  # the new device and driver are watched once their creation is seen
        write(host, "bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci")
        write(host, "bus/pci/drivers/mlx5_core/unbind", "0000:01:00.0")
        write(host, "bus/pci/drivers_probe", "0000:01:00.0")
        kernel.sync()
        assert host.driver("0000:01:00.0") == "vfio-pci" and host.vfio_node(3).exists()
        write(host, "bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
        kernel.sync()
        assert not host.vfio_node(3).exists()


def test_writes_made_before_start_take_effect_at_start(tmp_path):
    host = gpu_node(tmp_path)
    write(host, "bus/pci/drivers/nvidia/unbind", GPU)
    with FakeKernel(host) as kernel:
        kernel.sync()
        assert host.driver(GPU) == ""


def test_fake_host_keeps_dev_vfio_in_step_with_its_bindings(tmp_path):
    host = synthetic_host(tmp_path, 12)  # A10s on vfio-pci at boot, as with vfio-pci.ids=
    bound = {host.iommu_group(a) for a in os.listdir(host.sysfs / "bus/pci/devices") if host.driver(a) == "vfio-pci"}
    assert bound and {int(n) for n in os.listdir(host.dev / "vfio") if n != "vfio"} == bound
    assert (host.dev / "vfio" / "vfio").exists()
    host.remove_device("0000:01:00.0")
    host.remove_device("0000:01:00.1")
    assert not host.vfio_node(1).exists()


def test_runs_as_its_own_process_until_sigterm(tmp_path):
    host = gpu_node(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "e2e.fakekernel", str(tmp_path)], stderr=subprocess.PIPE,
                            env=env, text=True)  # fmt: skip
    try:
        assert "answering sysfs writes" in proc.stderr.readline()
        write(host, "bus/pci/drivers/nvidia/unbind", GPU)
        assert eventually(lambda: host.driver(GPU) == "")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait()


def test_removing_a_bridge_removes_the_group_nodes_of_the_devices_behind_it(tmp_path):
    host = gpu_node(tmp_path)
    host.bind(GPU, "vfio-pci")
    assert host.vfio_node(20).exists()
    host.remove_device("0000:00:03.0")  # the root port the A10 sits behind
    assert not host.vfio_node(20).exists() and host.default_driver(GPU) is None
