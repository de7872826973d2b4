"""The binder confines a compromised agent, on a real kernel: `passthrough binder --listen` runs
bare in the guest over its own /sys, /dev and /proc, and the test writes jobs to its socket as
an agent that does what it likes would. Each forbidden job is refused with its reason, and
nothing is touched: every driver, `driver_override`, the mount, the interface and a file a
symlink points at are as they were. A job the binder may do is done, on the same socket.
"""

from __future__ import annotations

import json

import pytest

from e2e.guest.machine import address
from e2e.guest.node import drivers, wait

EDU_FN, NIC_FN, NVME_FN = address("edu"), address("nic"), address("nvme")
DISPLAY_FN, AUDIO_FN = address("gpu", 0), address("gpu", 1)
SOCKET = "/run/rk-binder/binder.sock"
BB = "/run/rk/busybox"  # the guest's root is the host's, which has no kmod
MOUNTED = "/run/rk-nvme"
VICTIM = "/run/rk-victim"  # a regular file a planted symlink points at

_ASK = """
import json, socket
with socket.socket(socket.AF_UNIX) as s:
    s.connect(args['path'])
    f = s.makefile('rwb')
    hello = json.loads(f.readline())
    answers = []
    for line in args['lines']:
        f.write(line.encode() + b'\\n'); f.flush()
        answers.append(json.loads(f.readline()))
result = {'hello': hello, 'answers': answers}
"""
_LOOK = """
import os
def read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f'<{e.strerror}>'
devices = '/sys/bus/pci/devices'
result = {
    'drivers': {a: os.path.basename(os.readlink(f'{devices}/{a}/driver')) if os.path.lexists(f'{devices}/{a}/driver') else ''
                for a in sorted(os.listdir(devices))},
    'overrides': {a: read(f'{devices}/{a}/driver_override') for a in sorted(os.listdir(devices))},
    'marker': read(args['marker']),
    'victim': read(args['victim']),
    'flags': read(f"/sys/class/net/{args['nic']}/flags"),
}
"""


def ask(guest, *jobs) -> list[dict]:
    """Write each job (a dict, or a raw line) to the binder's socket; its answers."""
    lines = [job if isinstance(job, str) else json.dumps(job) for job in jobs]
    answer = guest.python(_ASK, path=SOCKET, lines=lines, timeout=600)
    assert answer["hello"] == {"ready": True}
    return answer["answers"]


def group_of(guest, address_: str) -> tuple[int, list[str]]:
    """The IOMMU group of `address_` and its members but bridges (they stay with the host), as the
    guest's sysfs lists them."""
    group = int(guest.sh(f"basename $(readlink /sys/bus/pci/devices/{address_}/iommu_group)").stdout)
    listing = f"/sys/kernel/iommu_groups/{group}/devices"
    members = guest.sh(f"for d in {listing}/*; do case $(cat $d/class) in 0x06*) ;; *) basename $d;; esac; done").stdout.split()
    return group, members


def job(op: str, group: int, members: list[str], **more) -> dict:
    return {"id": 1, "op": op, "group": group, "members": members, "timeout": 5, **more}


@pytest.fixture(scope="module")
def binder(guest):
    """The binder bare in the guest, a disk of the NVMe mounted, the e1000e's interface up."""
    # ext4 needs a crc32c, which nothing in the guest has loaded.
    guest.sh(f"{BB} modprobe -a ext4 crc32c_generic && mkfs.ext4 -q -F /dev/nvme0n1 && mkdir -p {MOUNTED} && "
             f"{BB} mount -t ext4 /dev/nvme0n1 {MOUNTED} && echo written-before > {MOUNTED}/marker && sync")  # fmt: skip
    nic = guest.sh(f"ls /sys/bus/pci/devices/{NIC_FN}/net").stdout.split()[0]
    guest.sh(f"{BB} ip link set {nic} up && echo untouched > {VICTIM}")
    proc = guest.spawn("rk-binder", [str(guest.python_path), "-m", "passthrough.cli", "binder", f"--listen={SOCKET}",
                                     "--sysfs-root=/sys", "--dev-root=/dev", "--proc-root=/proc"])  # fmt: skip
    wait(lambda: guest.run("test", "-S", SOCKET, check=False).rc == 0 or proc.poll() is not None, 120,
         "the binder's socket")  # fmt: skip
    assert proc.poll() is None, proc.output()
    try:
        yield {"nic": nic, "process": proc}
    finally:
        proc.stop()
        guest.sh(f"{BB} umount {MOUNTED}; {BB} ip link set {nic} down", check=False)


