"""KubeVirt's configuration from the platform values: the host-device allow-list and the feature gates.

Pure functions: `parse_values` checks a values mapping, `render` turns it into the server-side
apply body for the KubeVirt CR, `mismatches` compares the allow-list with what nodes advertise,
`cozystack_package` wraps the same result as a Cozystack Package.

Decisions a platform admin should know:

- `pciHostDevices` is, in this order: the default NVIDIA table (`data/default-gpus.yaml`),
  the values' entries, then one exclusive entry per assigned device, sorted by name
  (`passthrough.io/<name>`, selector from the device's IDs). `replaceDefaults: true` drops
  the table. Selectors are written upper-case.
- Variant `vgpu` never adds the passthrough table: its GPUs belong to the vGPU manager, not
  to vfio-pci, and permitting their whole-card names would only invite VMs that cannot
  start (Cozystack's vgpu variant does the same). `pciHostDevices` is then the values'
  entries plus the exclusive devices, which are passed through whole in either variant;
  `replaceDefaults` has nothing to drop there. The values' `mediatedDevices` are rendered in
  both variants (as Cozystack reads both lists in both); `vgpu` without any warns.
- When both lists come out empty the `permittedHostDevices` block is left out, with a warning:
  without the block KubeVirt checks no device names at all. Inside the block an empty list is
  left out too, so this field manager stops owning it and server-side apply removes it.
- Duplicate selectors (compared as KubeVirt does: PCI case-insensitively, mdev names with
  spaces as `_`): the same entry twice is dropped silently; the same selector with another
  resource name or another `externalResourceProvider` is refused, naming both entries.
  Exclusive entries are the exception: every assigned device of a model shares that
  model's selector, and with `externalResourceProvider: true` on both sides KubeVirt never
  looks at the selector (it only keys its own device plugins by it), so they may share a
  selector with the table, the values and each other. They conflict only with an entry
  that has `externalResourceProvider: false`, for which KubeVirt would start its own plugin
  for every device of that model, the assigned one included.
- Feature gates: `HostDevices`, then `extraFeatureGates`, without duplicates ("ours"), then
  the live gates that are not ours, in their live order. KubeVirt's `featureGates` list is
  atomic, so a live gate is dropped only when we applied it last time (the config's status)
  and the values no longer ask for it.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import jinja2
import yaml
from pydantic import BaseModel, ValidationError

from passthrough.api.models import DNS1123_LABEL, PCI_VENDOR_SELECTOR, GPUValues, PassthroughConfigSpec
from passthrough.pci.naming import EXCLUSIVE_DOMAIN, exclusive_resource_name

HOST_DEVICES_GATE = "HostDevices"
VARIANTS: tuple[str, ...] = typing.get_args(GPUValues.model_fields["variant"].annotation)

# KubeVirt (and our agent) name a device plugin's socket after the resource; a Unix socket
# path holds 108 bytes including the terminating NUL.
SOCKET_DIR = "/var/lib/kubelet/device-plugins/"
SOCKET_PATH_MAX = 107

_SELECTOR = re.compile(PCI_VENDOR_SELECTOR)
_DNS1123_LABEL = re.compile(DNS1123_LABEL)
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_VALUES_PATH = "gpu.permittedHostDevices"

_TABLE, _VALUES, _ASSIGNED = "default table", "values", "assigned device"


@dataclass(frozen=True)
class AssignedDevice:
    """A device assigned to a namespace: it gets an exclusive resource of its own."""

    name: str  # NodePCIDevice / PCIDevice name
    vendor_id: str  # 4 lowercase hex
    device_id: str


class ValuesError(ValueError):
    """Values KubeVirt would accept but misuse; `problems` lists every one as a sentence."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass(frozen=True)
class Rendered:
    patch: dict  # server-side apply body for the KubeVirt CR
    feature_gates: list[str]  # the full list written (ours + kept)
    our_feature_gates: list[str]  # HostDevices + extraFeatureGates: record in status
    pci_host_devices: list[dict]
    mediated_devices: list[dict]
    warnings: list[str]


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


