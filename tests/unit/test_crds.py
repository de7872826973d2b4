"""The CRDs are generated from the pydantic models and checked in; they must not drift."""

import re
from pathlib import Path

import pytest
import yaml

from passthrough.api import crds, models

REPO = Path(__file__).resolve().parents[2]


def _generated() -> dict[str, str]:
    return {crds.crd_file_name(c): crds.render_yaml(c) for c in crds.all_crds()}


def test_checked_in_crds_equal_what_the_models_generate():
    on_disk = {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}
    assert on_disk == _generated(), "crds/ is stale: run `make crds`"


def test_the_charts_crds_equal_what_the_models_generate():
    folder = REPO / "charts/passthrough-operator/crds"
    on_disk = {p.name: p.read_text() for p in folder.glob("*.yaml")}
    assert on_disk == _generated(), f"{folder.relative_to(REPO)} is stale: run `make crds`"


def test_schema_has_no_construct_the_api_server_refuses():
    def walk(node, path):
        assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
        if "properties" in node:
            assert "additionalProperties" not in node, path
            for name, sub in node["properties"].items():
                walk(sub, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path

    for crd in crds.all_crds():
        root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        walk(root, crd["metadata"]["name"])
        # "must not specify anything other than name and generateName": not even a description.
        assert root["properties"]["metadata"] == {"type": "object"}


def test_node_pci_device_columns_are_the_documented_ones():
    crd = crds.crd_for(models.NODE_PCI_DEVICE)
    columns = [c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["NODE", "ADDRESS", "READY", "ASSIGNED", "ATTACHED", "NAMESPACE", "AGE"]


def test_conditions_merge_by_type_so_agent_and_operator_can_share_them():
    crd = crds.crd_for(models.NODE_PCI_DEVICE)
    conditions = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason", "lastTransitionTime"}


def test_crds_command_prints_every_manifest(capsys):
    from passthrough.cli import main

    assert main(["crds"]) == 0
    documents = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert sorted(d["spec"]["names"]["kind"] for d in documents) == ["NodePCIDevice", "PCIDevice", "PassthroughConfig"]


def test_kubectl_explain_has_a_description_for_every_field():
    def walk(node, path, missing):
        for name, sub in (node.get("properties") or {}).items():
            if path.count(".") == 0 and name == "metadata":
                continue  # the API server describes it (ObjectMeta) and refuses any word of ours
            if not sub.get("description", "").strip():
                missing.append(f"{path}.{name}")
            walk(sub, f"{path}.{name}", missing)
        if "items" in node:
            items = node["items"]
            if items.get("type") == "object" and not items.get("description", "").strip():
                missing.append(f"{path}[]")
            walk(items, f"{path}[]", missing)
        return missing

    for crd in crds.all_crds():
        root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert root["description"]
        assert walk(root, crd["spec"]["names"]["kind"], []) == []


def _condition_types_described(resource: models.Resource) -> str:
    crd = crds.crd_for(resource)
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    return status["properties"]["conditions"]["items"]["properties"]["type"]["description"]


@pytest.mark.parametrize(
    ("resource", "types"),
    [
        (models.NODE_PCI_DEVICE, ["Ready", "Assigned", "Attached"]),
        (models.PCI_DEVICE, ["Ready", "Attached"]),
        (models.PASSTHROUGH_CONFIG, ["Valid", "Applied", "AssignedDevicesPermitted", "NodesMatchAllowList"]),
    ],
)
def test_each_kind_describes_the_condition_types_it_carries(resource, types):
    described = _condition_types_described(resource)
    every = {"Ready", "Assigned", "Attached", "Valid", "Applied", "AssignedDevicesPermitted", "NodesMatchAllowList"}
    assert {t for t in every if re.search(rf"\b{t}\b", described)} == set(types), described


def test_the_config_condition_types_described_are_the_ones_the_operator_writes():
    import datetime

    from passthrough.controller.kubevirt_sync import ConfigView, KubeVirtView, plan_sync

    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    config = ConfigView("cluster", "uid", 1, {}, {})
    plan = plan_sync(config, live, [], [], None, datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC))
    written = {c["type"] for c in plan.status["status"]["conditions"]}
    described = _condition_types_described(models.PASSTHROUGH_CONFIG)
    assert written == {t for t in written | {"Ready", "Assigned", "Attached"} if re.search(rf"\b{t}\b", described)}


def test_pcidevice_columns_show_ready_so_a_tenant_sees_an_unusable_device():
    crd = crds.crd_for(models.PCI_DEVICE)
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"].upper() for c in columns if not c.get("priority")] == ["NODE", "ADDRESS", "READY", "ATTACHED", "AGE"]
    [ready] = [c for c in columns if c["name"] == "Ready"]
    assert ready["jsonPath"] == '.status.conditions[?(@.type=="Ready")].status'


def test_the_config_shows_valid_and_the_variant_even_when_nobody_wrote_it():
    crd = crds.crd_for(models.PASSTHROUGH_CONFIG)
    version = crd["spec"]["versions"][0]
    columns = {c["name"].upper(): c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["VARIANT"] == ".spec.gpu.variant"
    assert columns["VALID"] == '.status.conditions[?(@.type=="Valid")].status'
    # The API server fills in defaults level by level: spec, then gpu, then variant.
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["default"] == {} and spec["properties"]["gpu"]["default"] == {}
    assert spec["properties"]["gpu"]["properties"]["variant"]["default"] == "default"


def test_every_string_and_list_the_api_server_stores_is_bounded():
    """No writer (an agent, a device admin) stores an object of any size: every string has a
    maxLength (or is one of an enum), every list a maxItems, and no object keeps unknown fields."""
    unbounded = []

    def walk(node, path):
        kind = node.get("type")
        if kind == "string" and "maxLength" not in node and "enum" not in node:
            unbounded.append(f"{path}: string without maxLength")
        if kind == "array":
            if "maxItems" not in node:
                unbounded.append(f"{path}: list without maxItems")
            walk(node["items"], f"{path}[]")
        if node.get("x-kubernetes-preserve-unknown-fields") and path.split(".")[-1] != "metadata":
            unbounded.append(f"{path}: keeps unknown fields")
        for name, sub in (node.get("properties") or {}).items():
            if path.count(".") == 0 and name in ("apiVersion", "kind", "metadata"):
                continue  # the API server's own, bounded by it
            walk(sub, f"{path}.{name}")

    for crd in crds.all_crds():
        walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], crd["spec"]["names"]["kind"])
    assert unbounded == []


