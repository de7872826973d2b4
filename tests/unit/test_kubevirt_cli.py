"""`passthrough render`: exit codes, where problems and warnings go, and nothing on stdout on error."""

import json

import pytest
import yaml

from passthrough.cli import main


def run(tmp_path, text, *args, capsys):
    path = tmp_path / "values.yaml"
    path.write_text(text)
    code = main(["render", "--values", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_valid_values_print_the_patch_and_exit_0(tmp_path, capsys):
    code, out, err = run(tmp_path, "kubevirt: {namespace: cozy-kubevirt}\n", capsys=capsys)
    assert code == 0 and err == ""
    patch = yaml.safe_load(out)
    assert patch["kind"] == "KubeVirt" and patch["metadata"]["namespace"] == "cozy-kubevirt"


def test_json_output_is_the_same_document(tmp_path, capsys):
    _, as_yaml, _ = run(tmp_path, "{}\n", capsys=capsys)
    code, as_json, _ = run(tmp_path, "{}\n", "-o", "json", capsys=capsys)
    assert code == 0 and json.loads(as_json) == yaml.safe_load(as_yaml)


def test_cozystack_package_format(tmp_path, capsys):
    code, out, _ = run(tmp_path, "{}\n", "--format", "cozystack-package", capsys=capsys)
    assert code == 0 and yaml.safe_load(out)["metadata"]["name"] == "cozystack.kubevirt"


def test_an_empty_file_means_the_defaults(tmp_path, capsys):
    code, out, _ = run(tmp_path, "", capsys=capsys)
    assert code == 0 and yaml.safe_load(out)["spec"]["configuration"]["permittedHostDevices"]


def test_warnings_go_to_stderr_and_exit_0(tmp_path, capsys):
    code, out, err = run(tmp_path, "gpu: {replaceDefaults: true}\n", capsys=capsys)
    assert code == 0
    assert "permittedHostDevices" not in yaml.safe_load(out)["spec"]["configuration"]
    assert err.startswith("passthrough render: warning: ") and "checks no device names at all" in err


def test_an_unreadable_file_exits_2_with_nothing_on_stdout(tmp_path, capsys):
    code = main(["render", "--values", str(tmp_path / "missing.yaml")])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert "missing.yaml: invalid values" in err and "cannot read it: No such file or directory" in err


def test_bad_yaml_exits_2_with_nothing_on_stdout(tmp_path, capsys):
    code, out, err = run(tmp_path, "gpu: [unclosed\n", capsys=capsys)
    assert (code, out) == (2, "")
    assert "not valid YAML" in err


def test_schema_errors_exit_2_listing_every_problem(tmp_path, capsys):
    text = "gpu:\n  variant: mig\n  replaceDefaults: maybe\n  permittedHostDevices:\n    pciHostDevices:\n" \
           "    - {pciVendorSelector: 10de-2236, resourceName: A10}\n"
    code, out, err = run(tmp_path, text, capsys=capsys)
    assert (code, out) == (2, "")
    problems = [line for line in err.splitlines() if line.startswith("  - ")]
    assert [p.split(": ", 1)[0] for p in problems] == [
        "  - gpu.variant",
        "  - gpu.replaceDefaults",
        "  - gpu.permittedHostDevices.pciHostDevices[0].pciVendorSelector",
        "  - gpu.permittedHostDevices.pciHostDevices[0].resourceName",
    ]


def test_a_conflicting_duplicate_exits_2_naming_both_entries(tmp_path, capsys):
    text = "gpu:\n  permittedHostDevices:\n    pciHostDevices:\n    - {pciVendorSelector: '10DE:1EB8', resourceName: nvidia.com/T4}\n"
    code, out, err = run(tmp_path, text, capsys=capsys)
    assert (code, out) == (2, "")
    assert "default table entry 14: nvidia.com/TU104GL_TESLA_T4" in err
    assert "values entry pciHostDevices[0]: nvidia.com/T4" in err


def test_a_values_file_that_is_not_a_mapping_exits_2(tmp_path, capsys):
    code, out, err = run(tmp_path, "- gpu\n", capsys=capsys)
    assert (code, out) == (2, "")
    assert "expected a mapping" in err


@pytest.mark.parametrize("fmt", ["kubevirt", "cozystack-package"])
def test_yaml_output_is_stable(tmp_path, capsys, fmt):
    first = run(tmp_path, "{}\n", "--format", fmt, capsys=capsys)
    assert run(tmp_path, "{}\n", "--format", fmt, capsys=capsys) == first
