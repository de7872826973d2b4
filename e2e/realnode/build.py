"""Build the programs of a real node: containerd 2.x (daemon, runc shim, ctr), the CNI plugins,
pause, and kube-proxy of the control plane's Kubernetes.

containerd and the CNI plugins come from wrapper modules under `e2e/controlplane/node/` (one
each, so each builds with the dependency versions its own release asks for); kube-proxy from
`node/kube-proxy`, the control plane's Kubernetes module (`e2e/build.py`) with the few modules
only kube-proxy imports added, built with the same flags: the same release, and Go's build cache
of the control plane's packages serves it. runc is
`e2e/oci.py`'s. The binaries are built as every Go program of the suite is (`e2e/gobuild.py`),
cached beside the control plane's, keyed by everything that goes into them.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from e2e import build as controlplane
from e2e import gobuild

MODULES = controlplane.MODULES / "node"


def containerd_version() -> str:
    return gobuild.required_version(MODULES / "containerd", "github.com/containerd/containerd/v2")


def cni_version() -> str:
    return gobuild.required_version(MODULES / "cni", "github.com/containernetworking/plugins")


def programs() -> list[gobuild.Program]:
    containerd = containerd_version()
    stamp = "github.com/containerd/containerd/v2/version"
    containerd_ldflags = f"-s -w -X {stamp}.Version={containerd} -X {stamp}.Revision=module-proxy -X {stamp}.Package=github.com/containerd/containerd/v2"
    cmd = "github.com/containerd/containerd/v2/cmd"
    plugins = "github.com/containernetworking/plugins/plugins"
    [kubernetes] = [t for t in controlplane.targets() if t.name == "kubernetes"]
    return [
        # The tags containerd's own Makefile builds with; cgo off leaves out the btrfs snapshotter.
        gobuild.Program(
            MODULES / "containerd",
            {"containerd": f"{cmd}/containerd", "ctr": f"{cmd}/ctr"},
            tags="urfave_cli_no_docs",
            ldflags=containerd_ldflags,
        ),
        gobuild.Program(
            MODULES / "containerd",
            {"containerd-shim-runc-v2": f"{cmd}/containerd-shim-runc-v2"},
            tags="urfave_cli_no_docs no_grpc",
            ldflags=containerd_ldflags,
        ),
        gobuild.Program(MODULES / "containerd", {"pause": "passthrough.io/e2e/controlplane/node/containerd/pause"}, ldflags="-s -w"),
        gobuild.Program(
            MODULES / "cni",
            {name: f"{plugins}/{path}" for name, path in CNI_PLUGINS.items()},
            ldflags=f"-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion={cni_version()}",
        ),
        gobuild.Program(MODULES / "kube-proxy", {"kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy"}, ldflags=kubernetes.ldflags),
    ]


CNI_PLUGINS = {
    "bridge": "main/bridge",
    "host-local": "ipam/host-local",
    "loopback": "main/loopback",
    "portmap": "meta/portmap",
}


def cache_key() -> str:
    digest = hashlib.sha256(gobuild.go_version().encode())
    modules = sorted({program.module for program in programs()})
    for module in modules:
        gobuild.hash_files(digest, [module / "go.mod", module / "go.sum", *sorted(module.rglob("*.go"))], module.parent)
    for program in programs():
        digest.update(json.dumps([program.packages, program.tags, program.ldflags], sort_keys=True).encode())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    name = (
        f"containerd-{containerd_version()}-cni-{cni_version()}-k8s-{controlplane.kubernetes_version()}-{cache_key()}"
    )
    return gobuild.cache_root() / "node" / name


def ensure_binaries() -> Path:
    """The directory holding the node's programs, building them first when the cache lacks them."""
    return gobuild.ensure(gobuild.GoBuild("node", "node", cache_dir(), tuple(programs())))


def main() -> int:
    return gobuild.main("node", ensure_binaries)


if __name__ == "__main__":
    sys.exit(main())
