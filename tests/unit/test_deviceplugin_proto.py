"""The vendored kubelet protos and their generated code: upstream's, field for field, and not stale.

Upstream is the k8s.io/kubelet module released with the control plane the tests run
(e2e.build.kubernetes_version(): v1.37.2 -> k8s.io/kubelet v0.37.2), fetched by `go`.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from e2e import build, support
from passthrough.deviceplugin.kubeletapi import codegen

pytestmark = pytest.mark.timeout(300)

MODULES = {
    "deviceplugin_v1beta1": "passthrough.deviceplugin.kubeletapi.deviceplugin_v1beta1.api_pb2",
    "podresources_v1": "passthrough.deviceplugin.kubeletapi.podresources_v1.api_pb2",
}
F = descriptor_pb2.FieldDescriptorProto


@pytest.fixture(scope="module")
def upstream(request) -> tuple[str, Path]:
    """(k8s.io/kubelet version, its folder in the Go module cache); a loud skip without `go`
    (a failure under CI)."""
    version = codegen.kubelet_module_version(build.kubernetes_version())
    if shutil.which("go") is None:
        support.cannot_run(request, "vendored-proto", f"`go` is not on PATH, so k8s.io/kubelet@{version} cannot be "
                           "fetched to compare the vendored protos with", once_key="proto")  # fmt: skip
    return version, codegen.download_kubelet_module(version)


def _compiled(text: str, tmp: Path, name: str) -> descriptor_pb2.FileDescriptorProto:
    """protoc's descriptor of one proto file, compiled as `make protos` would (gogo stripped)."""
    source = tmp / "src" / name
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(codegen.strip_for_python(text)[0])
    out = tmp / f"{name.replace('/', '_')}.pb"
    codegen.protoc([f"-I{tmp / 'src'}", f"--descriptor_set_out={out}", name])
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    assert len(files) == 1
    return files[0]


def _generated(package_dir: str) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    importlib.import_module(MODULES[package_dir]).DESCRIPTOR.CopyToProto(proto)
    return proto


def _shape(file: descriptor_pb2.FileDescriptorProto) -> dict:
    """Everything of a proto file that reaches the wire or the generated API, comments and file name aside."""
    messages: dict[str, dict] = {}
    enums: dict[str, list] = {}

    def walk_enums(items, prefix):
        for enum in items:
            enums[f"{prefix}.{enum.name}"] = [(v.name, v.number) for v in enum.value]

    def walk(items, prefix):
        for message in items:
            name = f"{prefix}.{message.name}"
            messages[name] = {
                "fields": [
                    {
                        "name": f.name,
                        "number": f.number,
                        "type": F.Type.Name(f.type),
                        "label": F.Label.Name(f.label),
                        "type_name": f.type_name,
                        "oneof": message.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
                        "proto3_optional": f.proto3_optional,
                    }
                    for f in message.field
                ],
                "map_entry": message.options.map_entry,
                "reserved": [(r.start, r.end) for r in message.reserved_range] + list(message.reserved_name),
            }
            walk(message.nested_type, name)
            walk_enums(message.enum_type, name)

    walk(file.message_type, f".{file.package}")
    walk_enums(file.enum_type, f".{file.package}")
    services = {
        service.name: [
            {
                "name": m.name,
                "input": m.input_type,
                "output": m.output_type,
                "client_streaming": m.client_streaming,
                "server_streaming": m.server_streaming,
            }
            for m in service.method
        ]
        for service in file.service
    }
    return {"package": file.package, "syntax": file.syntax, "messages": messages, "enums": enums, "services": services}