def test_the_bounds_hold_real_data():
    """Generous enough: the longest pci.ids name of both editions, a NodePCIDevice name,
    the longest names Kubernetes allows."""
    status = models.NodePCIDeviceStatus.model_json_schema(by_alias=True)
    attributes = status["$defs"]["PCIAttributes"]["properties"]
    longest = 0
    for edition in ("pci.ids.2023-04-10", "pci.ids.2025-07-11"):
        for line in (REPO / "e2e/data" / edition).read_text(encoding="utf-8", errors="replace").splitlines():
            if line and line[0] != "#" and "  " in line:
                longest = max(longest, len(line.split("  ", 1)[1]))
    assert longest < attributes["name"]["maxLength"] // 4 and longest < attributes["vendorName"]["maxLength"] // 4
    assert attributes["nodeName"]["maxLength"] == 253 and attributes["pciAddress"]["maxLength"] == len("0000:3b:00.0")
    name = "pci-" + "0" * 40
    left_out = models.LeftOutDevice.model_json_schema()["properties"]["name"]["maxLength"]
    assert len(name) <= left_out
    # passthrough.io/<NodePCIDevice name>, and the longest extended resource name Kubernetes takes.
    assert status["properties"]["resourceName"]["maxLength"] == 253 + 1 + 63 >= len(f"passthrough.io/{name}")
