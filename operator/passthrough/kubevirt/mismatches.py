"""The allow-list against the nodes: allow-listed names no node advertises, and GPUs nodes
advertise that the allow-list lacks (VMs asking for them never start)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from passthrough.kubevirt.allowlist import default_table
from passthrough.pci.naming import EXCLUSIVE_DOMAIN


@dataclass(frozen=True)
class Advertised:
    """What a node advertises for one GPU (from a NodePCIDevice)."""

    node: str
    pci_address: str
    vendor_id: str
    device_id: str
    resource_name: str


@dataclass(frozen=True, order=True)
class Mismatch:
    """A disagreement between the allow-list and the nodes.

    `expected` is the allow-list's name for `selector` when a node calls the same card by
    another name (an older pci.ids); empty otherwise.
    """

    resource_name: str
    selector: str = ""  # "VVVV:DDDD"
    node: str = ""
    pci_address: str = ""
    expected: str = ""

    @property
    def message(self) -> str:
        if not self.node:
            return f"{self.resource_name} ({self.selector}) is allow-listed but no node advertises it"
        if self.expected:
            return (
                f"node {self.node} advertises {self.resource_name} for {self.selector} "
                f"({self.pci_address}), the allow-list expects {self.expected}"
            )
        return (
            f"node {self.node} advertises {self.resource_name} ({self.pci_address}), which the "
            "allow-list lacks: KubeVirt refuses VMs that ask for it"
        )


def mismatches(
    pci_host_devices: Sequence[dict], advertised: Iterable[Advertised]
) -> tuple[list[Mismatch], list[Mismatch]]:
    """(allow-listed names no node advertises, advertised GPUs the allow-list lacks), each sorted.

    A GPU is permitted only when an entry's resourceName equals its name exactly, as
    virt-controller compares. Entries KubeVirt serves itself (externalResourceProvider false)
    and exclusive `passthrough.io/` entries are not pool names and are never "not advertised".
    An empty list means no permittedHostDevices block: KubeVirt then checks nothing.
    """
    if not pci_host_devices:
        return [], []
    advertised = [a for a in advertised if a.resource_name]
    permitted = {d["resourceName"] for d in pci_host_devices}
    by_selector: dict[str, str] = {}
    for d in pci_host_devices:
        # An exclusive entry shares its model's selector, but it is no name for the pool.
        if not d["resourceName"].startswith(f"{EXCLUSIVE_DOMAIN}/"):
            by_selector.setdefault(d["pciVendorSelector"].upper(), d["resourceName"])
    names = {a.resource_name for a in advertised}

    not_advertised = {
        Mismatch(d["resourceName"], d["pciVendorSelector"].upper())
        for d in pci_host_devices
        if d.get("externalResourceProvider", True)
        and not d["resourceName"].startswith(f"{EXCLUSIVE_DOMAIN}/")
        and d["resourceName"] not in names
    }
    not_permitted = set()
    for a in advertised:
        if a.resource_name in permitted:
            continue
        selector = f"{a.vendor_id}:{a.device_id}".upper()
        expected = by_selector.get(selector, "")
        not_permitted.add(Mismatch(a.resource_name, selector if expected else "", a.node, a.pci_address, expected))
    return sorted(not_advertised), sorted(not_permitted)


def split_default_models(not_advertised: list[Mismatch]) -> tuple[list[Mismatch], int]:
    """(the names the admin's own values allow-list and no node advertises, how many of the
    default table's models no node advertises).

    The default table lists every NVIDIA datacenter GPU: on a cluster with two models, the
    other sixteen are not advertised by design, and would bury the one name in the values that
    is misspelt. Those are counted, not listed.
    """
    defaults = {(d["resourceName"], d["pciVendorSelector"].upper()) for d in default_table()}
    own = [m for m in not_advertised if (m.resource_name, m.selector) not in defaults]
    return own, len(not_advertised) - len(own)
