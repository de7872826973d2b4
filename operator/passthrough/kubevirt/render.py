"""The KubeVirt CR's configuration from checked values: the apply body and the Cozystack Package.

`render` turns values (see `values`) and the assigned devices into the server-side apply body
for the KubeVirt CR; `cozystack_package` wraps the same result as a Cozystack Package. The
shape of both lives in `templates/`.

Decisions a platform admin should know:

- Inside `permittedHostDevices` an empty list is left out, so this field manager stops owning
  it and server-side apply removes it (see `values` for when the whole block is left out).
- The KubeVirt CR has a ceiling: etcd refuses an object past its request limit (1.5 MiB by
  default), and each assigned device adds one entry of about 140 bytes (its own resource
  name; KubeVirt permits a device by its resource name, and ours are one per device), so
  about 10,000 assigned devices fill it. From 1 MiB on, the render warns (the config's
  status.warnings) with the size and how many more devices fit.
- Feature gates: `HostDevices`, then `extraFeatureGates`, without duplicates ("ours"), then
  the live gates that are not ours, in their live order. A gate of ours that the CR disables
  (`developerConfiguration.disabledFeatureGates`) is not written, and a warning says so:
  KubeVirt's update validator refuses a CR that names a gate in both lists (Cozystack's chart
  refuses to render one), so writing it would fail every later apply too. KubeVirt's `featureGates` list is
  atomic, so a live gate is dropped only when we applied it last time and the values no longer
  ask for it. Which gates we applied is written in the same apply, as the CR's annotation
  `passthrough.io/feature-gates` (its managedFields say the annotation is ours): a list that
  is atomic says in its managedFields only that the whole list is ours, and a record kept
  elsewhere (the config's status, as before) is lost by a crash between the two writes.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2
import yaml

from passthrough.api.models import PassthroughConfigSpec
from passthrough.kubevirt.allowlist import AssignedDevice
from passthrough.kubevirt.values import DRA_GATES, HOST_DEVICES_GATE, plan_spec
from passthrough.pci.naming import EXCLUSIVE_DOMAIN


GATES_ANNOTATION = "passthrough.io/feature-gates"  # on the KubeVirt CR: the gates we applied, comma-separated
ETCD_REQUEST_LIMIT = 1536 * 1024  # etcd's default --max-request-bytes: the largest object it stores
CR_SIZE_WARNING = 1024 * 1024  # bytes of our part of the KubeVirt CR past which the render warns


@dataclass(frozen=True)
class Rendered:
    patch: dict  # server-side apply body for the KubeVirt CR
    feature_gates: list[str]  # the full list written (ours + kept)
    our_feature_gates: list[str]  # HostDevices + extraFeatureGates: record in status
    pci_host_devices: list[dict]
    mediated_devices: list[dict]
    warnings: list[str]
    left_out: dict[str, str] = field(default_factory=dict)  # assigned device -> why it has no entry
    size: int = 0  # bytes of the apply body as compact JSON (what it adds to the CR stored in etcd)
    mediated_devices_configuration: dict = field(default_factory=dict)  # KubeVirt's shape; empty: not written


def patch_size(patch: dict) -> int:
    return len(json.dumps(patch, separators=(",", ":"), ensure_ascii=False).encode())


def size_warning(size: int, entries: int, exclusive: int) -> str | None:
    """What to tell the admin when our part of the KubeVirt CR nears etcd's limit."""
    if size < CR_SIZE_WARNING:
        return None
    per = size / max(entries, 1)
    room = max(0, int((ETCD_REQUEST_LIMIT - size) / per)) if per else 0
    return (f"KubeVirt's allow-list makes the KubeVirt CR {size / 2**20:.2f} MiB ({entries} pciHostDevices entries, {exclusive} "
            f"of them assigned devices' own); etcd refuses an object past its request limit ({ETCD_REQUEST_LIMIT / 2**20:.1f} MiB "
            f"by default, --max-request-bytes), about {room} more assigned devices at {per:.0f} bytes each, and the rest of the CR "
            "needs room too. Raise etcd's --max-request-bytes (and the API server's), or unassign devices that no VM uses.")


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
    env.filters["entries"] = _entries
    return env


# Characters YAML refuses, or reads as line breaks, when raw in a quoted scalar; JSON
# (ensure_ascii=False) escapes only those below U+0020.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufffe\uffff]")


def _scalar(value: Any) -> str:
    """A value as a JSON scalar, which YAML reads back unchanged (JSON is YAML, but not every
    character JSON writes raw is one YAML reads raw, and YAML refuses JSON's surrogate pairs)."""
    text = json.dumps(value, ensure_ascii=False)
    return _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


# The allow-list's entries are already the document's data (flat dicts of strings and booleans,
# keys in the order KubeVirt documents them, built by `allowlist`): the template places them with
# `!entries N` instead of spelling out thousands of lines that YAML would then read back one
# scalar at a time (at 2,000 entries that round trip was nine tenths of a render).
_ENTRIES_TAG = "!entries"
_stash: contextvars.ContextVar[list[Sequence[dict]]] = contextvars.ContextVar("_stash")


