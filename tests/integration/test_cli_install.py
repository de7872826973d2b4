"""The `passthrough` command as an admin installs it: a wheel built from the sources, installed
into a fresh virtualenv, run from outside the repository.

Offline: the wheel is built with the test environment's setuptools (no build isolation) and
installed without resolving its dependencies; the fresh environment reaches the dependencies the
lock pins through a path entry to the test environment's packages (not its editable install of
this package: a path entry's own .pth files are not read). What pip would resolve is checked
on the wheel's metadata: its Requires-Dist are pyproject's dependencies.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

from passthrough import __version__

ROOT = Path(__file__).resolve().parents[2]
IDS_2025 = ROOT / "e2e" / "data" / "pci.ids.2025-07-11"


def _run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{argv}: {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel .` makes of a copy of the sources (the build writes beside them)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "operator" / "passthrough", src / "operator" / "passthrough",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))  # fmt: skip
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", dist, src, cwd=src)  # fmt: skip
    [built] = dist.glob("passthrough_operator-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A fresh virtualenv with the wheel installed; its bin directory and the environment to run it in."""
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=venv.parent)
    python = venv / "bin" / "python"
    _run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=venv.parent)
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=venv.parent).stdout.strip())
    (site / "test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}"
    return venv / "bin", env


def test_the_wheel_holds_the_package_its_data_and_the_command(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    # Every module and every file the code reads (the KubeVirt templates, the default GPU table).
    package = ROOT / "operator"
    wanted = {str(p.relative_to(package)) for p in (package / "passthrough").rglob("*")
              if p.suffix in (".py", ".j2", ".yaml") and "__pycache__" not in p.parts}  # fmt: skip
    assert "passthrough/kubevirt/data/default-gpus.yaml" in wanted and "passthrough/kubevirt/templates/kubevirt.yaml.j2" in wanted
    assert wanted - set(names) == set()
    assert not any(n.startswith(("tests/", "e2e/")) for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "passthrough = passthrough.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    metadata = email.parser.Parser().parsestr(zipfile.ZipFile(wheel).read(meta).decode())
    assert metadata["Version"] == __version__
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    required = [r for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert sorted(r.replace(" ", "") for r in required) == sorted(d.replace(" ", "") for d in declared)


def test_the_installed_command_runs_from_anywhere_with_the_wheels_own_files(installed, tmp_path):
    bin_dir, env = installed
    where = _run(bin_dir / "python", "-c", "import passthrough; print(passthrough.__file__)", cwd=tmp_path, env=env).stdout
    assert where.startswith(str(bin_dir.parent)), where  # the wheel's copy, not the repository's
    assert _run("passthrough", "--version", cwd=tmp_path, env=env).stdout == f"passthrough {__version__}\n"
    # The install steps' commands: a resource name, and the KubeVirt configuration from values.
    named = _run("passthrough", "resource-name", "--pci-ids", IDS_2025, "10de:2236", cwd=tmp_path, env=env)
    assert named.stdout == "nvidia.com/GA102GL_A10\n" and "version 2025.07.11" in named.stderr
    (tmp_path / "values.yaml").write_text("kubevirt: {namespace: kubevirt}\n")
    rendered = yaml.safe_load(_run("passthrough", "render", "--values", "values.yaml", cwd=tmp_path, env=env).stdout)
    entries = rendered["spec"]["configuration"]["permittedHostDevices"]["pciHostDevices"]
    assert {"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/GA102GL_A10",
            "externalResourceProvider": True} in entries  # fmt: skip
    crds = list(yaml.safe_load_all(_run("passthrough", "crds", cwd=tmp_path, env=env).stdout))
    assert {c["spec"]["names"]["kind"] for c in crds} >= {"NodePCIDevice", "PCIDevice", "PassthroughConfig"}