# --- the allow-list -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    origin: str  # _TABLE, _VALUES or _ASSIGNED
    label: str  # how an admin finds it: "default table entry 3", ...
    path: str  # for values, the field path the problems are reported at
    selector: str
    resource: str
    external: bool

    def at(self, name: str) -> str:
        return f"{self.path}.{name}" if self.origin == _VALUES else f"{self.label}, {name}"


class _Problems:
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
            path = f"{_VALUES_PATH}.{kind}[{i}]"
            entries.append(_Entry(_VALUES, f"values entry {kind}[{i}]", path, selector, resource,
                                  external if isinstance(external, bool) else True))
    return entries


def _assigned_entries(assigned: Iterable[AssignedDevice]) -> list[_Entry]:
    return [
        _Entry(_ASSIGNED, f"assigned device {d.name}", f"assigned device {d.name}",
               f"{d.vendor_id}:{d.device_id}".upper(), exclusive_resource_name(d.name), True)
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
    if len(domain) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(domain):
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


def _check_entry(entry: _Entry, selector_field: str, problems: _Problems) -> bool:
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

    if _ASSIGNED in (first.origin, second.origin):
        return (f"{second.selector} is listed twice ({say(first, True)}; {say(second, True)}), and KubeVirt "
                "would start its own device plugin for every device of that model, the assigned one "
                "included. Set externalResourceProvider: true on that entry, or unassign the device.")
    if first.resource == second.resource:
        return (f"{second.selector} is listed twice for {second.resource} with different "
                f"externalResourceProvider ({say(first, True)}; {say(second, True)}), and KubeVirt would run "
                "its own device plugin for a resource another plugin serves. Drop one of the two.")
    advice = ("To re-point a card of the default table, set gpu.replaceDefaults: true and list every card "
              "you want." if first.origin == _TABLE else "Drop one of the two.")
    return (f"{second.selector} is listed twice with different resource names ({say(first, False)}; "
            f"{say(second, False)}): KubeVirt picks one of them at random, and VMs asking for the other "
            f"never start. {advice}")


def _dedupe_pci(entries: Iterable[_Entry], problems: _Problems) -> list[_Entry]:
    kept: list[_Entry] = []
    exact: dict[tuple[str, str], _Entry] = {}
    pool: dict[str, _Entry] = {}  # the one table/values entry a selector may have
    for entry in entries:
        if not _check_entry(entry, "pciVendorSelector", problems):
            continue
        key = entry.selector.lower()
        same = exact.get((key, entry.resource))
        if same is not None:
            if same.external != entry.external:
                problems.add(entry.at("pciVendorSelector"), _conflict(same, entry))
            continue
        owner = pool.get(key)
        if entry.origin != _ASSIGNED:
            if owner is not None:
                problems.add(entry.at("pciVendorSelector"), _conflict(owner, entry))
                continue
            pool[key] = entry
        elif owner is not None and not owner.external:
            problems.add(entry.at("pciVendorSelector"), _conflict(owner, entry))
            continue
        exact[(key, entry.resource)] = entry
        kept.append(entry)
    return kept


def _dedupe_mdev(entries: Iterable[_Entry], problems: _Problems) -> list[_Entry]:
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


@dataclass
class _Plan:
    pci: list[_Entry]
    mdev: list[_Entry]
    warnings: list[str] = field(default_factory=list)


def _plan(variant: Any, replace_defaults: Any, pci_items: Sequence[Any], mdev_items: Sequence[Any],
          extra_gates: Sequence[Any], assigned: Iterable[AssignedDevice], problems: _Problems) -> _Plan:
    """Everything but the output's shape; problems go to `problems`, what is fine to `_Plan`."""
    if variant not in VARIANTS:
        problems.add("gpu.variant", f"{variant!r} is not a known variant; use one of: {', '.join(VARIANTS)}")
    table = _table_entries() if variant == "default" and replace_defaults is not True else ()
    pci = _dedupe_pci([*table, *_values_entries(pci_items, "pciHostDevices", "pciVendorSelector"),
                       *_assigned_entries(assigned)], problems)
    mdev = _dedupe_mdev(_values_entries(mdev_items, "mediatedDevices", "mdevNameSelector"), problems)
    plan = _Plan(pci, mdev)

    for i, gate in enumerate(extra_gates):
        if isinstance(gate, str) and (not gate or gate != gate.strip() or " " in gate):
            problems.add(f"kubevirt.extraFeatureGates[{i}]", f"{gate!r} is not a feature gate name")
    if "GPU" in extra_gates:
        plan.warnings.append(
            "kubevirt.extraFeatureGates lists GPU, which is GA in KubeVirt: listing it only makes KubeVirt "
            f"warn. Host devices need {HOST_DEVICES_GATE}, which is always set."
        )
    if not pci and not mdev:
        why = ("variant vgpu has no default table" if variant == "vgpu"
               else "gpu.replaceDefaults is true" if variant == "default" else "the variant is unknown")
        plan.warnings.append(
            f"{_VALUES_PATH}: the allow-list is empty ({why} and no entries are listed), so the "
            "permittedHostDevices block is left out and KubeVirt checks no device names at all: a VM may "
            "request any host device a node advertises. List the devices you mean to permit."
        )
    elif variant == "vgpu" and not mdev:
        plan.warnings.append(
            f"gpu.variant is vgpu but {_VALUES_PATH}.mediatedDevices is empty: no vGPU type is permitted. "
            "List the mdev types (mdevNameSelector, resourceName) VMs may request."
        )
    return plan


def _check_target(name: Any, namespace: Any, problems: _Problems) -> None:
    if isinstance(name, str) and (len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name)):
        problems.add("kubevirt.name", f"{name!r} is not a KubeVirt CR name (a DNS-1123 subdomain)")
    if isinstance(namespace, str) and (len(namespace) > 63 or not _DNS1123_LABEL.fullmatch(namespace)):
        problems.add("kubevirt.namespace", f"{namespace!r} is not a namespace name (a DNS-1123 label)")