def _entries(items: Sequence[dict]) -> str:
    stash = _stash.get()
    stash.append(items)
    return f"{_ENTRIES_TAG} {len(stash) - 1}"


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    pass


def _construct_entries(loader: _Loader, node: yaml.ScalarNode) -> list[dict]:
    # Copies, so that the patch and `Rendered`'s lists can be changed apart.
    return [dict(item) for item in _stash.get()[int(loader.construct_scalar(node))]]


_Loader.add_constructor(_ENTRIES_TAG, _construct_entries)


def _render_template(template: str, **context: Any) -> dict:
    token = _stash.set([])
    try:
        return yaml.load(_templates().get_template(template).render(**context), Loader=_Loader)
    finally:
        _stash.reset(token)


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


def render(
    spec: PassthroughConfigSpec,
    assigned: Iterable[AssignedDevice] = (),
    live_gates: Sequence[str] = (),
    previous_gates: Sequence[str] = (),
    disabled_gates: Sequence[str] = (),
) -> Rendered:
    """The KubeVirt CR's apply body for `spec`, the assigned devices and the live feature gates.

    Raises ValuesError listing every problem of the values. An assigned device whose entry cannot
    be written does not: it is left out, and `left_out` says why.
    """
    # With DRA, a VM names a ResourceClaim, not a resource: assigned devices need no entries. Where
    # nodes choose their mode, the caller passes only the devices of device-plugin nodes.
    plan = plan_spec(spec, () if spec.dra.enabled and not spec.dra.perNode else assigned)
    dra = spec.dra.enabled or spec.dra.perNode
    wanted = _unique([HOST_DEVICES_GATE, *(DRA_GATES if dra else ()), *spec.kubevirt.extraFeatureGates])
    ours = [g for g in wanted if g not in disabled_gates]
    dropped = set(wanted) | set(previous_gates)
    gates = ours + _unique(g for g in live_gates if g not in dropped)
    pci, mdev = plan.allow_list.pci_host_devices, plan.allow_list.mediated_devices
    mdev_config = mediated_devices_configuration(spec)
    patch = _render_template(
        "kubevirt.yaml.j2",
        name=spec.kubevirt.name,
        namespace=spec.kubevirt.namespace,
        pci_host_devices=pci,
        mediated_devices=mdev,
        mediated_devices_configuration=mdev_config,
        feature_gates=gates,
        our_feature_gates=ours,
        gates_annotation=GATES_ANNOTATION,
    )
    size = patch_size(patch)
    warnings = list(plan.warnings)
    warnings += [disabled_gate_warning(gate, spec) for gate in wanted if gate in disabled_gates]
    exclusive = sum(1 for e in pci if str(e.get("resourceName", "")).startswith(EXCLUSIVE_DOMAIN + "/"))
    if (warning := size_warning(size, len(pci) + len(mdev), exclusive)) is not None:
        warnings.append(warning)
    return Rendered(patch, gates, ours, pci, mdev, warnings, plan.allow_list.left_out, size, mdev_config)


def mediated_devices_configuration(spec: PassthroughConfigSpec) -> dict:
    """The values' mediatedDevicesConfiguration in KubeVirt's shape, empty lists left out (so
    server-side apply drops what this field manager wrote before); {} when there is nothing.
    Only KubeVirt's fields: another key the values carry would be pruned from the CR by
    KubeVirt's schema, and written again by every apply."""
    config = spec.gpu.mediatedDevicesConfiguration
    out: dict[str, Any] = {}
    if config.mediatedDeviceTypes:
        out["mediatedDeviceTypes"] = list(config.mediatedDeviceTypes)
    if config.nodeMediatedDeviceTypes:
        out["nodeMediatedDeviceTypes"] = [{"nodeSelector": dict(n.nodeSelector), "mediatedDeviceTypes": list(n.mediatedDeviceTypes)}
                                          for n in config.nodeMediatedDeviceTypes]  # fmt: skip
    return out


def disabled_gate_warning(gate: str, spec: PassthroughConfigSpec) -> str:
    """Why a gate the values enable is not written: the KubeVirt CR disables it."""
    target = f"{spec.kubevirt.namespace}/{spec.kubevirt.name}"
    source = "kubevirt.extraFeatureGates" if gate in spec.kubevirt.extraFeatureGates else "this operator (it needs it)"
    effect = " VMs that name devices will not start while it is off." if gate == HOST_DEVICES_GATE or gate in DRA_GATES else ""
    return (f"feature gate {gate} is enabled by {source}, but KubeVirt {target} disables it "
            f"(spec.configuration.developerConfiguration.disabledFeatureGates): KubeVirt refuses a CR that names a gate in "
            f"both lists, so it is not written.{effect} Remove it from one of the two lists.")


def cozystack_package(rendered: Rendered) -> dict:
    """The same configuration as Cozystack's `cozystack.kubevirt` Package (its manual override path).

    Only our gates go in `extraFeatureGates`: Cozystack's kubevirt chart keeps its own base list.
    """
    return _render_template(
        "cozystack-package.yaml.j2",
        pci_host_devices=rendered.pci_host_devices,
        mediated_devices=rendered.mediated_devices,
        mediated_devices_configuration=rendered.mediated_devices_configuration,
        feature_gates=rendered.our_feature_gates,
    )
