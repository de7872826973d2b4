"""Moves whole IOMMU groups to vfio-pci and gives them back through sysfs, and tells whether a
bound group is usable: the host side of passthrough.

On a real kernel a write is done when write(2) returns, except one that cannot be: unbinding a
device that someone holds (a VMM with `/dev/vfio/<group>` open, the NVIDIA driver with a CUDA
process or nvidia-persistenced) blocks until the holder lets go, and vfio-pci asks a VMM to let
go by hot-unplugging the device from its guest. Unbind never refuses. So these functions never
unbind what is held (they look first: `held_by_process`, `vendor_users`; what they cannot tell is
left alone), and they run in the agent's binder process (`pci.binder`), where a write that blocks
anyway cannot stop the agent.

Choices:
- `bind_group` is all or nothing: when a member fails, the members this call changed go back
  to the driver they had (and their old `driver_override`), and the error says it was rolled
  back - or, if that failed too, which device is left where.
- `release_group` gives back all it can and does not roll back (putting devices back on
  vfio-pci would not help whoever asked for them). A device that no driver claims after the
  re-probe (a GPU on a node without the NVIDIA driver, as passthrough nodes often are) is left
  driverless, and that is success: it is off vfio-pci, which is all a release promises. A
  device that vanished has nothing left to give back and is no failure either.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from passthrough.pci import overrides, sysfs
from passthrough.pci.discovery import BRIDGE_CLASS, vfio_available
from passthrough.pci.sysfs import SysfsError, SysfsWriteError

VFIO_DRIVER = "vfio-pci"
PORT_DRIVER = "pcieport"
_NOT_LOADED = "vfio-pci is not loaded on this node: modprobe vfio-pci (and add it to /etc/modules-load.d)"
# Drivers whose remove waits for their users (nvidia-persistenced, CUDA processes) when a GPU is
# unbound: a device on one of them moves to vfio-pci only while the driver has no user.
VENDOR_DRIVERS = frozenset({"nvidia"})


def prepare_node_hint(address: str, vendor_device: str) -> str:
    """How an admin hands a GPU to vfio-pci at boot, before its vendor driver has users."""
    return (
        f"prepare the node instead: bind it to vfio-pci at boot (vfio-pci.ids={vendor_device} on the kernel "
        f"command line, or `driverctl set-override {address} vfio-pci`), or, with NVIDIA's GPU Operator, "
        "label the node nvidia.com/gpu.workload.config=vm-passthrough"
    )


class BindError(Exception):
    """Why a group could not be bound or given back. `reason`, in CamelCase, is one of:

    VfioNotLoaded, DeviceGone, NotInGroup, VendorDriverInUse, HeldByProcess, HeldUnknown, BindFailed,
    VfioDeviceMissing, GiveBackFailed (and WriteBlocked, from `pci.binder`). The message says
    what to do.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def group_members(sysfs_root: Path, group: int) -> list[str]:
    """The addresses in IOMMU group `group` that are not bridges (bridges stay with the host).

    SysfsError when a member's class cannot be read: it cannot be told from a bridge.
    """
    listing = Path(sysfs_root) / "kernel" / "iommu_groups" / str(group) / "devices"
    members = []
    for address in sysfs.entries(listing):
        try:
            class_code = sysfs.read_hex(listing / address / "class", 6)
        except SysfsError:
            if not (listing / address).exists():
                continue  # it vanished while being listed
            raise
        if not class_code.startswith(BRIDGE_CLASS):
            members.append(address)
    return members


def _driver_name(sysfs_root: Path, address: str) -> str | None:
    """The device's driver, "" when none, None when the device is gone (`sysfs.driver_of`)."""
    return sysfs.driver_of(Path(sysfs_root) / "bus" / "pci" / "devices" / address)


def state(sysfs_root: Path, address: str) -> tuple[str | None, str]:
    """A device's driver (as `_driver_name`) and `driver_override` ("" when unset). Reading the
    override waits for the device lock: not for the agent's own process."""
    return _driver_name(sysfs_root, address), overrides.read(Path(sysfs_root) / "bus" / "pci" / "devices" / address)


