"""The CRDs are generated from the pydantic models and checked in; they must not drift."""

from pathlib import Path

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
        walk(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"], crd["metadata"]["name"])


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
