"""The binder judges each job itself (`pci.jobs`), over its own roots: the shape, the whole
group, discovery's eligibility; and its writes reach only the bind files, never through a
symlink (`sysfs.confine`). The real-kernel test (tests/realkernel/test_binder_confines.py) plays
the compromised agent against a guest; these cover every rule on fake trees."""

from __future__ import annotations

import pytest

from e2e.fakesysfs import gpu_node, storage_node
from passthrough.pci import jobs, sysfs
from passthrough.pci.jobs import Roots
from passthrough.pci.sysfs import SysfsWriteError
from passthrough.pci.vfio import BindError

GPU, AUDIO = "0000:3b:00.0", "0000:3b:00.1"
ETH0, ETH1, NVME = "0000:18:00.0", "0000:18:00.1", "0000:3d:00.0"


def roots(host) -> Roots:
    return Roots(host.sysfs, host.dev, host.proc)


def job(op="bind", group=20, members=(GPU, AUDIO), **more) -> dict:
    return {"id": 7, "op": op, "group": group, "members": list(members), "timeout": 5, **more}


def refusal(raw, host) -> BindError:
    with pytest.raises(BindError) as e:
        jobs.judge(raw, roots(host))
    assert "nothing was written" in str(e.value)
    return e.value


def test_a_whole_eligible_group_is_accepted(tmp_path):
    host = gpu_node(tmp_path)
    assert jobs.judge(job(), roots(host)) == jobs.Job("bind", 20, (GPU, AUDIO), 5.0, {})
    release = jobs.judge(job("release", overrides={GPU: "", AUDIO: "vfio-pci"}), roots(host))
    assert release.overrides == {GPU: "", AUDIO: "vfio-pci"}
    # A give-back of the agent's own members of a group leaves the rest (an admin's pin) alone.
    assert jobs.judge(job("release", members=[AUDIO]), roots(host)).members == (AUDIO,)


@pytest.mark.parametrize(
    "raw, says",
    [
        (["bind"], "a JSON object"),
        (job(sysfs="/tmp/planted", dev="/dev"), "'dev', 'sysfs'"),
        (job(op="remove"), "not bind or release"),
        (job(group=True), "not an IOMMU group number"),
        (job(group=-1), "not an IOMMU group number"),
        (job(members=[GPU, GPU]), "distinct PCI addresses"),
        (job(members=["../../devices/x"]), "distinct PCI addresses"),
        (job(members=[]), "distinct PCI addresses"),
        (job(timeout=float("inf")), "seconds in (0, 60]"),
        (job(timeout="5"), "seconds in (0, 60]"),
        (job(overrides={GPU: "vfio-pci"}), "a bind takes no overrides"),
        (job("release", overrides={GPU: "nvme"}), "'nvme'"),
        (job("release", overrides={GPU: "x" * 3016}), "cleared or vfio-pci"),
        (job("release", overrides={GPU: "vfio-pci\n"}), "cleared or vfio-pci"),
        (job("release", overrides={"0000:af:00.0": ""}), "not members of the job"),
        (job(members=[GPU]), "a group moves to vfio-pci whole"),
        (job(group=21), "a group moves to vfio-pci whole"),
        (job("release", group=21), "0000:3b:00.0, 0000:3b:00.1 are not in it"),
    ],
)
def test_a_job_of_another_shape_is_refused(tmp_path, raw, says):
    error = refusal(raw, gpu_node(tmp_path))
    assert error.reason == "JobRefused" and says in str(error), error


def test_a_device_that_is_not_there_is_gone(tmp_path):
    error = refusal(job(members=["0000:ff:00.0"]), gpu_node(tmp_path))
    assert error.reason == "DeviceGone"


@pytest.mark.parametrize("address, group, says", [(ETH0, 30, "network interface eth0 is up"),
                                                  (NVME, 32, "mounted")])  # fmt: skip
def test_a_device_in_use_is_not_moved(tmp_path, address, group, says):
    host = storage_node(tmp_path)
    host.mount("nvme0n1p2", "/srv")
    error = refusal(job(group=group, members=[address]), host)
    assert error.reason == "NotEligible" and says in str(error), error
    assert jobs.judge(job(group=31, members=[ETH1]), roots(host)).members == (ETH1,)  # the free port moves
    # Given back is another matter: nothing in use is touched by it, and it is allowed.
    assert jobs.judge(job("release", group=group, members=[address]), roots(host)).op == "release"


def test_a_device_the_agent_leaves_out_is_not_moved(tmp_path):
    host = gpu_node(tmp_path)
    host.add_device("0000:00:1f.2", "8086", "2922", "010601", driver="ahci", iommu_group=5)  # the chipset's SATA
    error = refusal(job(group=5, members=["0000:00:1f.2"]), host)
    assert error.reason == "NotEligible" and "bus 00" in str(error), error
    assert "no device but bridges" in str(refusal(job(group=0, members=["0000:00:00.0"]), host))


def test_a_confined_process_writes_only_the_bind_files_below_its_root_and_through_no_symlink(tmp_path, monkeypatch):
    host = gpu_node(tmp_path / "host")
    monkeypatch.setattr(sysfs, "_beneath", None)
    sysfs.confine(host.sysfs)
    device = host.sysfs / "bus" / "pci" / "devices" / GPU
    sysfs.write_text(device / "driver_override", "vfio-pci")  # through the bus's link to the device tree
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "driver_override").symlink_to(victim)
    for path in (planted / "driver_override", device / "remove", device / "config", host.sysfs / ".." / "victim"):
        with pytest.raises(SysfsWriteError):
            sysfs.write_text(path, "1")
    # A symlink in the root itself, where an attribute should be: not followed either.
    (device / "driver_override").unlink()
    (device / "driver_override").symlink_to(victim)
    with pytest.raises(SysfsWriteError) as e:
        sysfs.write_text(device / "driver_override", "vfio-pci")
    assert e.value.errno is not None  # ELOOP: the kernel's refusal of O_NOFOLLOW
    assert victim.read_text() == "untouched"


def test_a_group_with_a_member_in_use_is_not_moved(tmp_path):
    host = gpu_node(tmp_path)
    host.add_netdev(AUDIO, "eth9", up=True)  # whatever it is, the group's other function is in use
    error = refusal(job(), host)
    assert error.reason == "NotEligible" and "eth9 is up" in str(error), error
