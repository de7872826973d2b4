"""The vendored DRA kubelet-plugin protos (DRAPlugin, Registration, DRAResourceHealth) and their generated code: upstream's (k8s.io/kubelet of
the control plane's release), field for field, and not stale. The same checks as the device-plugin
protos' (`test_deviceplugin_proto`), over the codegen's second target."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from passthrough.deviceplugin.kubeletapi import codegen
from tests.unit.test_deviceplugin_proto import _compiled, _shape, upstream  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(300)


def _generated(proto: codegen.VendoredProto) -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto()
    importlib.import_module(proto.module).DESCRIPTOR.CopyToProto(file)
    return file


@pytest.mark.parametrize("proto", codegen.DRA_PROTOS, ids=lambda p: p.package_dir)
def test_generated_dra_messages_and_services_match_upstream_field_for_field(proto, upstream, tmp_path):
    version, module = upstream
    expected = _shape(_compiled((module / proto.upstream_path).read_text(), tmp_path, proto.upstream_path))
    assert expected["messages"] and expected["services"], "upstream compiled to nothing: wrong file?"
    assert _shape(_generated(proto)) == expected, f"{proto.package_dir} differs from k8s.io/kubelet {version}"


@pytest.mark.parametrize("proto", codegen.DRA_PROTOS, ids=lambda p: p.package_dir)
def test_vendored_dra_proto_is_upstreams_of_the_control_planes_release(proto, upstream):
    version, module = upstream
    assert proto.proto.read_text() == codegen.vendored_text((module / proto.upstream_path).read_text(), version, proto.upstream_path), (
        f"{proto.package_dir}/api.proto is not k8s.io/kubelet {version}'s: "
        f"run `.venv/bin/python -m passthrough.deviceplugin.kubeletapi.codegen --vendor {version}`"
    )


def test_the_dra_services_we_serve_are_there():
    dra = _shape(_generated(codegen.DRA_PROTOS[0]))
    assert dra["package"] == "k8s.io.kubelet.pkg.apis.dra.v1"  # the kubelet calls /k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/...
    assert [m["name"] for m in dra["services"]["DRAPlugin"]] == ["NodePrepareResources", "NodeUnprepareResources"]
    assert dra["messages"][".k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesResponse.ClaimsEntry"]["map_entry"]
    registration = _shape(_generated(codegen.DRA_PROTOS[1]))
    assert [m["name"] for m in registration["services"]["Registration"]] == ["GetInfo", "NotifyRegistrationStatus"]


def test_the_health_service_is_the_one_the_kubelet_prefers_and_streams():
    health = _shape(_generated(codegen.DRA_PROTOS[2]))
    # The kubelet of 1.37 picks "v1.DRAResourceHealth" before "v1alpha1.DRAResourceHealth" from
    # the registration's supported versions, and calls /v1.DRAResourceHealth/NodeWatchResources.
    assert health["package"] == "v1"
    [watch] = health["services"]["DRAResourceHealth"]
    assert watch["name"] == "NodeWatchResources" and watch["server_streaming"] and not watch["client_streaming"]
    assert health["enums"][".v1.HealthStatus"] == [("UNKNOWN", 0), ("HEALTHY", 1), ("UNHEALTHY", 2)]


def test_every_generated_module_loads_into_one_descriptor_pool():
    """podresources and DRAResourceHealth are both proto package `v1`: their names must not clash
    in protobuf's process-wide pool (the agent imports both)."""
    code = "; ".join(f"import {p.module}_grpc" for p in codegen.ALL_PROTOS)
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr


def test_both_targets_are_generated_by_one_codegen(tmp_path):
    codegen.generate(tmp_path)
    files = codegen.generated_files()
    assert {p.module.rsplit(".", 1)[0].replace(".", "/") + "/api_pb2.py" for p in codegen.DRA_PROTOS} <= set(files)
    for relative, text in files.items():
        assert text == (tmp_path / relative).read_text(), f"{relative} is stale: run `make protos`"


def test_generated_dra_code_imports_in_a_fresh_interpreter():
    code = "; ".join(f"import {p.module}_grpc" for p in codegen.DRA_PROTOS)
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr
