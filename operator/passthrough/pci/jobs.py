"""Which jobs the binder carries out: it judges each itself, as if whoever sent it were
compromised, since the binder may write the host's sysfs and the agent may not.

A job names an operation, an IOMMU group, its members and, for a give-back, the
`driver_override` each member had before. Everything else is the binder's own: the sysfs, /dev
and /proc it works on come from its command line (`Roots`), never from the job. Refused, with
nothing written:
- a job of another shape (unknown fields, roots among them; a timeout out of range);
- members that are not the group's whole set of non-bridge functions, as the host's sysfs
  lists it now (a group moves to vfio-pci whole, or not at all; a give-back may leave some
  where they are, an admin's pin, but names none outside the group);
- a bind of a device that discovery's rules keep from passthrough (`pci.discovery`,
  `pci.disks`): bus 00, bridges, a disk in use, an interface that is up, a PF with VFs, ...;
- a give-back that would set any `driver_override` but a cleared one or vfio-pci's: what the
  kernel's next probe would force on the device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from passthrough.pci import sysfs, vfio
from passthrough.pci.discovery import ADDRESS, discover
from passthrough.pci.pciids import PciIds
from passthrough.pci.sysfs import SysfsError
from passthrough.pci.vfio import BindError

OPS = ("bind", "release")
FIELDS = frozenset({"id", "op", "group", "members", "timeout", "overrides"})
MAX_TIMEOUT = 60.0  # seconds a step may be polled for; the agent asks for 5
MAX_MEMBERS = 256  # functions in one group: 8 per device, well past any real group
# What a give-back may leave in `driver_override`: cleared (the kernel's own match decides),
# or vfio-pci's (an admin's pin the agent found there).
OVERRIDES = frozenset({"", vfio.VFIO_DRIVER})


@dataclass(frozen=True)
class Roots:
    """The binder's own view of the host: from its command line."""

    sysfs: Path
    dev: Path
    proc: Path
    virtual_functions: bool = False  # the agent's --sriov-virtual-functions, as discovery takes it


@dataclass(frozen=True)
class Job:
    op: str
    group: int
    members: tuple[str, ...]
    timeout: float
    overrides: dict[str, str] = field(default_factory=dict)


class _Everything(Container[str]):
    """Every device counts as locked: the judge never reads a `driver_override`, which waits for
    a device lock that another job's blocked write may hold."""

    def __contains__(self, item: object) -> bool:
        return True


def refused(why: str) -> BindError:
    return BindError("JobRefused", f"the binder refused the job: {why}; nothing was written")


def judge(raw: Any, roots: Roots) -> Job:
    """The job in `raw` (a decoded JSON line), if the binder may carry it out; BindError (JobRefused,
    NotEligible or DeviceGone, nothing written) if not."""
    job = _shape(raw)
    for address in job.members:
        if not os.path.lexists(roots.sysfs / "bus" / "pci" / "devices" / address):
            raise BindError("DeviceGone", f"{address} is not a PCI device on this host (hot-unplugged?); nothing was "
                            "written: rescan")  # fmt: skip
    try:
        members = vfio.group_members(roots.sysfs, job.group)
    except SysfsError as exc:
        raise refused(f"the members of IOMMU group {job.group} cannot be read ({exc})") from None
    group = f"IOMMU group {job.group} is {', '.join(members) or 'no device but bridges'} (bridges stay with the host)"
    if job.op == "bind" and sorted(job.members) != sorted(members):
        raise refused(f"{group}, not {', '.join(job.members)}: a group moves to vfio-pci whole")
    strangers = sorted(set(job.members) - set(members))
    if strangers:  # a give-back may leave some members where they are (an admin's pin)
        raise refused(f"{group}: {', '.join(strangers)} are not in it")
    if job.op == "bind":
        _eligible(job, roots)
    return job


def _shape(raw: Any) -> Job:
    if not isinstance(raw, Mapping):
        raise refused("a job is a JSON object")
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        raise refused(f"it names {', '.join(map(repr, unknown))}, which a job may not (the binder works on the "
                      "sysfs, /dev and /proc of its own command line)")  # fmt: skip
    op, group, members, timeout = raw.get("op"), raw.get("group"), raw.get("members"), raw.get("timeout")
    if op not in OPS:
        raise refused(f"op is {str(op)[:40]!r}, not bind or release")
    if type(group) is not int or not 0 <= group < 2**31:
        raise refused(f"group is {str(group)[:40]!r}, not an IOMMU group number")
    if (not isinstance(members, list) or not 0 < len(members) <= MAX_MEMBERS
            or not all(isinstance(a, str) and ADDRESS.fullmatch(a) for a in members) or len(set(members)) != len(members)):  # fmt: skip
        raise refused(f"members are {str(members)[:80]!r}, not distinct PCI addresses like 0000:3b:00.0")
    if type(timeout) not in (int, float) or not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT):
        raise refused(f"timeout is {str(timeout)[:40]!r}, not a number of seconds in (0, {MAX_TIMEOUT:g}]")
    overrides = raw.get("overrides") or {}
    if op == "bind" and overrides:
        raise refused("a bind takes no overrides: it writes vfio-pci's")
    if not isinstance(overrides, Mapping) or not all(isinstance(a, str) and isinstance(o, str) for a, o in overrides.items()):
        raise refused("overrides are an object of addresses to driver names")
    strangers = sorted(set(overrides) - set(members))
    if strangers:
        raise refused(f"overrides name {', '.join(s[:20] for s in strangers)}, which are not members of the job")
    for address, override in overrides.items():
        if override not in OVERRIDES:
            raise refused(f"the override for {address} is {override[:40]!r}{'...' if len(override) > 40 else ''}: a "
                          "give-back leaves driver_override cleared or vfio-pci, since the kernel forces whatever driver "
                          "it names on the device (set another one by hand: driverctl set-override)")  # fmt: skip
    return Job(op, group, tuple(members), float(timeout), dict(overrides))


def _eligible(job: Job, roots: Roots) -> None:
    """Discovery's verdict on each member, read now from the binder's own roots."""
    # The group's devices only (bridges too: the group rule reads them): a bind's deadline counts this.
    listing = roots.sysfs / "kernel" / "iommu_groups" / str(job.group) / "devices"
    found = discover(roots.sysfs, roots.proc, PciIds(), _Everything(), virtual_functions=roots.virtual_functions,
                     only=frozenset(sysfs.entries(listing)))  # fmt: skip
    devices = {d.address: d for d in found.devices}
    for address in job.members:
        device = devices.get(address)
        if device is None:
            raise BindError("DeviceGone", f"{address} is not a PCI device on this host; nothing was written")
        if not device.eligible:
            why = device.reason or ("the agent leaves it out" if not device.reported else "it is not eligible")
            raise BindError("NotEligible", f"the binder refused to move {address} to vfio-pci: {why}; nothing was written")