def _plan_spec(spec: PassthroughConfigSpec, assigned: Iterable[AssignedDevice], problems: _Problems) -> _Plan:
    gpu, kubevirt = spec.gpu, spec.kubevirt
    _check_target(kubevirt.name, kubevirt.namespace, problems)
    return _plan(gpu.variant, gpu.replaceDefaults, gpu.permittedHostDevices.pciHostDevices,
                 gpu.permittedHostDevices.mediatedDevices, kubevirt.extraFeatureGates, assigned, problems)


# --- values ---------------------------------------------------------------------------------


def _describe(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def _where(loc: Sequence[Any]) -> str:
    where = ""
    for part in loc:
        where += f"[{part}]" if isinstance(part, int) else (f".{part}" if where else str(part))
    return where or "values"


def _pydantic_message(error: Mapping[str, Any]) -> str:
    kind, got = error["type"], _describe(error.get("input"))
    if kind == "literal_error" and tuple(error["loc"]) == ("gpu", "variant"):
        return f"{got} is not a known variant; use one of: {', '.join(VARIANTS)}"
    if kind == "string_pattern_mismatch" and error["loc"][-1] == "pciVendorSelector":
        return f"{got} is not VVVV:DDDD hex (vendor and device ID, e.g. 10DE:2236)"
    messages = {
        "missing": "is required",
        "model_type": f"expected a mapping, got {got}",
        "dict_type": f"expected a mapping, got {got}",
        "list_type": f"expected a list, got {got}",
        "bool_type": f"expected true or false, got {got}",
        "bool_parsing": f"expected true or false, got {got}",
        "string_type": f"expected a string, got {got}",
        "string_too_short": "must not be empty",
    }
    return messages.get(kind) or f"{error['msg']} (got {got})"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args:
        return _model_in(args[0])
    return None


def _typos(model: type[BaseModel], data: Mapping, path: str) -> Iterator[tuple[str, str]]:
    """Unknown keys that look like a misspelt setting: a typo in `replaceDefaults` would silently keep
    the table. Other unknown keys pass, so a Helm values file with more in it can be used as is."""
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        info = fields.get(key)
        if info is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.8)
            if close:
                yield where, f"unknown setting; did you mean {close[0]}?"
            continue
        sub = _model_in(info.annotation)
        if sub is None:
            continue
        if isinstance(value, Mapping):
            yield from _typos(sub, value, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    yield from _typos(sub, item, f"{where}[{i}]")


def _mapping(data: Mapping, key: str) -> Mapping:
    value = data.get(key)
    return value if isinstance(value, Mapping) else {}


def _list(data: Mapping, key: str) -> list:
    value = data.get(key)
    return value if isinstance(value, list) else []


def parse_values(data: Any) -> PassthroughConfigSpec:
    """The platform values from a YAML mapping (None: all defaults).

    Raises ValuesError listing every problem: schema errors, misspelt settings, and what
    `render` would refuse (bad selectors and resource names, conflicting duplicates).
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValuesError([f"values: expected a mapping of settings (kubevirt, gpu, ...), got {_describe(data)}"])
    data = dict(data)
    problems = _Problems()
    for where, text in _typos(PassthroughConfigSpec, data, ""):
        problems.cover(where, text)
    try:
        spec = PassthroughConfigSpec.model_validate(data)
    except ValidationError as e:
        for error in e.errors():
            problems.cover(_where(error["loc"]), _pydantic_message(error))
        # The parts that did parse are checked too, so that one run lists everything.
        gpu, kubevirt = _mapping(data, "gpu"), _mapping(data, "kubevirt")
        permitted = _mapping(gpu, "permittedHostDevices")
        _check_target(kubevirt.get("name"), kubevirt.get("namespace"), problems)
        _plan(gpu.get("variant", "default"), gpu.get("replaceDefaults"), _list(permitted, "pciHostDevices"),
              _list(permitted, "mediatedDevices"), _list(kubevirt, "extraFeatureGates"), (), problems)
        raise ValuesError(problems.sentences()) from None
    _plan_spec(spec, (), problems)
    if problems:
        raise ValuesError(problems.sentences())
    return spec


# --- rendering ------------------------------------------------------------------------------


@functools.cache
def _templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["json"] = _scalar
    return env


# Characters YAML refuses, or reads as line breaks, when raw in a quoted scalar; JSON
# (ensure_ascii=False) escapes only those below U+0020.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufffe\uffff]")


def _scalar(value: Any) -> str:
    """A value as a JSON scalar, which YAML reads back unchanged (JSON is YAML, but not every
    character JSON writes raw is one YAML reads raw, and YAML refuses JSON's surrogate pairs)."""
    text = json.dumps(value, ensure_ascii=False)
    return _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _render_template(template: str, **context: Any) -> dict:
    return yaml.load(_templates().get_template(template).render(**context), Loader=_LOADER)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def render(
    spec: PassthroughConfigSpec,
    assigned: Iterable[AssignedDevice] = (),
    live_gates: Sequence[str] = (),
    previous_gates: Sequence[str] = (),
) -> Rendered:
    """The KubeVirt CR's apply body for `spec`, the assigned devices and the live feature gates.

    Raises ValuesError listing every problem (see the module docstring).
    """
    problems = _Problems()
    plan = _plan_spec(spec, assigned, problems)
    if problems:
        raise ValuesError(problems.sentences())

    ours = _unique([HOST_DEVICES_GATE, *spec.kubevirt.extraFeatureGates])
    dropped = set(ours) | set(previous_gates)
    gates = ours + _unique(g for g in live_gates if g not in dropped)
    pci = [{"pciVendorSelector": e.selector.upper(), "resourceName": e.resource, "externalResourceProvider": e.external}
           for e in plan.pci]
    mdev = [{"mdevNameSelector": e.selector, "resourceName": e.resource, "externalResourceProvider": e.external}
            for e in plan.mdev]
    patch = _render_template(
        "kubevirt.yaml.j2",
        name=spec.kubevirt.name,
        namespace=spec.kubevirt.namespace,
        pci_host_devices=pci,
        mediated_devices=mdev,
        feature_gates=gates,
    )
    return Rendered(patch, gates, ours, pci, mdev, plan.warnings)


def cozystack_package(rendered: Rendered) -> dict:
    """The same configuration as Cozystack's `cozystack.kubevirt` Package (its manual override path).

    Only our gates go in `extraFeatureGates`: Cozystack's kubevirt chart keeps its own base list.
    """
    return _render_template(
        "cozystack-package.yaml.j2",
        pci_host_devices=rendered.pci_host_devices,
        mediated_devices=rendered.mediated_devices,
        feature_gates=rendered.our_feature_gates,
    )


# --- the allow-list against the nodes -------------------------------------------------------


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