def group_problem(sysfs_root: Path, dev_root: Path, group: int) -> str:
    """Why IOMMU group `group` cannot be handed to a VMM now; "" when it can.

    The kernel's viability rule: every member is on vfio-pci, or is a PCIe port on pcieport
    or without a driver (a group with one member on another driver opens, but a VMM gets
    EPERM when it uses it). And `/dev/vfio/<group>` must be there. Readlinks and a stat only:
    cheap enough to poll, and never behind a device lock.
    """
    listing = os.path.join(sysfs_root, "kernel", "iommu_groups", str(group), "devices")
    try:
        members = sorted(os.listdir(listing))
    except OSError:
        return f"IOMMU group {group} is gone"
    for address in members:
        driver = _driver_name(sysfs_root, address)
        if driver is None or driver == VFIO_DRIVER:
            continue  # a member that left the group takes nothing from it
        if driver in ("", PORT_DRIVER) and _is_bridge(listing, address):
            continue
        return (
            f"IOMMU group {group} is not viable: {address} is on {driver or 'no driver'}, not vfio-pci "
            "(a VMM would get EPERM)"
        )
    node = os.path.join(dev_root, "vfio", str(group))
    if not os.path.exists(node):
        return f"{node} is missing"
    return ""


def _is_bridge(listing: str, address: str) -> bool:
    try:
        return sysfs.read_hex(Path(listing) / address / "class", 6).startswith(BRIDGE_CLASS)
    except SysfsError:
        return False


def device_healthy(sysfs_root: Path, dev_root: Path, address: str, group: int) -> bool:
    """On vfio-pci, and its whole group usable (`group_problem`)."""
    return _driver_name(sysfs_root, address) == VFIO_DRIVER and not group_problem(sysfs_root, dev_root, group)


def iommufd_device(sysfs_root: Path, dev_root: Path, address: str) -> str:
    """The device's iommufd character device (`vfio<N>`), only when both it and `/dev/iommu`
    exist: a kernel without them must not be handed paths that are not there (KubeVirt 1.9.0's
    IOMMUFD gate broke on such kernels).

    `/dev/iommu` is known by the kernel's record of it, the misc device `iommu` in sysfs: the
    chart's agent sees the host's /sys and /dev/vfio, not the host's whole /dev (a read-only bind
    of /dev would still let it write the device nodes its device cgroup allows, the host's
    terminals among them). The runtime makes the node in the VMM's container from the host's."""
    try:
        names = sorted(os.listdir(os.path.join(sysfs_root, "bus", "pci", "devices", address, "vfio-dev")))
    except OSError:
        return ""
    if not (os.path.exists(os.path.join(dev_root, "iommu")) or os.path.exists(os.path.join(sysfs_root, "class", "misc", "iommu"))):
        return ""
    return next((n for n in names if os.path.exists(os.path.join(dev_root, "vfio", "devices", n))), "")