def refuse(guest, binder, forbidden: dict, before: dict) -> None:
    """Each job refused with its reason and what it says, and the host as it was `before`."""
    answers = ask(guest, *(j for j, _, _ in forbidden.values()))
    for (what, (_, reason, says)), answer in zip(forbidden.items(), answers):
        assert answer.get("reason") == reason and says in answer.get("message", ""), (what, answer)
        assert answer["moved"] == {} and "writes" not in answer, (what, answer)
    assert look(guest, binder) == before, "a refused job touched the host"


def look(guest, binder) -> dict:
    return guest.python(_LOOK, marker=f"{MOUNTED}/marker", victim=VICTIM, nic=binder["nic"])


def test_forbidden_jobs_are_refused_with_nothing_touched(guest, binder):
    before = look(guest, binder)
    assert before["marker"] == "written-before" and int(before["flags"], 16) & 1, before
    nvme_group, nvme_members = group_of(guest, NVME_FN)
    nic_group, nic_members = group_of(guest, NIC_FN)
    gpu_group, _ = group_of(guest, DISPLAY_FN)
    edu_group, edu_members = group_of(guest, EDU_FN)
    bus00 = next(a for a, d in before["drivers"].items() if a.startswith("0000:00:") and d == "ahci")
    ahci_group, ahci_members = group_of(guest, bus00)

    # A sysfs root of the job's own, whose driver_override is a symlink to a regular file.
    planted = f"/run/rk-planted/bus/pci/devices/{EDU_FN}"
    guest.sh(f"mkdir -p {planted} && ln -sf {VICTIM} {planted}/driver_override && "
             f"mkdir -p /run/rk-planted/bus/pci/drivers && ln -sf {VICTIM} /run/rk-planted/bus/pci/drivers_probe")  # fmt: skip

    forbidden = {
        "a mounted NVMe": (job("bind", nvme_group, nvme_members), "NotEligible", "mounted"),
        "a NIC whose link is up": (job("bind", nic_group, nic_members), "NotEligible", "is up"),
        "the bus-00 AHCI controller": (job("bind", ahci_group, ahci_members), "NotEligible", "bus 00"),
        "one function of a two-function group": (job("bind", gpu_group, [DISPLAY_FN]), "JobRefused", "whole"),
        "a sysfs root the job names": (job("bind", edu_group, edu_members, sysfs="/run/rk-planted", dev="/dev"),
                                       "JobRefused", "'dev', 'sysfs'"),
        "an op of its own": (job("remove", edu_group, edu_members), "JobRefused", "not bind or release"),
        "a line that is no job": ("rm -rf /", "JobRefused", "a JSON object"),
    }  # fmt: skip
    refuse(guest, binder, forbidden, before)
    assert guest.sh(f"cat {MOUNTED}/marker && echo after > {MOUNTED}/again && sync && cat {MOUNTED}/again").stdout.split() == [
        "written-before", "after"], "the mounted disk stays usable"  # fmt: skip

    # What the binder may do, it does, on the same socket: the edu group to vfio-pci.
    (bound,) = ask(guest, job("bind", edu_group, edu_members))
    assert "reason" not in bound and bound["writes"] >= 2, bound
    on_vfio = look(guest, binder)
    assert on_vfio["drivers"][EDU_FN] == "vfio-pci" and on_vfio["overrides"][EDU_FN] == "vfio-pci", on_vfio
    # Given back, the kernel forces whatever driver_override names on the device: only cleared or vfio-pci.
    overrides = {
        "nvme as an override": (job("release", edu_group, edu_members, overrides={EDU_FN: "nvme"}), "JobRefused", "'nvme'"),
        "a 3,016-character override": (job("release", edu_group, edu_members, overrides={EDU_FN: "x" * 3016}),
                                       "JobRefused", "cleared or vfio-pci"),
        "an override of another device": (job("release", edu_group, edu_members, overrides={NVME_FN: "vfio-pci"}),
                                          "JobRefused", "not members of the job"),
    }  # fmt: skip
    refuse(guest, binder, overrides, on_vfio)
    (given,) = ask(guest, job("release", edu_group, edu_members, overrides={EDU_FN: ""}))
    assert "reason" not in given, given
    assert look(guest, binder) == before
    print(f"\nrefused {len(forbidden) + len(overrides)} forbidden jobs with nothing touched; bound and gave back {EDU_FN}")
