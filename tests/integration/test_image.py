"""The container image: built from the Dockerfile as `make image` builds it (e2e/image.py), then run.

The build is the slow part (cold: buildah and mmdebstrap installed from Debian's packages,
the base made, then the build; a few minutes); an image already built from the same files
is reused.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from e2e import fakesysfs, image, support

ROOT = image.ROOT
COMPILERS = ("gcc", "cc", "c++", "g++", "x86_64-linux-gnu-gcc", "aarch64-linux-gnu-gcc", "clang", "tcc")
TEST_ONLY = ("pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "grpcio-tools", "cryptography", "psutil")


@pytest.fixture(scope="module")
def built(request) -> image.Built:
    """The image, built (or found current) once for the module; a loud skip where no builder can
    be had (a failure under CI)."""
    reason = image.why_unavailable()
    if reason is not None:
        support.cannot_run(request, "container-image", reason, once_key="image")
    return image.build()


@pytest.fixture(scope="module")
def ctr(built):
    with image.container(built.name) as running:
        yield running


def _ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


# -- what goes in (no builder needed) -------------------------------------------------------


def test_the_lock_pins_every_runtime_dependency_within_its_range():
    pins = image.locked()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for line in declared:
        req = Requirement(line)
        name = str(canonicalize_name(req.name))
        assert name in pins, f"{name} is a dependency in pyproject.toml but not in requirements.lock; run `make image`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"requirements.lock pins {name}=={pins[name]}, outside pyproject.toml's {req.specifier}; run `make image`"
        )
    assert not set(pins) & {str(canonicalize_name(n)) for n in TEST_ONLY}, "a test dependency is in requirements.lock"


def test_the_dockerfile_builds_from_the_base_made_here():
    froms = re.findall(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert froms and set(froms) == {image.BASE}, f"every FROM must be {image.BASE} (e2e/image.py stores it): {froms}"


def test_the_image_is_the_one_the_chart_pulls():
    values = (ROOT / "charts/passthrough-operator/values.yaml").read_text()
    assert re.search(r"^image:\n  repository: passthrough-operator\n", values, re.M)
    assert image.name() == f"passthrough-operator:{metadata.version('passthrough-operator')}"


# -- the built image ------------------------------------------------------------------------


@pytest.mark.timeout(1800)
def test_passthrough_version_is_the_package_version(built, ctr):
    out = _ok(ctr.run(["passthrough", "--version"]))
    assert out.split()[-1] == metadata.version("passthrough-operator"), out


@pytest.mark.timeout(1800)
def test_every_module_of_the_package_imports_in_the_image(built, ctr):
    # What `--version` and `discover` do not reach: the operator, the agent, the device plugin.
    # (codegen is `make protos`' tool, which needs grpcio-tools, a test dependency.)
    script = (
        "import importlib, pkgutil, passthrough\n"
        "names = [m.name for m in pkgutil.walk_packages(passthrough.__path__, 'passthrough.')\n"
        "         if not m.name.endswith(('.__main__', '.codegen'))]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(len(names))\n"
    )
    assert int(_ok(ctr.run(["python3", "-c", script]))) > 20


@pytest.mark.timeout(1800)
def test_discover_reads_a_fixture_host_with_the_images_own_pci_ids(built, ctr, tmp_path):
    host = tmp_path / "host"  # tmp_path itself is 0700; the image's user must read this
    fakesysfs.gpu_node(host)
    args = ["passthrough", "discover", "--all", "-o", "json", "--sysfs-root", "/host/sys", "--proc-root", "/host/proc"]
    result = ctr.run(args, volumes=[f"{host}:/host:ro"])
    found = json.loads(_ok(result))
    assert "pci.ids" not in result.stderr, result.stderr  # no "no pci.ids found" warning

    # The same code on this machine, over the same tree and the image's pci.ids, says the same.
    pci_ids = ctr.root / "usr/share/misc/pci.ids"
    here = subprocess.run(
        [sys.executable, "-m", *args[:-4], "--sysfs-root", f"{host}/sys", "--proc-root", f"{host}/proc",
         "--pci-ids", str(pci_ids)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert found == json.loads(here.stdout)
    gpus = [d for d in found["devices"] if d["vendorID"] == "10de" and d["deviceID"] == "2236"]
    assert [d["resourceName"] for d in gpus] == ["nvidia.com/GA102GL_A10"] * 2
    assert any(not d["eligible"] for d in found["devices"])  # --all: the bridges too


@pytest.mark.timeout(1800)
def test_the_image_runs_as_a_named_non_root_user_by_default(built, ctr):
    assert _ok(ctr.run(["id", "-u"])).strip() == "65532"  # the chart's runAsUser for the operator
    # Kopf names the operator by getpass.getuser() (no POD_ID), which fails for a uid without a name.
    assert _ok(ctr.run(["python3", "-c", "import getpass; print(getpass.getuser())"])).strip() == "nonroot"


@pytest.mark.timeout(1800)
def test_the_image_holds_no_compiler(built, ctr):
    bins = ("usr/bin", "usr/local/bin", "bin", "opt/passthrough/bin")
    # lexists: a link in the image (to /etc/alternatives/...) must not be followed on this host.
    present = [f"/{d}/{c}" for d in bins for c in COMPILERS if os.path.lexists(ctr.root / d / c)]
    assert not present, present
    status = (ctr.root / "var/lib/dpkg/status").read_text()
    packages = set(re.findall(r"^Package: (\S+)", status, re.M))
    toolchain = {p for p in packages if re.match(r"(gcc-\d+|g\+\+|cpp|clang|binutils|libc6-dev|build-essential)", p)}
    assert not toolchain - {p for p in toolchain if p.endswith("-base")}, toolchain


@pytest.mark.timeout(1800)
def test_the_image_holds_exactly_the_lock_and_the_package(built, ctr):
    site = next((ctr.root / "opt/passthrough/lib").glob("python3*/site-packages"))
    installed = {
        str(canonicalize_name(m.group(1)))
        for path in site.glob("*.dist-info")
        if (m := re.match(r"(.+?)-[^-]+\.dist-info$", path.name))
    }
    assert installed == set(image.locked()) | {"passthrough-operator"}
    assert not installed & {str(canonicalize_name(n)) for n in TEST_ONLY}
    assert not (site / "grpc_tools").exists() and not (site / "_pytest").exists()
