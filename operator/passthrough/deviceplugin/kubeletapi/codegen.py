"""Vendor the kubelet's gRPC protos from the k8s.io/kubelet Go module and generate their Python code.

Two targets, one codegen: the device-plugin protos here (`PROTOS`), and the DRA kubelet
plugin's under `passthrough/dra/kubeletapi` (`DRA_PROTOS`: DRAPlugin, Registration and
DRAResourceHealth). `make protos` regenerates the
checked-in *_pb2.py, *_pb2.pyi and *_pb2_grpc.py of both from the vendored api.proto files; `python -m passthrough.deviceplugin.kubeletapi.codegen --vendor
v0.X.Y` first refreshes those files from the Go module (the Go module proxy, through `go`).
Tests use the same functions, so the checked-in code is exactly what these commands write.

The protos are compiled with the repository's `operator/` folder as the include root: the
generated code then imports its siblings as `passthrough.deviceplugin.kubeletapi...`, and
the descriptors get file names that cannot clash with another library's `api.proto` in
protobuf's process-wide descriptor pool (every upstream file is called api.proto).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

KUBELET_MODULE = "k8s.io/kubelet"
HERE = Path(__file__).resolve().parent
INCLUDE_ROOT = HERE.parents[2]  # operator/: protoc's -I, so generated imports are package paths


@dataclass(frozen=True)
class VendoredProto:
    package_dir: str  # sub-package of kubeletapi holding api.proto and its generated code
    upstream_path: str  # path inside the k8s.io/kubelet module
    home: Path = HERE  # the kubeletapi package it lives in

    @property
    def proto(self) -> Path:
        return self.home / self.package_dir / "api.proto"

    @property
    def module(self) -> str:
        """The generated module's import path (`passthrough....api_pb2`)."""
        return self.proto.with_name("api_pb2").relative_to(INCLUDE_ROOT).as_posix().replace("/", ".")

    @property
    def include_relative(self) -> str:
        return self.proto.relative_to(INCLUDE_ROOT).as_posix()


PROTOS = (
    VendoredProto("deviceplugin_v1beta1", "pkg/apis/deviceplugin/v1beta1/api.proto"),
    VendoredProto("podresources_v1", "pkg/apis/podresources/v1/api.proto"),
)

DRA_HOME = HERE.parents[1] / "dra" / "kubeletapi"
# The kubelet of 1.37 speaks DRA v1 (and v1beta1, which it converts); plugins register through
# the kubelet's plugin watcher (pluginregistration v1), as CSI drivers do. Device health
# (KEP-4680): the kubelet of 1.37 prefers DRAResourceHealth v1 and still takes v1alpha1, which v1
# supersedes; we serve v1.
DRA_PROTOS = (
    VendoredProto("dra_v1", "pkg/apis/dra/v1/api.proto", DRA_HOME),
    VendoredProto("pluginregistration_v1", "pkg/apis/pluginregistration/v1/api.proto", DRA_HOME),
    VendoredProto("drahealth_v1", "pkg/apis/dra-health/v1/api.proto", DRA_HOME),
)
ALL_PROTOS = PROTOS + DRA_PROTOS

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class GoUnavailable(RuntimeError):
    """No `go` on PATH: the upstream module cannot be fetched."""


class CodegenError(RuntimeError):
    """A step of vendoring or generation failed; the message says which."""


def kubelet_module_version(kubernetes_version: str) -> str:
    """The k8s.io/kubelet tag released with a Kubernetes version: v1.37.2 -> v0.37.2."""
    match = re.fullmatch(r"v?1\.(\d+)\.(\d+)", kubernetes_version)
    if not match:
        raise ValueError(f"{kubernetes_version!r} is not a Kubernetes release like v1.37.2")
    return f"v0.{match.group(1)}.{match.group(2)}"