def held_by_process(sysfs_root: Path, dev_root: Path, group: int, addresses: list[str]) -> str:
    """What holds IOMMU group `group` (members `addresses`), "" when nothing does. Two signals,
    either of which means held:

    - A member's `enable` count above zero. vfio-pci enables a device (pci_enable_device) when a
      user opens it, through its group or its iommufd character device, and disables it at the
      last close. A read-only sysfs file: a container whose device cgroup lacks
      `/dev/vfio/<group>` (the chart's binder) reads it, and it sees a user of iommufd, who never
      opens the group node.
    - `/dev/vfio/<group>` is open: the kernel lets one open it at a time, so our open is EBUSY.

    Nothing holds it when the group node opened (and was closed at once), or when every
    member's count was read and is zero. Neither (the node refused as the device cgroup refuses
    it, EPERM, and a count unreadable): BindError HeldUnknown, never "not held", since an unbind
    of a held device pulls it out from under its VM.
    """
    node = os.path.join(dev_root, "vfio", str(group))
    refused = 0  # the open's errno when it neither opened nor found the group taken
    try:
        os.close(os.open(node, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK))
    except OSError as e:
        if e.errno == errno.EBUSY:
            return f"/dev/vfio/{group} is open"
        if not (e.errno == errno.ENOENT and os.path.isdir(os.path.dirname(node))):
            refused = e.errno or errno.EIO  # ENOENT beside the host's other group nodes: nobody has it
    unread: list[str] = []
    for address in addresses:
        entry = Path(sysfs_root) / "bus" / "pci" / "devices" / address
        try:
            count = sysfs.read_int(entry / "enable")
        except SysfsError:
            if os.path.lexists(entry):
                unread.append(address)  # a member that vanished holds nothing
            continue
        if count > 0:
            return f"{address} is in use (its enable count is {count}: a VMM or another process has it open through vfio)"
    if refused and unread:
        raise BindError(
            "HeldUnknown",
            f"cannot tell whether something holds IOMMU group {group}, so it stays on vfio-pci: {node} cannot be "
            f"opened here ({errno.errorcode.get(refused, refused)}) and the enable count of {', '.join(unread)} "
            "cannot be read; give the agent's binder read access to the host's sysfs",
        )
    return ""


def vendor_users(sysfs_root: Path, driver: str) -> int | None:
    """How many users a driver's module has beyond the modules built on it (nvidia_uvm,
    nvidia_modeset hold nvidia too); None when the kernel does not say (a built-in driver).

    Every open of /dev/nvidia* takes a reference: nvidia-persistenced, a CUDA process."""
    module = Path(sysfs_root) / "module" / driver.replace("-", "_")
    try:
        refs = sysfs.read_int(module / "refcnt")
    except SysfsError:
        return None
    try:
        holders = len(os.listdir(module / "holders"))
    except OSError:
        holders = 0
    return max(refs - holders, 0)


def bind_group(sysfs_root: Path, dev_root: Path, group: int, addresses: list[str], timeout: float = 5.0) -> int:
    """Put `addresses` (the group's non-bridge members) on vfio-pci, then wait for
    `<dev>/vfio/<group>`. Returns the number of sysfs writes made: 0 when all are there already.
    """
    host = _Host(Path(sysfs_root), group)
    if not vfio_available(host.root):
        raise BindError("VfioNotLoaded", _NOT_LOADED)
    for address in addresses:
        host.check_member(address)
    for address in addresses:
        host.check_vendor_driver(address)
    changed: list[_Before] = []
    for address in addresses:
        before = _Before(address, host.driver(address) or "", host.override(address))
        if before.driver == VFIO_DRIVER:
            continue
        changed.append(before)  # before the first write, so a partial change is undone too
        try:
            host.to_vfio(before, timeout)
        except BindError as e:
            raise host.rolled_back(e, changed, timeout) from None
    node = Path(dev_root) / "vfio" / str(group)
    if not _wait(node.exists, timeout):
        raise BindError(
            "VfioDeviceMissing",
            f"IOMMU group {group} is on vfio-pci but {node} did not appear within {timeout:g} s: "
            "check that the agent sees the host's /dev and that devtmpfs (or udev) creates the node",
        )
    return host.writes


