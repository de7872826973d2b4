"""Platform values with every wrong type at every field, unknown and misspelt keys at every level.

Generated from the API's own models (`PassthroughConfigSpec`), so a field added there is
attacked here without a change. Every value is one YAML's safe loader can produce, so the
same examples serve `parse_values` and `passthrough render --values FILE`.
"""

from __future__ import annotations

import datetime
import re
import typing
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel

from passthrough.api.models import PassthroughConfigSpec

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    _text,
    st.sampled_from(["", " ", "\t", "~", "null", "true", "yes", "0x10", "1e3", "\u00e9", "\U0001f600", "a" * 300]),
    st.binary(max_size=8),
    st.dates(),
    st.datetimes(),
)
# Mapping keys as YAML writes them: mostly strings, but numbers, booleans, null and dates too.
keys = st.one_of(_text, st.integers(), st.booleans(), st.none(), st.floats(allow_nan=False), st.dates())
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3)),
                    max_leaves=8)  # fmt: skip

SELECTORS = ["10DE:2236", "10de:2236", "10DE:1B80", "10DE2236", "10DE:223", "10DE:22366", "GGGG:2236", ":", "10DE:2236 "]
RESOURCES = [
    "nvidia.com/GA102GL_A10", "nvidia.com/A10", "nvidia.com/", "/A10", "A10", "kubernetes.io/gpu", "NVIDIA.com/A10",
    "nvidia.com/" + "A" * 64, "example.com/" + "x" * 63, "nvidia.com/a b", "nvidia.com/-a", "a/b/c",
]  # fmt: skip
# Good-looking values where a field has a form of its own.
PLAUSIBLE = {
    "pciVendorSelector": SELECTORS,
    "resourceName": RESOURCES,
    "mdevNameSelector": ["GRID T4-1Q", "GRID_T4-1Q", " ", "NVIDIA A10-4Q"],
    "name": ["kubevirt", "KubeVirt", "kube_virt", "", "a" * 254],
    "namespace": ["kubevirt", "cozy-kubevirt", "Kube", "-a", "a" * 64],
    "extraFeatureGates": [["GPU"], ["HostDevices", "HostDevices"], [""], ["a b"], [" GPU"]],
    "notFoundGracePeriodSeconds": [0, 600, -1, 2**31, 2**63 - 1, 10**30],
}


def _near_misses(name: str) -> list[str]:
    """Misspellings of a field a hand could make: case, a letter lost or doubled, snake case."""
    snake = re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()
    return sorted({name.lower(), name.upper(), name[:-1], name + name[-1], name + "s", snake, name.capitalize()} - {name})


def _good(annotation: Any, field: str) -> st.SearchStrategy[Any]:
    if field in PLAUSIBLE:
        return st.sampled_from(PLAUSIBLE[field])
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list and args:
        return st.lists(values_for(args[0], field), max_size=3)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return values_for(annotation, field)
    return {bool: st.booleans(), int: st.integers(-5, 10**6), str: _text}.get(annotation, junk)


def values_for(model: Any, field: str = "") -> st.SearchStrategy[Any]:
    """A value for `model`: mostly its own shape with some fields wrong, sometimes anything at all."""
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return st.one_of(_good(model, field), junk)

    @st.composite
    def mapping(draw) -> dict:
        out: dict = {}
        for name, info in model.model_fields.items():
            key = info.alias or name
            how = draw(st.sampled_from(["absent", "good", "good", "wrong"]))
            if how == "good":
                out[key] = draw(_good(info.annotation, key))
            elif how == "wrong":
                out[key] = draw(junk)
        for _ in range(draw(st.integers(0, 2))):  # unknown keys: misspellings and strangers
            fields = [info.alias or n for n, info in model.model_fields.items()]
            misspelt = st.sampled_from(fields).flatmap(lambda f: st.sampled_from(_near_misses(f)))
            out[draw(st.one_of(misspelt, keys))] = draw(junk)
        return out

    return st.one_of(mapping(), mapping(), mapping(), junk) if field else mapping()


def values() -> st.SearchStrategy[Any]:
    """A whole values document: usually a mapping shaped like PassthroughConfigSpec, sometimes not one."""
    return st.one_of(values_for(PassthroughConfigSpec), values_for(PassthroughConfigSpec), junk)


# --- Checking what parse_values says ----------------------------------------------------------

# Words only pydantic (not a sentence of ours) would say.
RAW = re.compile(r"Input should|validation error|errors\.pydantic\.dev|Keys should be|Field required|Extra inputs|type=\w+")
_SEGMENT = re.compile(r"\[(\d+)\]")


def walk(document: Any, path: str) -> tuple[bool, Any]:
    """Follow a problem's field path ("gpu.permittedHostDevices.pciHostDevices[0].resourceName")
    through the values; (True, value) when every step exists, (False, None) when the last does not
    (a required field), raises LookupError when an earlier one does not."""
    rest, node, found = path, document, True
    while rest:
        if not found:
            raise LookupError(f"{path!r}: nothing at {path[: len(path) - len(rest)]!r}")
        m = _SEGMENT.match(rest)
        if m and isinstance(node, list):
            index = int(m.group(1))
            found, node, rest = index < len(node), node[index] if index < len(node) else None, rest[m.end():]
        elif isinstance(node, dict):
            rest = rest[1:] if rest.startswith(".") else rest
            matching = [k for k in node if rest == str(k) or rest.startswith((f"{k}.", f"{k}["))]
            if not matching:  # the last step, absent (a required field)
                found, node, rest = False, None, ""
                continue
            key = max(matching, key=lambda k: len(str(k)))
            node, rest = node[key], rest[len(str(key)):]
        else:
            raise LookupError(f"{path!r}: {rest!r} goes into a value that is neither a list nor a mapping")
    return found, node


def timedelta_fits(seconds: int) -> bool:
    try:
        datetime.timedelta(seconds=seconds)
    except OverflowError:
        return False
    return True
