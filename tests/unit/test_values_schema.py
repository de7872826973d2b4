"""The chart's values.schema.json: generated from the models, checked in, and strict.

Helm validates values against it (tests/integration/test_chart.py runs the real helm). Here the
checked-in file is validated without helm by `violations` below, a validator of exactly the
JSON Schema keywords the generator writes; a test fails if the schema starts using another.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from passthrough.api import chart_values
from passthrough.api.chart_values import closed

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts/passthrough-operator"
PLATFORM_KEYS = ("kubevirt", "gpu", "devices", "discovery")


def checked_in() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def default_values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# -- a validator of the keywords the generator writes -----------------------------------------

_TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
}
VALIDATED = {"type", "properties", "additionalProperties", "required", "items", "enum", "pattern", "minimum",
             "maximum", "exclusiveMinimum", "minLength", "maxLength", "maxItems", "anyOf", "dependencies"}  # fmt: skip
ANNOTATIONS = {"$schema", "description", "default"}


def violations(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """What is wrong with `value`, each as `/path: problem`, in the words of draft-07."""
    where = path or "/"
    if "type" in schema and not _TYPES[schema["type"]](value):
        return [f"{where}: got {type(value).__name__}, want {schema['type']}"]
    if "anyOf" in schema:
        if all(violations(choice, value, path) for choice in schema["anyOf"]):
            return [f"{where}: matches none of anyOf"]
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            problems.append(f"{where}: {value!r} does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            problems.append(f"{where}: {value!r} has the wrong length")
    if _TYPES["number"](value):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            problems.append(f"{where}: {value} is out of range")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            problems.append(f"{where}: {value} is not above {schema['exclusiveMinimum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        problems += [f"{where}: missing property {key!r}" for key in schema.get("required", []) if key not in value]
        for key, needs in schema.get("dependencies", {}).items():
            problems += [f"{where}: {key!r} needs {need!r}" for need in needs if key in value and need not in value]
        for key, sub in value.items():
            extra = schema.get("additionalProperties", True)
            if key in properties:
                problems += violations(properties[key], sub, f"{path}/{key}")
            elif extra is False:
                problems.append(f"{where}: additional property {key!r} not allowed")
            elif isinstance(extra, dict):
                problems += violations(extra, sub, f"{path}/{key}")
    if isinstance(value, list) and len(value) > schema.get("maxItems", len(value)):
        problems.append(f"{where}: {len(value)} items, more than {schema['maxItems']}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += violations(schema["items"], item, f"{path}/{i}")
    return problems


def keywords(schema: dict[str, Any]) -> set[str]:
    found = set(schema)
    for sub in schema.get("properties", {}).values():
        found |= keywords(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            found |= keywords(schema[key])
    for choice in schema.get("anyOf", []):
        found |= keywords(choice)
    return found


def test_the_validator_here_knows_every_keyword_the_schema_uses():
    assert keywords(checked_in()) <= VALIDATED | ANNOTATIONS


# -- the tests ---------------------------------------------------------------------------------


def test_the_checked_in_values_schema_equals_what_the_models_generate():
    on_disk = (CHART / "values.schema.json").read_text()
    assert on_disk == chart_values.render(chart_values.values_schema()), (
        "charts/passthrough-operator/values.schema.json is stale: run `make crds`"
    )


def test_the_platform_values_are_checked_as_the_passthroughconfig_crd_checks_its_spec():
    crd = yaml.safe_load((REPO / "crds/passthroughconfigs.passthrough.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    schema = checked_in()
    # Every key of the spec is a value of the chart's, or derived from one (`dra`: agent.devicePlugin.dra).
    assert sorted(spec["properties"]) == sorted([*PLATFORM_KEYS, *chart_values.DERIVED])
    for key in PLATFORM_KEYS:
        assert schema["properties"][key] == closed(spec["properties"][key]), key
    assert not set(chart_values.DERIVED) & set(schema["properties"])  # one switch for one thing


def test_the_default_values_are_valid():
    assert violations(checked_in(), default_values()) == []


def test_every_key_of_the_default_values_is_in_the_schema_with_a_description():
    def walk(schema, value, path):
        if isinstance(value, dict) and "properties" in schema:
            for key, sub in value.items():
                assert key in schema["properties"], f"{path}.{key}"
                assert schema["properties"][key].get("description"), f"{path}.{key} has no description"
                walk(schema["properties"][key], sub, f"{path}.{key}")

    walk(checked_in(), default_values(), "values")


def test_the_metrics_values_are_part_of_the_schema():
    metrics = default_values()["metrics"]
    assert metrics == {
        "enabled": True, "authentication": True, "operatorPort": 9090, "agentPort": 9091,
        "serviceMonitor": {"enabled": False, "interval": "30s", "labels": {}},
        "dashboard": {"enabled": True, "labels": {"grafana_dashboard": "1"}},
    }  # fmt: skip
    assert set(checked_in()["properties"]["metrics"]["properties"]) == set(metrics)


def test_every_object_of_the_schema_refuses_unknown_keys():
    def walk(schema, path):
        if "properties" in schema:
            assert schema.get("additionalProperties") is False, path
            for key, sub in schema["properties"].items():
                walk(sub, f"{path}.{key}")
        if isinstance(schema.get("items"), dict):
            walk(schema["items"], f"{path}[]")

    walk(checked_in(), "values")


def with_value(path: str, value: Any) -> dict[str, Any]:
    values = copy.deepcopy(default_values())
    *parents, last = path.split(".")
    node = values
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return values


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("gpu.replaceDefault", True, "/gpu: additional property 'replaceDefault' not allowed"),
        ("replaceDefaults", True, "/: additional property 'replaceDefaults' not allowed"),
        ("devices.notFoundGracePeriodSeconds", "ten", "/devices/notFoundGracePeriodSeconds: got str, want integer"),
        ("devices.notFoundGracePeriodSeconds", -1, "/devices/notFoundGracePeriodSeconds: -1 is out of range"),
        ("gpu.variant", "sriov", "/gpu/variant: 'sriov' is not one of ['default', 'vgpu']"),
        ("gpu.permittedHostDevices.pciHostDevices", [{"pciVendorSelector": "10de:2236", "resourceName": "x", "extra": 1}],
         "/gpu/permittedHostDevices/pciHostDevices/0: additional property 'extra' not allowed"),
        ("operator.workers", "16", "/operator/workers: got str, want integer"),
        ("operator.replica", 2, "/operator: additional property 'replica' not allowed"),
        ("agent.rescanInterval", "soon", "/agent/rescanInterval: matches none of anyOf"),
        ("agent.tolerations", [{"operater": "Exists"}], "/agent/tolerations/0: additional property 'operater' not allowed"),
        ("image.pullPolicy", "Sometimes", "/image/pullPolicy: 'Sometimes' is not one of"),
        ("metrics.serviceMonitor.intervall", "1m", "/metrics/serviceMonitor: additional property 'intervall' not allowed"),
        ("metrics.operatorPort", 70000, "/metrics/operatorPort: 70000 is out of range"),
        ("webhook.certManager.issuerRef", {"kind": "ClusterIssuer"}, "/webhook/certManager/issuerRef: 'kind' needs 'name'"),
    ],
)
def test_a_misspelt_key_or_a_wrong_value_is_refused_naming_it(path, value, problem):
    found = violations(checked_in(), with_value(path, value))
    assert len(found) == 1 and found[0].startswith(problem), found


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("agent.rescanInterval", 300),
        ("agent.rescanInterval", "1h30m"),
        ("operator.resources", {"requests": {"cpu": 1, "memory": "1Gi"}}),
        ("webhook.certManager.issuerRef", {"name": "my-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}),
        ("imagePullSecrets", [{"name": "registry"}]),
        ("global", {"imageRegistry": "registry.example.com"}),  # a parent chart's globals
    ],
)
def test_what_the_values_file_documents_is_accepted(path, value):
    assert violations(checked_in(), with_value(path, value)) == []


def test_the_values_schema_command_prints_the_schema(capsys):
    from passthrough.cli import main

    assert main(["values-schema"]) == 0
    assert json.loads(capsys.readouterr().out) == checked_in()
