"""What `passthrough render` prints, judged by the API server against its owners' own schemas:
the Cozystack Package by Cozystack's Package CRD (`e2e/data/cozystack/`), the KubeVirt CR body
by the KubeVirt CRD that KubeVirt's own generator writes (`e2e/kubevirt.py`), for every values
case here (those the KubeVirt tests use: the defaults, extra entries and gates, vGPU, an empty
allow-list, DRA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.cluster import REPO, install_crds

pytestmark = pytest.mark.cluster

PACKAGE_CRD = REPO / "e2e/data/cozystack/packages.cozystack.io.yaml"
PACKAGE = "cozystack.kubevirt"

CASES = {
    "defaults": {},
    "extra entries and gates": {
        "kubevirt": {"extraFeatureGates": ["Snapshot", "VMExport"]},
        "gpu": {"permittedHostDevices": {"pciHostDevices": [
            {"pciVendorSelector": "1AF4:1000", "resourceName": "example.com/virtio"},
            {"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/GA102GL_A10", "externalResourceProvider": True},
        ]}},
    },
    "vgpu": {"gpu": {"variant": "vgpu", "permittedHostDevices": {"mediatedDevices": [
        {"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q"},
    ]}, "mediatedDevicesConfiguration": {"mediatedDeviceTypes": ["nvidia-222"], "nodeMediatedDeviceTypes": [
        {"nodeSelector": {"nvidia.com/gpu.product": "Tesla-T4"}, "mediatedDeviceTypes": ["nvidia-222", "nvidia-223"]},
    ]}}},
    "empty allow-list": {"gpu": {"replaceDefaults": True}},
    "dra": {"dra": {"enabled": True}, "kubevirt": {"namespace": "cozy-kubevirt"}},
}  # fmt: skip


def render(values: dict, fmt: str, tmp_path: Path) -> dict:
    """What `passthrough render --format FMT` prints for `values`, parsed."""
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    proc = subprocess.run([sys.executable, "-m", "passthrough", "render", "--values", str(path), "--format", fmt],
                          capture_output=True, text=True, check=False, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def package_crd(cluster):
    """Cozystack's Package CRD in the shared control plane, removed after this module."""
    install_crds(cluster, [PACKAGE_CRD])
    yield
    cluster.kubectl("delete", "crd", "packages.cozystack.io", check=False)


@pytest.mark.parametrize("case", CASES)
def test_the_package_is_what_cozystacks_schema_takes_and_keeps(cluster, package_crd, case, tmp_path):
    package = render(CASES[case], "cozystack-package", tmp_path)
    cluster.kubectl("apply", "--server-side", "--field-manager=admin", "-f", "-", input=json.dumps(package))
    stored = json.loads(cluster.kubectl("get", "packages.cozystack.io", PACKAGE, "-o", "json").stdout)
    # Nothing pruned or defaulted away: Cozystack's kubevirt chart gets the values as rendered.
    assert stored["spec"] == package["spec"]
    cluster.kubectl("delete", "packages.cozystack.io", PACKAGE)


def test_the_package_schema_refuses_a_wrong_envelope(cluster, package_crd, tmp_path):
    """The check above can fail: an envelope Cozystack's schema does not describe is refused."""
    package = render(CASES["defaults"], "cozystack-package", tmp_path)
    package["spec"]["components"]["kubevirt"]["enabled"] = "yes"
    proc = cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(package), check=False)
    assert proc.returncode != 0 and "spec.components.kubevirt.enabled" in proc.stderr, proc.stderr


@pytest.mark.parametrize("case", CASES)
def test_the_kubevirt_body_is_what_kubevirts_own_crd_takes(cluster, case, tmp_path):
    body = render(CASES[case], "kubevirt", tmp_path)
    namespace = body["metadata"]["namespace"]
    cluster.kubectl("create", "namespace", namespace, check=False)
    proc = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=passthrough-operator", "-o", "json",
                           "-f", "-", input=json.dumps(body))  # fmt: skip
    # The API server's answer is the object as stored: nothing of ours pruned by KubeVirt's schema.
    stored = json.loads(proc.stdout)
    assert stored["spec"]["configuration"] == body["spec"]["configuration"]
