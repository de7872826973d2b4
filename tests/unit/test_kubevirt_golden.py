"""`passthrough render` output for each values case equals its golden file in tests/golden/kubevirt/.

Regenerate after a deliberate change: UPDATE_GOLDEN=1 .venv/bin/python -m pytest -q tests/unit/test_kubevirt_golden.py
"""

import os
from pathlib import Path

import pytest
import yaml

from passthrough.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "kubevirt"
UPDATE = os.environ.get("UPDATE_GOLDEN") == "1"

CASES = [
    ("defaults-only", "kubevirt"),
    ("defaults-plus-user", "kubevirt"),
    ("replace-with-user", "kubevirt"),
    ("replace-empty", "kubevirt"),
    ("vgpu", "kubevirt"),
    ("defaults-plus-user", "cozystack-package"),
]


def _refuse_update_under_ci(update: bool, ci: str | None) -> None:
    # Under CI a regenerate would make every golden test pass whatever the output.
    if update and (ci or "").lower() in ("true", "1", "yes"):
        pytest.fail("UPDATE_GOLDEN=1 is refused under CI: regenerate the golden files locally and commit them")


def _check(path: Path, actual: str) -> None:
    _refuse_update_under_ci(UPDATE, os.environ.get("CI"))
    if UPDATE:
        if actual:
            path.write_text(actual)
        else:
            path.unlink(missing_ok=True)
        return
    expected = path.read_text() if path.exists() else ""
    assert actual == expected, f"{path.name} differs; regenerate with UPDATE_GOLDEN=1 if the change is intended"


@pytest.mark.parametrize(("case", "fmt"), CASES, ids=[f"{c}-{f}" for c, f in CASES])
def test_render_output_equals_the_golden_file(case, fmt, capsys):
    code = main(["render", "--values", str(GOLDEN / f"{case}.values.yaml"), "--format", fmt])
    out, err = capsys.readouterr()
    assert code == 0, err
    _check(GOLDEN / f"{case}.{fmt}.yaml", out)
    _check(GOLDEN / f"{case}.{fmt}.stderr", err)


def test_every_golden_file_belongs_to_a_case():
    expected = {f"{c}.{f}.{ext}" for c, f in CASES for ext in ("yaml", "stderr")} | {
        f"{c}.values.yaml" for c, _ in CASES
    }
    on_disk = {p.name for p in GOLDEN.iterdir() if p.name != "README.md"}
    assert on_disk <= expected, f"stale golden files: {sorted(on_disk - expected)}"


def test_golden_cases_show_what_they_are_named_for():
    """A guard on the golden files themselves, so a regeneration cannot quietly lose the point of a case."""
    if UPDATE:
        pytest.skip("golden files are being rewritten")

    def permitted(case):
        configuration = yaml.safe_load((GOLDEN / f"{case}.kubevirt.yaml").read_text())["spec"]["configuration"]
        return configuration.get("permittedHostDevices")

    defaults = permitted("defaults-only")["pciHostDevices"]
    appended = permitted("defaults-plus-user")["pciHostDevices"]
    assert appended[: len(defaults)] == defaults and len(appended) == len(defaults) + 2
    assert [d["resourceName"] for d in permitted("replace-with-user")["pciHostDevices"]] == [
        "nvidia.com/T4",
        "nvidia.com/GA102GL_A10",
    ]
    assert permitted("replace-empty") is None
    assert "checks no device names" in (GOLDEN / "replace-empty.kubevirt.stderr").read_text()
    vgpu = permitted("vgpu")
    assert [d["resourceName"] for d in vgpu["pciHostDevices"]] == ["nvidia.com/L40S-24Q"]
    assert len(vgpu["mediatedDevices"]) == 2


def test_update_golden_is_refused_under_ci():
    with pytest.raises(pytest.fail.Exception, match="refused under CI"):
        _refuse_update_under_ci(True, "true")
    _refuse_update_under_ci(True, None)  # locally: allowed
    _refuse_update_under_ci(False, "true")  # under CI without it: the comparison runs
