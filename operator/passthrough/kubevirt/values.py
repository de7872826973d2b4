"""The platform values (a PassthroughConfig's spec, or a values file): parsed and checked.

`parse_values` refuses, naming every problem at once, what KubeVirt would accept but misuse;
`plan_spec` checks parsed values together with the assigned devices, for rendering.

Decisions a platform admin should know:

- `replaceDefaults: true` drops the default table.
- Variant `vgpu` never adds the passthrough table: its GPUs belong to the vGPU manager, not
  to vfio-pci, and permitting their whole-card names would only invite VMs that cannot
  start (Cozystack's vgpu variant does the same). `pciHostDevices` is then the values'
  entries plus the exclusive devices, which are passed through whole in either variant;
  `replaceDefaults` has nothing to drop there. The values' `mediatedDevices` are rendered in
  both variants (as Cozystack reads both lists in both); `vgpu` without any warns.
- When both lists come out empty the `permittedHostDevices` block is left out, with a warning:
  without the block KubeVirt checks no device names at all.
- Unknown keys that look like a misspelt setting are refused; other unknown keys pass, so a
  Helm values file with more in it can be used as is.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from passthrough.api.models import DNS1123_LABEL, GPUValues, PassthroughConfigSpec
from passthrough.kubevirt.allowlist import DNS1123_SUBDOMAIN, VALUES_PATH, AllowList, AssignedDevice, Problems, allow_list

HOST_DEVICES_GATE = "HostDevices"
# KubeVirt's gates for devices from ResourceClaims (beta and on by default as of 1.9.0; named
# anyway, so that an older KubeVirt that has them as alpha takes claims too).
DRA_GATES = ("HostDevicesWithDRA", "GPUsWithDRA")
VARIANTS: tuple[str, ...] = typing.get_args(GPUValues.model_fields["variant"].annotation)

_DNS1123_LABEL = re.compile(DNS1123_LABEL)


class ValuesError(ValueError):
    """Values KubeVirt would accept but misuse; `problems` lists every one as a sentence."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


@dataclass
class Plan:
    allow_list: AllowList
    warnings: list[str] = field(default_factory=list)


def _plan(variant: Any, replace_defaults: Any, pci_items: Sequence[Any], mdev_items: Sequence[Any],
          extra_gates: Sequence[Any], assigned: Iterable[AssignedDevice], problems: Problems) -> Plan:
    """Everything but the output's shape; problems go to `problems`, what is fine to `Plan`."""
    if variant not in VARIANTS:
        problems.add("gpu.variant", f"{variant!r} is not a known variant; use one of: {', '.join(VARIANTS)}")
    with_table = variant == "default" and replace_defaults is not True
    plan = Plan(allow_list(with_table, pci_items, mdev_items, assigned, problems))
    pci, mdev = plan.allow_list.pci_host_devices, plan.allow_list.mediated_devices

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
            f"{VALUES_PATH}: the allow-list is empty ({why} and no entries are listed), so the "
            "permittedHostDevices block is left out and KubeVirt checks no device names at all: a VM may "
            "request any host device a node advertises. List the devices you mean to permit."
        )
    elif variant == "vgpu" and not mdev:
        plan.warnings.append(
            f"gpu.variant is vgpu but {VALUES_PATH}.mediatedDevices is empty: no vGPU type is permitted. "
            "List the mdev types (mdevNameSelector, resourceName) VMs may request."
        )
    return plan


def _check_target(name: Any, namespace: Any, problems: Problems) -> None:
    if isinstance(name, str) and (len(name) > 253 or not DNS1123_SUBDOMAIN.fullmatch(name)):
        problems.add("kubevirt.name", f"{name!r} is not a KubeVirt CR name (a DNS-1123 subdomain)")
    if isinstance(namespace, str) and (len(namespace) > 63 or not _DNS1123_LABEL.fullmatch(namespace)):
        problems.add("kubevirt.namespace", f"{namespace!r} is not a namespace name (a DNS-1123 label)")


def _plan_spec(spec: PassthroughConfigSpec, assigned: Iterable[AssignedDevice], problems: Problems) -> Plan:
    gpu, kubevirt = spec.gpu, spec.kubevirt
    _check_target(kubevirt.name, kubevirt.namespace, problems)
    return _plan(gpu.variant, gpu.replaceDefaults, gpu.permittedHostDevices.pciHostDevices,
                 gpu.permittedHostDevices.mediatedDevices, kubevirt.extraFeatureGates, assigned, problems)


