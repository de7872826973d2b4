"""KubeVirt's CRDs for the test control plane.

`write_crds` writes the CRDs virt-operator installs, from virt-operator's own generator
(`e2e/virt.py` builds it from KubeVirt's Go module): every CRD of KubeVirt's install, with the
schemas KubeVirt generates, so the API server judges what this project writes by KubeVirt's
rules, and virt-api and virt-controller find every resource they watch.

`crds` is an approximation kept for the unit tests, which build nothing: the KubeVirt,
VirtualMachine and VirtualMachineInstance CRDs from KubeVirt's published OpenAPI spec
(`e2e/data/kubevirt-swagger.json`): references inlined, descriptions dropped, and the few
Kubernetes types that CRD schemas spell differently (Quantity, IntOrString, nested
ObjectMeta, RawExtension) written the way KubeVirt's generated CRDs write them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
GROUP = "kubevirt.io"


def swagger_path() -> Path:
    """KubeVirt's OpenAPI spec: `$KUBEVIRT_SWAGGER`, else the copy in `e2e/data/`."""
    return Path(os.environ.get("KUBEVIRT_SWAGGER") or REPO / "e2e/data/kubevirt-swagger.json")


# kind, plural, short names, swagger definition, status subresource, namespaced
KINDS = [
    ("KubeVirt", "kubevirts", ["kv", "kvs"], "v1.KubeVirt", True),
    ("VirtualMachine", "virtualmachines", ["vm", "vms"], "v1.VirtualMachine", True),
    ("VirtualMachineInstance", "virtualmachineinstances", ["vmi", "vmis"], "v1.VirtualMachineInstance", False),
]

_OPEN_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_SPECIAL = {
    "k8s.io.apimachinery.pkg.api.resource.Quantity": {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    },
    "k8s.io.apimachinery.pkg.util.intstr.IntOrString": {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
    },
    "k8s.io.apimachinery.pkg.apis.meta.v1.ObjectMeta": _OPEN_OBJECT,
    "k8s.io.apimachinery.pkg.runtime.RawExtension": _OPEN_OBJECT,
}
_KEPT = {"type", "format", "enum", "required", "pattern", "minimum", "maximum", "minLength", "maxLength", "minItems", "maxItems"}


class _Converter:
    def __init__(self, definitions: dict[str, Any]) -> None:
        self.definitions = definitions

    def convert(self, node: dict[str, Any], stack: tuple[str, ...] = ()) -> dict[str, Any]:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name in _SPECIAL:
                return dict(_SPECIAL[name])
            if name in stack:  # a recursive type: CRD schemas cannot express it
                return dict(_OPEN_OBJECT)
            return self.convert(self.definitions[name], (*stack, name))
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in _KEPT:
                out[key] = value
            elif key == "properties":
                out["properties"] = {k: self.convert(v, stack) for k, v in value.items()}
            elif key == "items":
                out["items"] = self.convert(value, stack)
            elif key == "additionalProperties" and isinstance(value, dict):
                out["additionalProperties"] = self.convert(value, stack)
            elif key == "x-kubernetes-list-type":
                out[key] = value
            elif key == "x-kubernetes-list-map-keys":
                out[key] = value
            elif key == "x-kubernetes-map-type":
                out[key] = value
        if out.get("format") == "int-or-string":
            return dict(_SPECIAL["k8s.io.apimachinery.pkg.util.intstr.IntOrString"])
        if isinstance(out.get("type"), list):
            out.pop("type")
            out.update(_SPECIAL["k8s.io.apimachinery.pkg.api.resource.Quantity"])
        if out.get("x-kubernetes-list-type") == "map":
            # A map list's keys must be required (defaults are not carried over), else atomic.
            keys = out.get("x-kubernetes-list-map-keys", [])
            required = set(out.get("items", {}).get("required", []))
            if not set(keys) <= required:
                out["x-kubernetes-list-type"] = "atomic"
                out.pop("x-kubernetes-list-map-keys", None)
        if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
            out["x-kubernetes-preserve-unknown-fields"] = True
        if "properties" in out and "additionalProperties" in out:
            out.pop("additionalProperties")
        return out


def crds(swagger: Path | None = None) -> list[dict[str, Any]]:
    definitions = json.loads((swagger or swagger_path()).read_text())["definitions"]
    converter = _Converter(definitions)
    result = []
    for kind, plural, short, definition, status in KINDS:
        schema = converter.convert(definitions[definition])
        schema["properties"]["metadata"] = {"type": "object"}
        version: dict[str, Any] = {
            "name": "v1",
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": schema},
        }
        if status:
            version["subresources"] = {"status": {}}
        result.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{GROUP}"},
                "spec": {
                    "group": GROUP,
                    "names": {
                        "kind": kind,
                        "listKind": f"{kind}List",
                        "plural": plural,
                        "singular": kind.lower(),
                        "shortNames": short,
                        "categories": ["all"],
                    },
                    "scope": "Namespaced",
                    "versions": [version],
                },
            }
        )
    return result


def generated_crds() -> list[dict[str, Any]]:
    """Every CRD virt-operator installs, as its generator writes them (status and empty
    creation timestamps left out: nothing a client sends)."""
    from e2e import virt

    result = []
    for crd in virt.install_manifest()["crds"]:
        crd = {key: value for key, value in crd.items() if key != "status"}
        crd["metadata"] = {key: value for key, value in crd["metadata"].items() if value is not None}
        result.append(crd)
    return result


def write_crds(directory: Path) -> list[Path]:
    """KubeVirt's generated CRDs as one file each in `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for crd in generated_crds():
        path = directory / f"{crd['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(crd, sort_keys=False))
        paths.append(path)
    return paths