def download_kubelet_module(version: str) -> Path:
    """The folder of k8s.io/kubelet@version in the Go module cache, downloading it if needed."""
    go = shutil.which("go")
    if go is None:
        raise GoUnavailable("`go` is not on PATH; it fetches k8s.io/kubelet from the Go module proxy")
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    # A throwaway module: `go mod download` of a versioned path needs a module to run in.
    with tempfile.TemporaryDirectory(prefix="kubelet-mod-") as tmp:
        steps = [[go, "mod", "init", "passthrough.io/protofetch"], [go, "mod", "download", "-json", f"{KUBELET_MODULE}@{version}"]]
        for step in steps:
            done = subprocess.run(step, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise CodegenError(f"`{' '.join(step[1:])}` failed: {done.stderr.strip() or done.stdout.strip()}")
    info = json.loads(done.stdout)
    if info.get("Error") or not info.get("Dir"):
        raise CodegenError(f"go mod download {KUBELET_MODULE}@{version}: {info.get('Error') or 'no Dir in its answer'}")
    return Path(info["Dir"])


# gogoproto (older kubelet releases) is a Go-only extension: its import cannot be resolved
# by protoc here and its options change nothing in the wire format or the Python code.
_GOGO_IMPORT = re.compile(r'^[ \t]*import[ \t]+(?:public[ \t]+)?"[^"]*gogo\.proto"[ \t]*;[ \t]*\n', re.M)
_GOGO_FILE_OPTION = re.compile(r"^[ \t]*option[ \t]*\(gogoproto\.\w+\)[ \t]*=[^;]*;[ \t]*\n", re.M)
_GOGO_FIELD_OPTION = re.compile(r'\(gogoproto\.\w+\)\s*=\s*(?:"(?:[^"\\]|\\.)*"|[\w.]+)')
_FIELD_OPTIONS = re.compile(r"\s*\[([^\[\]]*)\]")


def strip_for_python(text: str) -> tuple[str, list[str]]:
    """The proto without what Python code generation cannot use, and a list of what went."""
    removed: list[str] = []

    def drop(kind: str):
        def replace(match: re.Match) -> str:
            removed.append(f"{kind} {match.group(0).strip()}")
            return ""

        return replace

    text = _GOGO_IMPORT.sub(drop("import"), text)
    text = _GOGO_FILE_OPTION.sub(drop("file option"), text)

    def field_options(match: re.Match) -> str:
        inner = match.group(1)
        if "gogoproto." not in inner:
            return match.group(0)
        kept = [o.strip() for o in _GOGO_FIELD_OPTION.sub(drop("field option"), inner).split(",") if o.strip()]
        return f" [{', '.join(kept)}]" if kept else ""

    text = _FIELD_OPTIONS.sub(field_options, text)
    return text, removed


def vendored_text(upstream: str, module_version: str, upstream_path: str) -> str:
    """The checked-in proto: a header saying where it comes from and what was changed, then the proto."""
    stripped, removed = strip_for_python(upstream)
    header = [
        f"// Vendored from {KUBELET_MODULE} {module_version}, {upstream_path}.",
        "// Changed for Python code generation (gogoproto is a Go-only extension): "
        + ("nothing; this release has no gogoproto import or option." if not removed else f"removed {len(removed)} gogoproto item(s):"),
        *[f"//   {item}" for item in removed],
        "// Refresh: python -m passthrough.deviceplugin.kubeletapi.codegen --vendor <version>; regenerate: make protos.",
        "",
    ]
    return "\n".join(header) + stripped


def vendor(module_version: str) -> list[Path]:
    """Write every vendored proto from k8s.io/kubelet@module_version."""
    module = download_kubelet_module(module_version)
    written = []
    for proto in ALL_PROTOS:
        upstream = (module / proto.upstream_path).read_text()
        proto.proto.write_text(vendored_text(upstream, module_version, proto.upstream_path))
        written.append(proto.proto)
    return written


def protoc(args: list[str]) -> None:
    """Run grpc_tools' bundled protoc (a test and codegen dependency), raising with its message."""
    import importlib.resources

    well_known = importlib.resources.files("grpc_tools") / "_proto"
    # In a child process, so that protoc's own error lines are captured for the message.
    command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{well_known}", *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise CodegenError(f"protoc {' '.join(args)} failed: {done.stderr.strip()}")


def generate(out_root: Path = INCLUDE_ROOT) -> list[Path]:
    """Generate the Python code of every vendored proto under out_root (operator/ for the real tree)."""
    written = []
    for proto in ALL_PROTOS:
        protoc([f"-I{INCLUDE_ROOT}", f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", proto.include_relative])
        folder = out_root / Path(proto.include_relative).parent
        written += [folder / f"api{suffix}" for suffix in GENERATED_SUFFIXES]
    return written


def generated_files() -> dict[str, str]:
    """The checked-in generated files, by path relative to operator/."""
    files = {}
    for proto in ALL_PROTOS:
        for suffix in GENERATED_SUFFIXES:
            path = proto.proto.with_name(f"api{suffix}")
            files[path.relative_to(INCLUDE_ROOT).as_posix()] = path.read_text() if path.exists() else ""
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m passthrough.deviceplugin.kubeletapi.codegen", description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", metavar="VERSION", help="first refresh the vendored protos from k8s.io/kubelet@VERSION (e.g. v0.37.2)")
    args = parser.parse_args(argv)
    try:
        if args.vendor:
            for path in vendor(args.vendor):
                print(f"vendored {path.relative_to(INCLUDE_ROOT.parent)}")
        for path in generate():
            print(f"generated {path.relative_to(INCLUDE_ROOT.parent)}")
    except (GoUnavailable, CodegenError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