def release_group(
    sysfs_root: Path,
    dev_root: Path,
    group: int,
    addresses: list[str],
    timeout: float = 5.0,
    claim_wait: float = 1.0,
    overrides: Mapping[str, str] | None = None,
) -> int:
    """Give the members on vfio-pci back to their drivers: restore `driver_override` (`overrides`:
    address -> what it was before the agent bound it; cleared when not given), unbind, re-probe.
    Returns the number of sysfs writes made.

    Refused with HeldByProcess, before any write, while something holds the group
    (`held_by_process`): the unbind would block until it let go; HeldUnknown when that cannot be
    told. Whether a pod holds the group is the caller's
    question. A device no driver has claimed `claim_wait` s after the re-probe is left
    driverless (the kernel's probe is done when the write returns, but a driver that probes
    asynchronously takes a moment)."""
    host = _Host(Path(sysfs_root), group)
    if holder := held_by_process(Path(sysfs_root), Path(dev_root), group, addresses):
        raise BindError(
            "HeldByProcess",
            f"{holder} (a VMM or another process holds IOMMU group {group}); it is given back once that lets go",
        )
    given: list[str] = []
    failed: list[BindError] = []
    for address in addresses:
        try:
            if host.give_back(address, timeout, claim_wait, (overrides or {}).get(address, "")):
                given.append(address)
        except BindError as e:
            if e.reason != "DeviceGone":  # gone mid-way: nothing is left to give back
                failed.append(e)
    if failed:
        message = "; ".join(str(e) for e in failed)
        if given:
            message += f" ({', '.join(given)} went back)"
        raise BindError(failed[0].reason, message)
    return host.writes


@dataclass(frozen=True)
class _Before:
    address: str
    driver: str  # "" when none
    override: str  # "" when unset


