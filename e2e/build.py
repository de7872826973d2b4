"""Build the local control plane (etcd, kube-apiserver, kube-controller-manager, kubectl), and helm.

None of them has a current Debian or PyPI package, so they are built from source through
the Go module proxy, from the wrapper modules under `e2e/controlplane/` that pin the
releases (helm is built beside the control plane: the chart's tests render the chart with
it). The Kubernetes module also gives the kubelet, kube-scheduler and `fakeruntime`, a CRI
runtime stand-in of our own (`e2e/controlplane/kubernetes/fakeruntime/`), for the tests
that run a real node (`e2e/kubelet.py`). The binaries are cached outside the work tree,
keyed by everything that goes into them, and built as every Go program of the suite is
(`e2e/gobuild.py`).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from e2e import gobuild
from e2e.gobuild import required_version

# What the suite's other modules reach through this one.
BuildError = gobuild.BuildError
cache_root = gobuild.cache_root

HERE = Path(__file__).resolve().parent
MODULES = HERE / "controlplane"
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kubectl",
    "kubelet",
    "kube-scheduler",
    "fakeruntime",
    "helm",
)


@dataclass(frozen=True)
class Target:
    """One wrapper module and what is built from it."""

    name: str
    packages: dict[str, str]  # binary name -> package path
    ldflags: str

    @property
    def module(self) -> Path:
        return MODULES / self.name


def kubernetes_version() -> str:
    return required_version(MODULES / "kubernetes", "k8s.io/kubernetes")


def etcd_version() -> str:
    return required_version(MODULES / "etcd", "go.etcd.io/etcd/server/v3")


def helm_version() -> str:
    return required_version(MODULES / "helm", "helm.sh/helm/v3")


def targets() -> list[Target]:
    k8s = kubernetes_version()
    major, minor = k8s.lstrip("v").split(".")[:2]
    version_pkg = "k8s.io/component-base/version"
    etcd = etcd_version()
    helm = helm_version()
    # Helm's Makefile stamps the Kubernetes release of its client-go (v0.X -> 1.X) as the
    # default cluster version of `helm template`; unstamped it would claim v1.20.
    client_minor = required_version(MODULES / "helm", "k8s.io/client-go").lstrip("v").split(".")[1]
    return [
        Target(
            name="kubernetes",
            packages={
                "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
                "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
                "kubectl": "k8s.io/kubernetes/cmd/kubectl",
                "kubelet": "k8s.io/kubernetes/cmd/kubelet",
                "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
                # Ours, in the wrapper module so it uses the same pinned cri-api and cri-client.
                "fakeruntime": "passthrough.io/e2e/controlplane/kubernetes/fakeruntime",
            },
            # What hack/lib/version.sh stamps into a release build, so /version and
            # kubectl's skew check see the real release.
            ldflags=(
                f"-s -w -X {version_pkg}.gitVersion={k8s} -X {version_pkg}.gitMajor={major}"
                f" -X {version_pkg}.gitMinor={minor} -X {version_pkg}.gitTreeState=clean"
            ),
        ),
        Target(
            name="etcd",
            packages={"etcd": "go.etcd.io/etcd/server/v3"},
            ldflags=f"-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA={etcd}",
        ),
        Target(
            name="helm",
            packages={"helm": "helm.sh/helm/v3/cmd/helm"},
            ldflags=(
                f"-s -w -X helm.sh/helm/v3/internal/version.version={helm}"
                f" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={client_minor}"
                f" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={client_minor}"
            ),
        ),
    ]


def cache_key() -> str:
    """Everything that goes into the binaries: the wrapper modules and our Go sources in them,
    the packages built, the Go release, the flags."""
    digest = hashlib.sha256(gobuild.go_version().encode())
    for target in targets():
        sources = sorted(target.module.rglob("*.go"))
        gobuild.hash_files(digest, [target.module / "go.mod", target.module / "go.sum", *sources], target.module)
        digest.update(json.dumps(target.packages, sort_keys=True).encode())
        digest.update(target.ldflags.encode())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    name = f"k8s-{kubernetes_version()}-etcd-{etcd_version()}-helm-{helm_version()}-{cache_key()}"
    return cache_root() / "controlplane" / name


def cached_binaries(directory: Path | None = None, names: tuple[str, ...] = BINARIES) -> Path | None:
    """The bin directory of a complete cache entry (of `names`, the control plane's by
    default), or None when it must be (re)built."""
    return gobuild.complete(directory or cache_dir(), names)


def ensure_binaries() -> Path:
    """The directory holding the binaries, building them first when the cache lacks them."""
    programs = tuple(gobuild.Program(t.module, t.packages, ldflags=t.ldflags) for t in targets())
    return gobuild.ensure(gobuild.GoBuild("controlplane", "control plane", cache_dir(), programs))


def main() -> int:
    return gobuild.main("controlplane", ensure_binaries)


if __name__ == "__main__":
    sys.exit(main())
