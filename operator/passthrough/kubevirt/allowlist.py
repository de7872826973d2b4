"""KubeVirt's host-device allow-list (`permittedHostDevices`): its entries, checked and deduplicated.

Decisions a platform admin should know:

- `pciHostDevices` is, in this order: the default NVIDIA table (`data/default-gpus.yaml`),
  the values' entries, then one exclusive entry per assigned device, sorted by name
  (`passthrough.io/<name>`, selector from the device's IDs). Selectors are written upper-case.
- Duplicate selectors (compared as KubeVirt does: PCI case-insensitively, mdev names with
  spaces as `_`): the same entry twice is dropped silently; the same selector with another
  resource name or another `externalResourceProvider` is refused, naming both entries.
  Exclusive entries are the exception: every assigned device of a model shares that
  model's selector, and with `externalResourceProvider: true` on both sides KubeVirt never
  looks at the selector (it only keys its own device plugins by it), so they may share a
  selector with the table, the values and each other. They conflict only with an entry
  that has `externalResourceProvider: false`, for which KubeVirt would start its own plugin
  for every device of that model, the assigned one included.
- Problems of the table and the values are the admin's to fix: they are reported and the
  allow-list is refused as a whole. An assigned device whose exclusive entry cannot be
  written (its model is served by KubeVirt itself, its name is too long for a device-plugin
  socket, its IDs are garbled) is only left out, with the reason, so that one assignment
  cannot hold up the allow-list of everyone else.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from passthrough.api.models import PCI_VENDOR_SELECTOR
from passthrough.pci.naming import exclusive_resource_name

# KubeVirt (and our agent) name a device plugin's socket after the resource; a Unix socket
# path holds 108 bytes including the terminating NUL.
SOCKET_DIR = "/var/lib/kubelet/device-plugins/"
SOCKET_PATH_MAX = 107
VALUES_PATH = "gpu.permittedHostDevices"
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

_SELECTOR = re.compile(PCI_VENDOR_SELECTOR)
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")

_TABLE, _VALUES, _ASSIGNED = "default table", "values", "assigned device"


@dataclass(frozen=True)
class AssignedDevice:
    """A device assigned to a namespace: it gets an exclusive resource of its own."""

    name: str  # NodePCIDevice / PCIDevice name
    vendor_id: str  # 4 lowercase hex
    device_id: str


@dataclass
class AllowList:
    pci_host_devices: list[dict] = field(default_factory=list)
    mediated_devices: list[dict] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # assigned device -> why it has no entry


class Problems:
    """Problems keyed by where they are, so that a check repeating pydantic's is not said twice."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []
        self.covered: list[str] = []

    def add(self, where: str, text: str) -> None:
        if not any(where == c or where.startswith((c + ".", c + "[")) for c in self.covered):
            self.items.append((where, text))

    def cover(self, where: str, text: str) -> None:
        self.items.append((where, text))
        self.covered.append(where)

    def sentences(self) -> list[str]:
        return [f"{where}: {text}" for where, text in self.items]

    def __bool__(self) -> bool:
        return bool(self.items)


@dataclass(frozen=True)
class _Entry:
    origin: str  # _TABLE, _VALUES or _ASSIGNED
    label: str  # how an admin finds it: "default table entry 3", ...
    path: str  # for values, the field path the problems are reported at
    selector: str
    resource: str
    external: bool
    device: str = ""  # the assigned device's name

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.origin == _VALUES else f"{self.label}, {name}"


@functools.cache
def _default_table() -> tuple[dict, ...]:
    text = resources.files(__package__).joinpath("data/default-gpus.yaml").read_text()
    return tuple(yaml.safe_load(text)["pciHostDevices"])


def default_table() -> list[dict]:
    """The default NVIDIA pciHostDevices table, in its order (a copy: callers may change it)."""
    return [dict(d) for d in _default_table()]


@functools.cache
def _table_entries() -> tuple[_Entry, ...]:
    return tuple(
        _Entry(_TABLE, f"default table entry {i}", f"default table entry {i}",
               d["pciVendorSelector"], d["resourceName"], d["externalResourceProvider"])
        for i, d in enumerate(_default_table())
    )


def _get(item: Any, key: str) -> Any:
    return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)