class _Host:
    """The sysfs of one bind or release: each step with its check, and the count of writes."""

    def __init__(self, root: Path, group: int) -> None:
        self.root, self.group = root, group
        self.writes = 0

    # --- Reading ------------------------------------------------------------------------

    def device(self, address: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / address

    def driver(self, address: str) -> str | None:
        """The device's driver, "" when it has none, None when the device is gone."""
        return sysfs.driver_of(self.device(address))

    def override(self, address: str) -> str:
        # Unreadable counts as unset: the write that follows says what is wrong with the file.
        return overrides.read(self.device(address))

    def check_member(self, address: str) -> None:
        if not self.device(address).exists():
            raise self.gone(address, "before anything was written")
        try:
            group = os.path.basename(os.readlink(self.device(address) / "iommu_group"))
        except OSError:
            group = "none"
        if group != str(self.group):
            raise BindError(
                "NotInGroup", f"{address} is in IOMMU group {group}, not {self.group}: rescan before binding"
            )

    def check_vendor_driver(self, address: str) -> None:
        driver = self.driver(address) or ""
        if driver not in VENDOR_DRIVERS:
            return
        users = vendor_users(self.root, driver)
        if not users:
            return
        try:
            ids = f"{sysfs.read_hex(self.device(address) / 'vendor', 4)}:{sysfs.read_hex(self.device(address) / 'device', 4)}"
        except SysfsError:
            ids = "<vendor>:<device>"
        raise BindError(
            "VendorDriverInUse",
            f"{address} is on the {driver} driver, which has {users} user(s) (nvidia-persistenced, a CUDA process, "
            f"nvidia-smi): unbinding it would wait for them, so the agent does not move it live; "
            + prepare_node_hint(address, ids),
        )

    def gone(self, address: str, when: str) -> BindError:
        return BindError(
            "DeviceGone",
            f"{address} vanished (hot-unplugged, or it fell off the bus) {when}; "
            f"check `lspci -s {address}` and the kernel log",
        )

    # --- Steps --------------------------------------------------------------------------

    def write(self, relative: str, text: str, address: str, reason: str) -> None:
        try:
            sysfs.write_text(self.root / relative, text)
        except SysfsWriteError as e:
            if not self.device(address).exists():
                raise self.gone(address, f"while {text.strip() or 'a blank'} was written to {relative}") from None
            raise BindError(reason, f"the kernel refused it: {e}{_errno_hint(e.errno, relative)}") from None
        self.writes += 1

    def unbind(self, address: str, driver: str, timeout: float, reason: str) -> None:
        # The kernel unbinds before write(2) returns (after waiting for any holder): the poll
        # is for a driver that lets go asynchronously, or a simulated kernel.
        self.write(f"bus/pci/drivers/{driver}/unbind", address, address, reason)
        if not _wait(lambda: self.driver(address) != driver, timeout):
            raise BindError(reason, f"{address} is still on {driver} after its unbind; the kernel log says why")
        if self.driver(address) is None:
            raise self.gone(address, f"when {driver} let go of it")

    def to_vfio(self, before: _Before, timeout: float) -> None:
        address = before.address
        if before.override != VFIO_DRIVER:
            self.write(f"bus/pci/devices/{address}/driver_override", VFIO_DRIVER, address, "BindFailed")
        if before.driver:
            self.unbind(address, before.driver, timeout, "BindFailed")
        self.write("bus/pci/drivers_probe", address, address, "BindFailed")
        _wait(lambda: self.driver(address) in (VFIO_DRIVER, None), timeout)
        now = self.driver(address)
        if now is None:
            raise self.gone(address, "while being probed for vfio-pci")
        if now != VFIO_DRIVER:
            raise BindError(
                "BindFailed",
                f"vfio-pci did not take {address} (it is on {now or 'no driver'} after drivers_probe); "
                "the kernel log says why",
            )

    def restore(self, before: _Before, timeout: float) -> None:
        """Back to the driver and `driver_override` it had; a device that is gone needs nothing."""
        address = before.address
        now = self.driver(address)
        if now is None:
            return
        if self.override(address) != before.override:
            self.write(f"bus/pci/devices/{address}/driver_override", before.override or "\n", address, "BindFailed")
        if now == before.driver:
            return
        if now:
            self.unbind(address, now, timeout, "BindFailed")
        if before.driver:
            self.write(f"bus/pci/drivers/{before.driver}/bind", address, address, "BindFailed")
            if not _wait(lambda: self.driver(address) == before.driver, timeout):
                raise BindError("BindFailed", f"{address} did not go back to {before.driver}")

    def rolled_back(self, error: BindError, changed: list[_Before], timeout: float) -> BindError:
        if not self.writes:
            return BindError(error.reason, f"{error}; nothing was changed")
        left = []
        for before in reversed(changed):
            try:
                self.restore(before, timeout)
            except BindError as e:
                now, was = self.driver(before.address) or "no driver", before.driver or "no driver"
                left.append(f"{before.address} is left on {now}, not {was} ({e})")
        if left:
            return BindError(
                error.reason,
                f"{error}; rolling back failed too, so IOMMU group {self.group} is half-bound: "
                + "; ".join(left),
            )
        return BindError(error.reason, f"{error}; rolled back, IOMMU group {self.group} is as it was")

    def give_back(self, address: str, timeout: float, claim_wait: float, override: str) -> bool:
        """One member off vfio-pci; False when there was nothing to do."""
        now = self.driver(address)
        if now is None or (now != VFIO_DRIVER and self.override(address) != VFIO_DRIVER):
            return False
        if self.override(address) != override:
            self.write(f"bus/pci/devices/{address}/driver_override", override or "\n", address, "GiveBackFailed")
        if now == VFIO_DRIVER:
            self.unbind(address, VFIO_DRIVER, timeout, "GiveBackFailed")
        self.write("bus/pci/drivers_probe", address, address, "GiveBackFailed")
        _wait(lambda: self.driver(address) != "", min(timeout, claim_wait))
        if self.driver(address) == VFIO_DRIVER:
            raise BindError(
                "GiveBackFailed",
                f"{address} went back to vfio-pci when re-probed: vfio-pci is its default driver here "
                "(vfio-pci.ids= on the kernel command line, or in /etc/modprobe.d); remove that to give it back",
            )
        return True


def _errno_hint(number: int | None, relative: str) -> str:
    """What a refused write means, where the kernel's errno says more than its text."""
    if number == errno.ENODEV and relative.endswith("/bind"):
        return " (ENODEV: the driver does not match the device, or its driver_override names another driver)"
    if number == errno.EBUSY:
        return " (EBUSY: the device already has a driver)"
    return ""


def _wait(done: Callable[[], bool], timeout: float) -> bool:
    """Poll `done` until it holds or `timeout` s have passed; True if it held."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    return True
