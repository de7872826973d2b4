"""CustomResourceDefinitions generated from the API models.

Pydantic writes JSON Schema; the API server wants a structural OpenAPI v3 schema: no
`$ref`, no `anyOf` with null, no `title`, no `additionalProperties` beside `properties`.
This module turns one into the other, so `crds/` can never drift from the models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from passthrough.api.models import GROUP, RESOURCES, VERSION, Resource

# Keys of JSON Schema that mean the same in OpenAPI v3 and are kept as they are.
_KEPT = {
    "type",
    "description",
    "default",
    "enum",
    "pattern",
    "format",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "minItems",
    "maxItems",
    "required",
}


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's schema in the form a CRD's openAPIV3Schema accepts."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return _convert(schema, schema.get("$defs", {}))


def _convert(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _convert(merged, defs)
    if "anyOf" in node:
        # Optional[X] is X for the API server: absent fields are how "none" is written.
        choices = [c for c in node["anyOf"] if c.get("type") != "null"]
        if len(choices) != 1:
            raise ValueError(f"cannot express anyOf {node['anyOf']} in a structural schema")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        return _convert({**choices[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _KEPT or key.startswith("x-kubernetes-"):
            out[key] = value
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "const":
            out["enum"] = [value]
        elif key == "properties":
            out["properties"] = {name: _convert(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = _convert(value, defs)
        elif key == "additionalProperties" and isinstance(value, dict):
            out["additionalProperties"] = _convert(value, defs)
        # title, $defs, additionalProperties: true (extra="allow") are dropped: the API
        # server prunes unknown fields, which is what a schema of record should do.
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "properties" in out and "required" in out:
        # Fields with a default are filled in by the API server; never required of a writer.
        out["required"] = [r for r in out["required"] if "default" not in out["properties"].get(r, {})]
        if not out["required"]:
            del out["required"]
    return out


# Every object's first three fields, described as Kubernetes describes them for its own kinds.
# metadata takes nothing but its type: the API server publishes ObjectMeta's schema for it.
_OBJECT_META: dict[str, dict[str, Any]] = {
    "apiVersion": {
        "type": "string",
        "description": "The versioned schema of this representation of an object: passthrough.io/v1alpha1.",
    },
    "kind": {"type": "string", "description": "The REST resource this object represents."},
    "metadata": {"type": "object"},
}


def crd_for(resource: Resource) -> dict[str, Any]:
    properties: dict[str, Any] = {name: dict(schema) for name, schema in _OBJECT_META.items()}
    if resource.spec_model is not None:
        properties["spec"] = {**structural_schema(resource.spec_model), "default": {}}
    properties["status"] = structural_schema(resource.status_model)
    root: dict[str, Any] = {
        "type": "object",
        "description": resource.description,
        "properties": properties,
    }
    if resource.root_validations:
        root["x-kubernetes-validations"] = resource.root_validations
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": resource.crd_name},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": resource.kind,
                "listKind": f"{resource.kind}List",
                "plural": resource.plural,
                "singular": resource.singular,
                "shortNames": resource.short_names,
                "categories": ["passthrough"],
            },
            "scope": resource.scope,
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": resource.printer_columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def all_crds() -> list[dict[str, Any]]:
    return [crd_for(r) for r in RESOURCES]


def crd_file_name(crd: dict[str, Any]) -> str:
    return f"{crd['metadata']['name']}.yaml"


def render_yaml(crd: dict[str, Any]) -> str:
    return yaml.safe_dump(crd, sort_keys=False, width=100)


def write_crds(directory: Path) -> list[Path]:
    """Write one manifest per CRD; remove generated manifests of kinds that no longer exist."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for crd in all_crds():
        path = directory / crd_file_name(crd)
        text = render_yaml(crd)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    for stale in directory.glob(f"*.{GROUP}.yaml"):
        if stale not in written:
            stale.unlink()
    return written
