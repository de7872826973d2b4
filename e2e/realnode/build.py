"""Build the programs of a real node: containerd 2.x (daemon, runc shim, ctr), the CNI plugins,
pause, and kube-proxy of the control plane's Kubernetes.

containerd and the CNI plugins come from wrapper modules under `e2e/controlplane/node/` (one
each, so each builds with the dependency versions its own release asks for); kube-proxy from
`node/kube-proxy`, the control plane's Kubernetes module (`e2e/build.py`) with the few modules
only kube-proxy imports added, built with the same flags: the same release, and Go's build cache
of the control plane's packages serves it. runc is
`e2e/oci.py`'s. The binaries are cached outside the work tree beside the control plane's,
keyed by everything that goes into them, complete only once their manifest is written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from e2e import build as controlplane

MODULES = controlplane.MODULES / "node"


@dataclass(frozen=True)
class Program:
    """One `go build` in one module: the binaries it makes and how."""

    module: Path
    packages: dict[str, str]  # binary name -> package path
    tags: str = ""
    ldflags: str = "-s -w"


def containerd_version() -> str:
    return controlplane._required_version(MODULES / "containerd", "github.com/containerd/containerd/v2")


def cni_version() -> str:
    return controlplane._required_version(MODULES / "cni", "github.com/containernetworking/plugins")


def programs() -> list[Program]:
    containerd = containerd_version()
    stamp = "github.com/containerd/containerd/v2/version"
    containerd_ldflags = f"-s -w -X {stamp}.Version={containerd} -X {stamp}.Revision=module-proxy -X {stamp}.Package=github.com/containerd/containerd/v2"
    cmd = "github.com/containerd/containerd/v2/cmd"
    plugins = "github.com/containernetworking/plugins/plugins"
    [kubernetes] = [t for t in controlplane.targets() if t.name == "kubernetes"]
    return [
        # The tags containerd's own Makefile builds with; cgo off leaves out the btrfs snapshotter.
        Program(
            MODULES / "containerd",
            {"containerd": f"{cmd}/containerd", "ctr": f"{cmd}/ctr"},
            tags="urfave_cli_no_docs",
            ldflags=containerd_ldflags,
        ),
        Program(
            MODULES / "containerd",
            {"containerd-shim-runc-v2": f"{cmd}/containerd-shim-runc-v2"},
            tags="urfave_cli_no_docs no_grpc",
            ldflags=containerd_ldflags,
        ),
        Program(MODULES / "containerd", {"pause": "passthrough.io/e2e/controlplane/node/containerd/pause"}),
        Program(
            MODULES / "cni",
            {name: f"{plugins}/{path}" for name, path in CNI_PLUGINS.items()},
            ldflags=f"-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion={cni_version()}",
        ),
        Program(MODULES / "kube-proxy", {"kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy"}, ldflags=kubernetes.ldflags),
    ]


CNI_PLUGINS = {
    "bridge": "main/bridge",
    "host-local": "ipam/host-local",
    "loopback": "main/loopback",
    "portmap": "meta/portmap",
}


def binaries() -> tuple[str, ...]:
    return tuple(name for program in programs() for name in program.packages)


def cache_key() -> str:
    digest = hashlib.sha256(controlplane._go_version().encode())
    modules = sorted({program.module for program in programs()})
    for module in modules:
        for path in [module / "go.mod", module / "go.sum", *sorted(module.rglob("*.go"))]:
            digest.update(str(path.relative_to(module.parent)).encode() + b"\0")
            digest.update(path.read_bytes())
    for program in programs():
        digest.update(json.dumps([program.packages, program.tags, program.ldflags], sort_keys=True).encode())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    name = (
        f"containerd-{containerd_version()}-cni-{cni_version()}-k8s-{controlplane.kubernetes_version()}-{cache_key()}"
    )
    return controlplane.cache_root() / "node" / name


def build(directory: Path) -> Path:
    """Build every program into a fresh directory beside `directory`, then move it in place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(f"{directory.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = directory.parent / f"{directory.name}.partial-{os.getpid()}"
    bin_dir = staging / "bin"
    bin_dir.mkdir(parents=True)
    log_path = directory.parent / f"{directory.name}.build.log"
    log_path.write_text(f"# node build, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    started = time.monotonic()
    go = shutil.which("go") or "go"
    downloaded: set[Path] = set()
    for program in programs():
        if program.module not in downloaded:
            controlplane._step(f"download {program.module.name} modules", [go, "mod", "download"], program.module, log_path)
            downloaded.add(program.module)
        packages = list(program.packages.values())
        tags = ["-tags", program.tags] if program.tags else []
        listed = controlplane._step(
            f"list {', '.join(program.packages)} packages", [go, "list", *tags, "-deps", *packages], program.module, log_path
        )
        total = len([line for line in listed.splitlines() if line and not line.startswith("go: ")])
        out = bin_dir if len(packages) > 1 else bin_dir / next(iter(program.packages))
        controlplane._step(
            f"build {', '.join(program.packages)}",
            [go, "build", "-v", "-trimpath", *tags, "-ldflags", program.ldflags, "-o", str(out), *packages],
            program.module,
            log_path,
            progress_total=total,
        )
    for name in binaries():
        if not (bin_dir / name).is_file():
            raise controlplane.BuildError(f"node build produced no {name}; see {log_path}")
    elapsed = time.monotonic() - started
    (staging / "build-info.json").write_text(json.dumps({"seconds": round(elapsed, 1), "go": controlplane._go_version()}))
    (staging / "manifest.json").write_text(json.dumps(controlplane._manifest(bin_dir, binaries()), indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    minutes, seconds = divmod(int(elapsed), 60)
    print(f"[node] built in {minutes}m{seconds:02d}s into {directory}", file=sys.stderr, flush=True)
    return directory / "bin"


def ensure_binaries() -> Path:
    """The directory holding the node's programs, building them first when the cache lacks them."""
    directory = cache_dir()
    if found := controlplane.cached_binaries(directory, binaries()):
        return found
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same entry
        if found := controlplane.cached_binaries(directory, binaries()):
            return found
        if directory.exists():
            print(f"[node] cache entry {directory} is incomplete or changed; rebuilding", file=sys.stderr)
        return build(directory)


def main() -> int:
    try:
        print(ensure_binaries())
    except controlplane.BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
