"""A nested QEMU in the guest that opens devices with `-device vfio-pci,host=...`: the stand-in
for KubeVirt's virt-launcher, which does the same with the addresses of PCI_RESOURCE_<NAME>.

It starts stopped (-S: no guest code runs, which under TCG inside TCG would crawl); opening the
groups and mapping its memory through the IOMMU is done at start, so a VMM that is up holds
the devices, and `query-pci` over its QMP socket lists them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from e2e.guest.machine import Guest, GuestError, GuestProcess
from e2e.guest.qmp import pci_functions


class NestedVmm:
    def __init__(self, guest: Guest, addresses: Sequence[str], name: str = "vmm", memory_mib: int = 128) -> None:
        self.guest, self.addresses, self.name = guest, list(addresses), name
        self.socket = f"/run/{name}.qmp"  # a guest path: the host cannot connect to a socket on the 9p share
        self.argv = [
            "qemu-system-x86_64", "-accel", "tcg", "-S", "-machine", "q35", "-m", str(memory_mib),
            "-nodefaults", "-display", "none", "-serial", "none", "-qmp", f"unix:{self.socket},server=on,wait=off",
        ]  # fmt: skip
        for index, address in enumerate(self.addresses):
            self.argv += ["-device", f"vfio-pci,host={address},id=hostdev{index}"]
        self.process: GuestProcess | None = None

    def start(self, timeout: float = 180.0) -> NestedVmm:
        """Start it; return once its monitor answers (the devices are open then). GuestError with
        its output when it exits first (a group that is not viable, a device not on vfio-pci)."""
        self.guest.run("rm", "-f", self.socket)
        self.process = self.guest.spawn(self.name, self.argv)
        deadline = time.monotonic() + timeout
        while True:
            rc = self.process.poll()
            if rc is not None:
                raise GuestError(f"the nested QEMU exited ({rc}) with {self.addresses}:\n{self.process.output()}")
            try:
                self.guest.guest_qmp(self.socket, "query-status", timeout=5)
                return self
            except GuestError:
                if time.monotonic() > deadline:
                    raise GuestError(f"the nested QEMU's monitor did not answer in {timeout:.0f}s:\n{self.process.output()}") from None
            time.sleep(1)

    def query_pci(self) -> list[dict[str, Any]]:
        """Every PCI function of the nested machine (bridges' buses flattened)."""
        return pci_functions(self.guest.guest_qmp(self.socket, "query-pci"))

    def host_devices(self) -> dict[str, dict[str, Any]]:
        """The vfio-pci devices `query-pci` lists, by the host address each was given."""
        by_id = {f.get("qdev_id"): f for f in self.query_pci()}
        return {address: by_id[f"hostdev{i}"] for i, address in enumerate(self.addresses) if f"hostdev{i}" in by_id}

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            try:
                self.guest.guest_qmp(self.socket, "quit", timeout=5)
            except GuestError:
                pass
        rc = self.process.stop(timeout)
        self.process = None
        return rc

    def __enter__(self) -> NestedVmm:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