def plan_spec(spec: PassthroughConfigSpec, assigned: Iterable[AssignedDevice] = ()) -> Plan:
    """The allow-list and warnings for parsed values and the assigned devices.

    Raises ValuesError listing every problem of the values.
    """
    problems = Problems()
    plan = _plan_spec(spec, assigned, problems)
    if problems:
        raise ValuesError(problems.sentences())
    return plan


# --- pydantic's errors as sentences ---------------------------------------------------------


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
    if error["loc"][-1:] == (KEY,):
        if kind == "string_type":
            kind = "invalid_key"
        else:
            return f"has the key {got}: {_pydantic_message({**error, 'loc': error['loc'][:-1]})}"
    bound = (error.get("ctx") or {})
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
        "string_unicode": f"expected a string, got {got}, which is not UTF-8 text",
        "int_type": f"expected a whole number, got {got}",
        "int_parsing": f"expected a whole number, got {got}",
        "int_from_float": f"expected a whole number, got {got}",
        "greater_than_equal": f"must be at least {bound.get('ge')}, got {got}",
        "less_than_equal": f"must be at most {bound.get('le')}, got {got}",
        "invalid_key": f"has the key {got}, which is not a string; quote it, or check the indentation",
    }
    # Anything else, in pydantic's words made ours: "Input should be X" reads "expected X".
    return messages.get(kind) or f"{error['msg'].replace('Input should be', 'expected')} (got {got})"


KEY = "[key]"  # the last step of pydantic's path to a refused key of a dict field: (..., key, "[key]")


def _problem_loc(error: Mapping[str, Any]) -> Sequence[Any]:
    # A key that is not a string is a problem of the mapping that holds it: its path ends in
    # the key itself, which no admin could write as a path.
    if error["loc"][-1:] == (KEY,):
        return error["loc"][:-2]
    return error["loc"][:-1] if error["type"] == "invalid_key" else error["loc"]


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args:
        return _model_in(args[0])
    return None


def _setting_paths(model: type[BaseModel], path: str = "") -> Iterator[tuple[str, str]]:
    """(name, path) of every setting under `model`, nested ones included."""
    for name, info in model.model_fields.items():
        key = info.alias or name
        where = f"{path}.{key}" if path else key
        yield key, where
        sub = _model_in(info.annotation)
        if sub is not None:
            yield from _setting_paths(sub, f"{where}[]" if typing.get_origin(info.annotation) is list else where)


def _typos(model: type[BaseModel], data: Mapping, path: str) -> Iterator[tuple[str, str]]:
    """Unknown keys that look like a mistake: a misspelt setting (a typo in `replaceDefaults`
    would silently keep the table), or a setting nested at the wrong level (`kubevirt.gpu`,
    `gpu.permittedHostDevices.replaceDefaults`), refused with where it belongs. Other unknown
    keys pass, so a Helm values file with more in it can be used as is."""
    fields = {info.alias or name: info for name, info in model.model_fields.items()}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        info = fields.get(key)
        if info is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.8)
            elsewhere = [p.rpartition(".")[0] or "the top level" for name, p in _setting_paths(PassthroughConfigSpec) if name == key]
            if close:
                yield where, f"unknown setting; did you mean {close[0]}?"
            elif elsewhere:
                yield where, f"unknown setting here: {key} is a setting of {' and '.join(elsewhere)} (check the indentation)"
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
    problems = Problems()
    for where, text in _typos(PassthroughConfigSpec, data, ""):
        problems.cover(where, text)
    try:
        spec = PassthroughConfigSpec.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # A mapping's key that pydantic refused (its path ends in "[key]"): what it says of the
        # value under that key is left out, the key being the problem.
        refused_keys = [tuple(error["loc"][:-1]) for error in errors if error["loc"][-1:] == (KEY,)]
        for error in errors:
            loc = tuple(error["loc"])
            if loc[-1:] != (KEY,) and any(loc[: len(key)] == key for key in refused_keys):
                continue
            problems.cover(_where(_problem_loc(error)), _pydantic_message(error))
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