def _values_entries(items: Sequence[Any], kind: str, selector_key: str) -> list[_Entry]:
    """Entries of a values list; items pydantic would refuse as a whole are skipped (already reported)."""
    entries = []
    for i, item in enumerate(items):
        selector, resource = _get(item, selector_key), _get(item, "resourceName")
        external = _get(item, "externalResourceProvider")
        if isinstance(selector, str) and isinstance(resource, str):
            path = f"{VALUES_PATH}.{kind}[{i}]"
            entries.append(_Entry(_VALUES, f"values entry {kind}[{i}]", path, selector, resource,
                                  external if isinstance(external, bool) else True))
    return entries


def _assigned_entries(assigned: Iterable[AssignedDevice]) -> list[_Entry]:
    return [
        _Entry(_ASSIGNED, f"assigned device {d.name}", f"assigned device {d.name}",
               f"{d.vendor_id}:{d.device_id}".upper(), exclusive_resource_name(d.name), True, d.name)
        for d in sorted(set(assigned), key=lambda d: d.name)
    ]


def socket_path(resource_name: str) -> str:
    """The device-plugin socket KubeVirt-style plugins (ours included) create for a resource."""
    return f"{SOCKET_DIR}kubevirt-{resource_name.replace('/', '-')}.sock"


@functools.lru_cache(maxsize=16384)
def resource_name_problems(name: str) -> tuple[str, ...]:
    """Why `name` cannot be an extended resource served by a device plugin; empty when it can."""
    domain, slash, rest = name.partition("/")
    if not slash:
        return (f"{name!r} is not an extended resource name: it needs a domain, as in example.com/{name}",)
    problems = []
    if len(domain) > 253 or not DNS1123_SUBDOMAIN.fullmatch(domain):
        problems.append(
            f"the domain {domain!r} of {name!r} is not a DNS-1123 subdomain "
            "(lowercase letters, digits, '-' and '.')"
        )
    elif domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        problems.append(f"{name!r} is in the kubernetes.io domain, which Kubernetes keeps for its own resources")
    if len(rest) > 63 or not _NAME_PART.fullmatch(rest):
        problems.append(
            f"the name {rest!r} of {name!r} must be 1 to 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    size = len(socket_path(name).encode())
    if size > SOCKET_PATH_MAX:
        room = SOCKET_PATH_MAX - len(socket_path("").encode())
        problems.append(
            f"{name!r} is too long for a device plugin: its socket {socket_path(name)} would be "
            f"{size} bytes, the limit is {SOCKET_PATH_MAX} (resource names of at most {room} bytes fit)"
        )
    return tuple(problems)


def _check_entry(entry: _Entry, selector_field: str, problems: Problems) -> bool:
    """Report what is wrong with one entry; False when its selector cannot be compared."""
    for text in resource_name_problems(entry.resource):
        problems.add(entry.at("resourceName"), text)
    if selector_field == "pciVendorSelector" and not _SELECTOR.fullmatch(entry.selector):
        problems.add(entry.at(selector_field),
                     f"{entry.selector!r} is not VVVV:DDDD hex (vendor and device ID, e.g. 10DE:2236)")
        return False
    if not entry.selector.strip():
        problems.add(entry.at(selector_field), "must not be empty")
        return False
    return True


def _conflict(first: _Entry, second: _Entry) -> str:
    def say(entry: _Entry, flag: bool) -> str:
        return f"{entry.label}: {entry.resource}" + (
            f", externalResourceProvider {str(entry.external).lower()}" if flag else "")

    if first.resource == second.resource:
        return (f"{second.selector} is listed twice for {second.resource} with different "
                f"externalResourceProvider ({say(first, True)}; {say(second, True)}), and KubeVirt would run "
                "its own device plugin for a resource another plugin serves. Drop one of the two.")
    advice = ("To re-point a card of the default table, set gpu.replaceDefaults: true and list every card "
              "you want." if first.origin == _TABLE else "Drop one of the two.")
    return (f"{second.selector} is listed twice with different resource names ({say(first, False)}; "
            f"{say(second, False)}): KubeVirt picks one of them at random, and VMs asking for the other "
            f"never start. {advice}")


def _where(entry: _Entry) -> str:
    return entry.path if entry.origin == _VALUES else entry.label


def _served_by_kubevirt(owner: _Entry, device: _Entry) -> str:
    """Why an assigned device cannot share its model's selector with `owner` (externalResourceProvider false)."""
    fix = ("set externalResourceProvider: true on that entry" if owner.origin == _VALUES
           else "set gpu.replaceDefaults: true and list the cards you want")
    return (f"its model {device.selector} is listed in {_where(owner)} ({owner.resource}) with "
            "externalResourceProvider: false, so KubeVirt's own device plugin would serve every device of that "
            f"model, this one included; {fix}, or unassign the device")


def _cannot_write(problems: Problems) -> str:
    """Why an assigned device's own entry cannot be written: a name no device plugin takes, or garbled IDs."""
    name = "; ".join(text for where, text in problems.items if where.endswith("resourceName"))
    ids = "; ".join(text for where, text in problems.items if not where.endswith("resourceName"))
    if ids:
        return (f"its IDs, as its node reported them, make no selector ({ids}); unassign the device "
                "(clear spec.assignedNamespace) and look at the agent on its node")
    return (f"no device plugin can serve its resource ({name}); unassign the device (clear "
            "spec.assignedNamespace): the names the agent gives (pci- and 40 hex digits) always fit")


def _dedupe_pci(entries: Iterable[_Entry], problems: Problems, left_out: dict[str, str]) -> list[_Entry]:
    kept: list[_Entry] = []
    exact: dict[tuple[str, str], _Entry] = {}
    pool: dict[str, _Entry] = {}  # the one table/values entry a selector may have
    for entry in entries:
        assigned = entry.origin == _ASSIGNED
        # An assigned device's own problems leave out its entry, not the allow-list.
        own = Problems() if assigned else problems
        if not _check_entry(entry, "pciVendorSelector", own) or (assigned and own):
            if assigned:
                left_out[entry.device] = _cannot_write(own)
            continue
        key = entry.selector.lower()
        same = exact.get((key, entry.resource))
        if same is not None:
            if same.external != entry.external:
                if assigned:
                    left_out[entry.device] = _served_by_kubevirt(same, entry)
                else:
                    problems.add(entry.at("pciVendorSelector"), _conflict(same, entry))
            continue
        owner = pool.get(key)
        if not assigned:
            if owner is not None:
                problems.add(entry.at("pciVendorSelector"), _conflict(owner, entry))
                continue
            pool[key] = entry
        elif owner is not None and not owner.external:
            left_out[entry.device] = _served_by_kubevirt(owner, entry)
            continue
        exact[(key, entry.resource)] = entry
        kept.append(entry)
    return kept


def _dedupe_mdev(entries: Iterable[_Entry], problems: Problems) -> list[_Entry]:
    kept: list[_Entry] = []
    seen: dict[str, _Entry] = {}
    for entry in entries:
        if not _check_entry(entry, "mdevNameSelector", problems):
            continue
        # KubeVirt's own spelling of an mdev type name: each space to "_", then trimmed.
        key = entry.selector.replace(" ", "_").strip()
        first = seen.get(key)
        if first is None:
            seen[key] = entry
            kept.append(entry)
        elif (first.resource, first.external) != (entry.resource, entry.external):
            problems.add(entry.at("mdevNameSelector"), _conflict(first, entry))
    return kept


def allow_list(with_table: bool, pci_items: Sequence[Any], mdev_items: Sequence[Any],
               assigned: Iterable[AssignedDevice], problems: Problems) -> AllowList:
    """The entries for the values' lists (and the default table when `with_table`) and the assigned
    devices; the values' problems go to `problems`, the assigned devices' to `left_out`."""
    left_out: dict[str, str] = {}
    table = _table_entries() if with_table else ()
    pci = _dedupe_pci([*table, *_values_entries(pci_items, "pciHostDevices", "pciVendorSelector"),
                       *_assigned_entries(assigned)], problems, left_out)
    mdev = _dedupe_mdev(_values_entries(mdev_items, "mediatedDevices", "mdevNameSelector"), problems)
    return AllowList(
        [{"pciVendorSelector": e.selector.upper(), "resourceName": e.resource, "externalResourceProvider": e.external}
         for e in pci],
        [{"mdevNameSelector": e.selector, "resourceName": e.resource, "externalResourceProvider": e.external}
         for e in mdev],
        left_out,
    )
