"""A served device is healthy only while its whole IOMMU group is usable and the device itself
answers: present, config space not 0xffff, link up, no new AER errors."""

from __future__ import annotations

from e2e.fakesysfs import gpu_node
from passthrough.pci.health import Health

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
GROUP = 20
AER = "ERR_COR 0\nTOTAL_ERR_FATAL {fatal}\n"


def on_vfio(host) -> None:
    for address in (GPU, AUDIO):
        host.bind(address, "vfio-pci")


def test_a_whole_group_on_vfio_pci_with_its_node_is_healthy(tmp_path):
    host = gpu_node(tmp_path)
    health = Health(host.sysfs, host.dev)
    assert "not viable" in health.problem(GPU, GROUP)  # on nvidia and snd_hda_intel
    on_vfio(host)
    assert health.problem(GPU, GROUP) == ""


def test_a_device_that_vanished_is_unhealthy(tmp_path):
    host = gpu_node(tmp_path)
    on_vfio(host)
    health = Health(host.sysfs, host.dev)
    host.remove_device(GPU)
    assert "vanished from the bus" in health.problem(GPU, GROUP)


def test_config_space_of_all_ones_means_the_device_fell_off_the_bus(tmp_path):
    host = gpu_node(tmp_path)
    on_vfio(host)
    health = Health(host.sysfs, host.dev)
    (host.device_dir(AUDIO) / "config").write_bytes(b"\xde\x10\xef\x1a" + bytes(60))
    assert health.problem(GPU, GROUP) == ""
    (host.device_dir(AUDIO) / "config").write_bytes(b"\xff" * 64)  # a sibling dead takes the group
    assert health.problem(GPU, GROUP) == (
        "0000:3b:00.1 reads 0xffff from its config space: it fell off the bus (link down, or the device died)")  # fmt: skip


def test_a_link_that_went_down_is_unhealthy(tmp_path):
    host = gpu_node(tmp_path)
    on_vfio(host)
    health = Health(host.sysfs, host.dev)
    (host.device_dir(GPU) / "current_link_width").write_text("16\n")
    assert health.problem(GPU, GROUP) == ""
    (host.device_dir(GPU) / "current_link_width").write_text("0\n")
    assert "PCIe link is down" in health.problem(GPU, GROUP)


def test_new_aer_errors_make_it_unhealthy_for_the_hold_time(tmp_path, monkeypatch):
    host = gpu_node(tmp_path)
    on_vfio(host)
    now = [1000.0]
    monkeypatch.setattr("passthrough.pci.health.time.monotonic", lambda: now[0])
    health = Health(host.sysfs, host.dev, aer_hold=60)
    counters = host.device_dir(GPU) / "aer_dev_fatal"
    counters.write_text(AER.format(fatal=2))  # errors from before the agent looked: the baseline
    assert health.problem(GPU, GROUP) == ""
    counters.write_text(AER.format(fatal=3))
    assert health.problem(GPU, GROUP) == (
        "0000:3b:00.0 reported 1 new fatal AER error(s) (aer_dev_fatal 3); it counts as unhealthy for 60 s after the last one")  # fmt: skip
    now[0] += 30
    assert health.problem(GPU, GROUP) != ""
    now[0] += 31
    assert health.problem(GPU, GROUP) == ""
