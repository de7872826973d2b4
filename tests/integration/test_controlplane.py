"""The local control plane is a real one: kubectl, CRD schemas, garbage collection, namespaces."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from e2e import cluster as local

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster


def _wait(predicate, timeout=60.0, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def test_kubectl_apply_of_crds_and_printer_columns(cluster):
    applied = cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    assert "nodepcidevices.passthrough.io" in applied.stdout
    name = f"pci-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice",
        "metadata": {"name": name}, "spec": {"assignedNamespace": "team-a"},
    }))
    try:
        status = {
            "status": {
                "attributes": {"pciAddress": "0000:3b:00.0", "vendorID": "10de", "deviceID": "2236",
                               "class": "030200", "nodeName": "gpu-1", "name": "GA102GL [A10]"},
                "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                                "lastTransitionTime": "2026-01-01T00:00:00Z"}],
            }
        }
        cluster.kubectl("patch", "npci", name, "--subresource=status", "--type=merge", "-p", json.dumps(status))
        out = cluster.kubectl("get", "npci", name).stdout.splitlines()
        assert out[0].split() == ["NAME", "NODE", "ADDRESS", "READY", "ASSIGNED", "ATTACHED", "NAMESPACE", "AGE"]
        assert out[1].split()[:5] == [name, "gpu-1", "0000:3b:00.0", "True", "team-a"]
        wide = cluster.kubectl("get", "npci", name, "-o", "wide").stdout.splitlines()[0].split()
        assert {"VENDOR", "DEVICE", "CLASS", "RESOURCE"} <= set(wide)
    finally:
        cluster.kubectl("delete", "npci", name, "--wait=false")


def test_status_is_a_subresource(cluster):
    name = f"pci-{uuid.uuid4().hex[:8]}"
    manifest = {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice", "metadata": {"name": name},
                "status": {"resourceName": "nvidia.com/X"}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(manifest))
    try:
        got = json.loads(cluster.kubectl("get", "npci", name, "-o", "json").stdout)
        assert "status" not in got  # a create cannot write status
        assert got["spec"] == {"assignedNamespace": ""}  # the schema's default
    finally:
        cluster.kubectl("delete", "npci", name)


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({"kind": "NodePCIDevice", "metadata": {"name": "pci-bad-ns"}, "spec": {"assignedNamespace": "Team_A"}},
         "must be empty or a namespace name"),
        ({"kind": "PassthroughConfig", "metadata": {"name": "cluster"},
          "spec": {"gpu": {"permittedHostDevices": {"pciHostDevices": [
              {"pciVendorSelector": "10de-2236", "resourceName": "nvidia.com/GA102GL_A10"}]}}}},
         "should match '^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$'"),
        ({"kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": {"gpu": {"variant": "sriov"}}},
         'Unsupported value: "sriov": supported values: "default", "vgpu"'),
        ({"kind": "PassthroughConfig", "metadata": {"name": "second"}, "spec": {}},
         "must be named 'cluster'"),
    ],
    ids=["assigned-namespace", "vendor-selector", "variant", "singleton"],
)
def test_the_api_server_refuses_invalid_objects_with_the_schemas_message(cluster, manifest, message):
    manifest = {"apiVersion": "passthrough.io/v1alpha1", **manifest}
    result = cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert cluster.kubectl("get", manifest["kind"].lower(), manifest["metadata"]["name"], check=False).returncode != 0


def test_kubevirt_crds_carry_kubevirts_real_schema(cluster):
    explained = cluster.kubectl("explain", "kubevirt.spec.configuration.permittedHostDevices.pciHostDevices").stdout
    assert "pciVendorSelector" in explained and "externalResourceProvider" in explained
    explained = cluster.kubectl("explain", "virtualmachine.spec.template.spec.domain.devices.hostDevices").stdout
    assert "deviceName" in explained
    # An unknown field under a real KubeVirt type is refused, so tests cannot write what KubeVirt would not read.
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "bad", "namespace": "default"},
          "spec": {"template": {"spec": {"domain": {"devices": {"hostDevices": [{"deviceName": "x", "nmae": "y"}]}}}}}}
    result = cluster.kubectl("create", "--validate=strict", "-f", "-", input=json.dumps(vm), check=False)
    assert result.returncode != 0 and "nmae" in result.stderr


def test_garbage_collector_deletes_dependents_of_a_deleted_node(cluster):
    node = f"node-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}}))
    uid = cluster.kubectl("get", "node", node, "-o", "jsonpath={.metadata.uid}").stdout
    dependent = f"pci-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice",
        "metadata": {"name": dependent, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]},
    }))
    cluster.kubectl("delete", "node", node)
    assert _wait(lambda: cluster.kubectl("get", "npci", dependent, check=False).returncode != 0)


def test_namespace_deletion_completes(cluster):
    ns = f"ns-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("create", "configmap", "x", "-n", ns)
    cluster.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=60s")
    assert cluster.kubectl("get", "namespace", ns, check=False).returncode != 0


def test_a_second_cluster_starts_on_other_ports_and_stops_without_leftovers(cluster, tmp_path):
    second = local.LocalCluster(workdir=tmp_path, bin_dir=cluster.bin_dir)
    second.start()
    try:
        assert second.server != cluster.server
        assert second.kubectl("get", "--raw", "/readyz").stdout.strip() == "ok"
        pids = [p.pid for p in second.processes]
        assert len(pids) == 3
    finally:
        second.stop()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
