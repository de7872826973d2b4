"""Names derived from PCI IDs: GPU pool resources, exclusive resources, NodePCIDevice names.

The pool name of a GPU follows NVIDIA's KubeVirt GPU device plugin to the character, so
that allow-lists and VMs written for clusters running that plugin keep working: take the
device line of the vendor's section of pci.ids, trim it, upper-case it, turn `/` and `.`
into `_`, each whitespace run into one `_`, drop everything outside `[A-Za-z0-9_]`, and
prefix the vendor's domain. An ID missing from pci.ids, or a name that leaves nothing,
gives the lowercase hex device ID instead.

"Exactly" includes the Go details: trimming uses Go's `unicode.IsSpace`, a "whitespace
run" is RE2's `\\s` (ASCII tab, newline, form feed, carriage return, space: a vertical
tab or no-break space inside a name is dropped, not turned into `_`), and upper-casing is
Go's one-rune mapping (`ß` stays `ß` and is dropped, where Python would write `SS`).

GPU vendors and their resource domains (`GPU_VENDOR_DOMAINS`):

    vendor  domain       used by
    10de    nvidia.com   NVIDIA's KubeVirt GPU device plugin (the names clusters already use)
    1002    amd.com      AMD GPUs, same rule under AMD's domain
    8086    intel.com    Intel GPUs, same rule under Intel's domain

Only display controllers (class 03) of these vendors are pooled; every other device gets a
resource name only when it is assigned to a namespace (`passthrough.io/<object name>`).
"""

from __future__ import annotations

import hashlib
import re

from passthrough.pci.pciids import PciIds

GPU_VENDOR_DOMAINS = {"10de": "nvidia.com", "1002": "amd.com", "8086": "intel.com"}
EXCLUSIVE_DOMAIN = "passthrough.io"
DISPLAY_CLASS = "03"

_HEX4 = re.compile(r"[0-9A-Fa-f]{4}")

# Go's unicode.IsSpace, which strings.TrimSpace uses.
_GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680" + "".join(map(chr, range(0x2000, 0x200B))) + "\u2028\u2029\u202f\u205f\u3000"
# Go's strings.ToUpper maps rune by rune; only these runes come out as ASCII, and every
# other non-ASCII rune is dropped at the end whatever its case.
_GO_UPPER = {**{c: c - 32 for c in range(ord("a"), ord("z") + 1)}, 0x131: "I", 0x17F: "S"}
# RE2's \s, as in the plugin's regexp "\\s+".
_RE2_SPACE_RUN = re.compile(r"[\t\n\f\r ]+")
_NOT_KEPT = re.compile(r"[^A-Za-z0-9_]+")


def plugin_name(device_line_name: str) -> str:
    """The NVIDIA KubeVirt device plugin's transformation of a pci.ids device name alone."""
    name = device_line_name.strip(_GO_SPACE).translate(_GO_UPPER)
    name = name.replace("/", "_").replace(".", "_")
    name = _RE2_SPACE_RUN.sub("_", name)
    return _NOT_KEPT.sub("", name)


def gpu_resource_name(vendor_id: str, device_id: str, pci_ids: PciIds) -> str:
    """The pool resource name of a GPU vendor's device, whatever its class.

    Raises ValueError for a vendor outside GPU_VENDOR_DOMAINS or an ID that is not 4 hex digits.
    """
    domain = gpu_domain(vendor_id)
    device = device_id.lower()
    if not _HEX4.fullmatch(device):
        raise ValueError(f"device ID {device_id!r} is not 4 hex digits")
    name = pci_ids.device_name(vendor_id, device)
    return f"{domain}/{(plugin_name(name) if name else '') or device}"


def gpu_domain(vendor_id: str) -> str:
    """The resource domain of a GPU vendor; ValueError for any other vendor."""
    domain = GPU_VENDOR_DOMAINS.get(vendor_id.lower())
    if domain is None:
        accepted = ", ".join(f"{v} ({d})" for v, d in GPU_VENDOR_DOMAINS.items())
        raise ValueError(f"vendor {vendor_id!r} is not a GPU vendor with a resource domain; accepted: {accepted}")
    return domain


def pool_resource_name(vendor_id: str, device_id: str, class_code: str, pci_ids: PciIds) -> str:
    """The GPU pool a device goes to: a display controller of a GPU vendor; "" for any other."""
    if not class_code.startswith(DISPLAY_CLASS) or vendor_id.lower() not in GPU_VENDOR_DOMAINS:
        return ""
    return gpu_resource_name(vendor_id, device_id, pci_ids)


def exclusive_resource_name(object_name: str) -> str:
    """The one-device resource of a namespace-assigned device, named for its NodePCIDevice."""
    return f"{EXCLUSIVE_DOMAIN}/{object_name}"


def node_pci_device_name(address: str, vendor_id: str, device_id: str, node_name: str) -> str:
    """The NodePCIDevice name: stable across rescans and restarts, unique per node and card."""
    key = f"{address.lower()}-{vendor_id.lower()}-{device_id.lower()}-{node_name}"
    return "pci-" + hashlib.sha1(key.encode()).hexdigest()


def resource_env_name(resource_name: str) -> str:
    """The variable virt-launcher reads the allocated addresses from (hyphens are kept)."""
    return "PCI_RESOURCE_" + resource_name.upper().replace("/", "_").replace(".", "_")