@pytest.mark.parametrize("proto", codegen.PROTOS, ids=lambda p: p.package_dir)
def test_generated_messages_and_services_match_upstream_field_for_field(proto, upstream, tmp_path):
    version, module = upstream
    expected = _shape(_compiled((module / proto.upstream_path).read_text(), tmp_path, proto.upstream_path))
    actual = _shape(_generated(proto.package_dir))
    assert expected["messages"] and expected["services"], "upstream compiled to nothing: wrong file?"
    assert actual["package"] == expected["package"]
    assert actual["syntax"] == expected["syntax"]
    assert sorted(actual["messages"]) == sorted(expected["messages"]), f"messages differ from k8s.io/kubelet {version}"
    for name, shape in expected["messages"].items():
        assert actual["messages"][name] == shape, f"{name} differs from k8s.io/kubelet {version}"
    assert actual["enums"] == expected["enums"]
    assert actual["services"] == expected["services"], f"services differ from k8s.io/kubelet {version}"


def test_the_services_we_serve_and_call_are_there():
    # A guard on what the shape test compares: the streaming flag of ListAndWatch, the map of envs.
    shape = _shape(_generated("deviceplugin_v1beta1"))
    methods = {m["name"]: m for m in shape["services"]["DevicePlugin"]}
    assert set(methods) == {"GetDevicePluginOptions", "ListAndWatch", "GetPreferredAllocation", "Allocate", "PreStartContainer"}
    assert methods["ListAndWatch"]["server_streaming"] and not methods["Allocate"]["server_streaming"]
    assert shape["messages"][".v1beta1.ContainerAllocateResponse.EnvsEntry"]["map_entry"]
    assert [m["name"] for m in shape["services"]["Registration"]] == ["Register"]
    assert [m["name"] for m in _shape(_generated("podresources_v1"))["services"]["PodResourcesLister"]] == [
        "List",
        "GetAllocatableResources",
        "Get",
    ]


@pytest.mark.parametrize("proto", codegen.PROTOS, ids=lambda p: p.package_dir)
def test_vendored_proto_is_upstreams_of_the_control_planes_release(proto, upstream):
    version, module = upstream
    expected = codegen.vendored_text((module / proto.upstream_path).read_text(), version, proto.upstream_path)
    assert proto.proto.read_text() == expected, (
        f"{proto.proto.name} in {proto.package_dir} is not k8s.io/kubelet {version}'s: "
        f"run `.venv/bin/python -m passthrough.deviceplugin.kubeletapi.codegen --vendor {version}`"
    )


def test_checked_in_generated_code_is_what_make_protos_writes(tmp_path):
    codegen.generate(tmp_path)
    for relative, text in codegen.generated_files().items():
        fresh = tmp_path / relative
        assert fresh.exists(), relative
        assert text == fresh.read_text(), f"{relative} is stale: run `make protos`"


def test_generated_code_imports_in_a_fresh_interpreter():
    # Catches imports that only work from the repository root, and protobuf/grpc runtime checks.
    code = "; ".join(f"import {m}_grpc" for m in MODULES.values())
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr


GOGO = """syntax = "proto3";

package v1beta1;

import "github.com/gogo/protobuf/gogoproto/gogo.proto";

option (gogoproto.goproto_stringer_all) = false;
option (gogoproto.stringer_all) =  true;
option go_package = "v1beta1";

message NUMANode {
    int64 ID = 1 [(gogoproto.customname) = "ID"];
    repeated string names = 2 [packed = false, (gogoproto.moretags) = "a,b", deprecated = true];
}
"""


def test_stripping_gogo_leaves_a_proto_that_compiles_and_says_what_went(tmp_path):
    text, removed = codegen.strip_for_python(GOGO)
    assert "gogo" not in text
    assert 'option go_package = "v1beta1";' in text
    assert "[packed = false, deprecated = true]" in text
    assert len(removed) == 5
    header = codegen.vendored_text(GOGO, "v0.20.0", "pkg/apis/deviceplugin/v1beta1/api.proto")
    assert "removed 5 gogoproto item(s)" in header and "//   import" in header
    file = _compiled(GOGO, tmp_path, "api.proto")
    assert [(f.name, f.number) for f in file.message_type[0].field] == [("ID", 1), ("names", 2)]


def test_kubelet_module_version_follows_the_kubernetes_release():
    assert codegen.kubelet_module_version("v1.37.2") == "v0.37.2"
    with pytest.raises(ValueError):
        codegen.kubelet_module_version("v2.0.0")
