"""Build the local control plane (etcd, kube-apiserver, kube-controller-manager, kubectl), and helm.

None of them has a current Debian or PyPI package, so they are built from source through
the Go module proxy, from the wrapper modules under `e2e/controlplane/` that pin the
releases (helm is built beside the control plane: the chart's tests render the chart with
it). The Kubernetes module also gives the kubelet, kube-scheduler and `fakeruntime`, a CRI
runtime stand-in of our own (`e2e/controlplane/kubernetes/fakeruntime/`), for the tests
that run a real node (`e2e/kubelet.py`). The binaries are cached outside the work tree,
keyed by everything that goes into them; a cache entry is complete only once its manifest
is written, so an interrupted or stale build is detected and done again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from e2e import gobuild

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


BuildError = gobuild.BuildError  # what every Go program's build raises


@dataclass(frozen=True)
class Target:
    """One wrapper module and what is built from it."""

    name: str
    packages: dict[str, str]  # binary name -> package path
    ldflags: str

    @property
    def module(self) -> Path:
        return MODULES / self.name


def _required_version(module: Path, path: str) -> str:
    match = re.search(rf"^(?:require)?\s*{re.escape(path)} (v\S+)", (module / "go.mod").read_text(), re.M)
    if not match:
        raise BuildError(f"{module}/go.mod does not require {path}")
    return match.group(1)


def kubernetes_version() -> str:
    return _required_version(MODULES / "kubernetes", "k8s.io/kubernetes")


def etcd_version() -> str:
    return _required_version(MODULES / "etcd", "go.etcd.io/etcd/server/v3")


def helm_version() -> str:
    return _required_version(MODULES / "helm", "helm.sh/helm/v3")


def targets() -> list[Target]:
    k8s = kubernetes_version()
    major, minor = k8s.lstrip("v").split(".")[:2]
    version_pkg = "k8s.io/component-base/version"
    etcd = etcd_version()
    helm = helm_version()
    # Helm's Makefile stamps the Kubernetes release of its client-go (v0.X -> 1.X) as the
    # default cluster version of `helm template`; unstamped it would claim v1.20.
    client_minor = _required_version(MODULES / "helm", "k8s.io/client-go").lstrip("v").split(".")[1]
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


def cache_root() -> Path:
    if env := os.environ.get("PASSTHROUGH_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "passthrough-operator"


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries, no C toolchain needed; the go.mod files' own toolchain, never a download.
    env.update(CGO_ENABLED="0", GOFLAGS="-mod=readonly", GOTOOLCHAIN="local")
    return env


def _go_version() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError("the control plane is built with Go, and `go` is not on PATH; install Go 1.26 or newer")
    return subprocess.run([go, "version"], capture_output=True, text=True, check=True).stdout.strip()


def cache_key() -> str:
    """Everything that goes into the binaries: the wrapper modules and our Go sources in them,
    the packages built, the Go release, the flags."""
    digest = hashlib.sha256(_go_version().encode())
    for target in targets():
        sources = sorted(target.module.rglob("*.go"))
        for path in [target.module / "go.mod", target.module / "go.sum", *sources]:
            digest.update(str(path.relative_to(target.module)).encode() + b"\0")
            digest.update(path.read_bytes())
        digest.update(json.dumps(target.packages, sort_keys=True).encode())
        digest.update(target.ldflags.encode())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    name = f"k8s-{kubernetes_version()}-etcd-{etcd_version()}-helm-{helm_version()}-{cache_key()}"
    return cache_root() / "controlplane" / name


def _manifest(bin_dir: Path, names: tuple[str, ...] = BINARIES) -> dict[str, dict[str, int]]:
    return {
        name: {"size": (bin_dir / name).stat().st_size, "mtime_ns": (bin_dir / name).stat().st_mtime_ns}
        for name in names
    }


def cached_binaries(directory: Path | None = None, names: tuple[str, ...] = BINARIES) -> Path | None:
    """The bin directory of a complete cache entry (of `names`, the control plane's by
    default), or None when it must be (re)built."""
    directory = directory or cache_dir()
    manifest = directory / "manifest.json"
    try:
        recorded = json.loads(manifest.read_text())
        if recorded == _manifest(directory / "bin", names):
            return directory / "bin"
    except (OSError, ValueError):
        pass
    return None


class _Progress:
    """Prints a line every few seconds while `go build -v` names the packages it compiles."""

    def __init__(self, label: str, total: int, log) -> None:
        self.label, self.total, self.log = label, total, log
        self.done = 0
        self.started = time.monotonic()

    def feed(self, stream) -> None:
        last = 0.0
        for line in stream:
            self.log.write(line)
            if not line.startswith(("#", " ", "\t", "go: ")):
                self.done += 1
            now = time.monotonic()
            if now - last >= 10:
                last = now
                self.report()
        self.log.flush()

    def report(self) -> None:
        elapsed = int(time.monotonic() - self.started)
        print(
            f"[controlplane] {self.label}: {self.done} of up to {self.total} packages compiled"
            f" ({elapsed // 60}m{elapsed % 60:02d}s)",
            file=sys.stderr,
            flush=True,
        )


def _step(name: str, args: list[str], cwd: Path, log_path: Path, progress_total: int = 0) -> str:
    with log_path.open("a") as log:
        log.write(f"\n$ (cd {cwd} && {' '.join(args)})\n")
        log.flush()
        print(f"[controlplane] {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.Popen(
            args, cwd=cwd, env=_go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        if progress_total:
            progress = _Progress(name, progress_total, log)
            feeder = threading.Thread(target=progress.feed, args=(proc.stdout,), daemon=True)
            feeder.start()
            rc = proc.wait()
            feeder.join()
            output = ""
        else:
            output = proc.stdout.read()
            log.write(output)
            rc = proc.wait()
    if rc != 0:
        raise BuildError(f"control plane build failed at step '{name}' (exit {rc}); see {log_path}")
    return output


def build(directory: Path) -> Path:
    """Build every binary into a fresh directory beside `directory`, then move it in place."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    for stale in directory.parent.glob(f"{directory.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = directory.parent / f"{directory.name}.partial-{os.getpid()}"
    bin_dir = staging / "bin"
    bin_dir.mkdir(parents=True)
    log_path = directory.parent / f"{directory.name}.build.log"
    log_path.write_text(f"# control plane build, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    started = time.monotonic()
    go = shutil.which("go") or "go"
    for target in targets():
        packages = list(target.packages.values())
        _step(f"download {target.name} modules", [go, "mod", "download"], target.module, log_path)
        listed = _step(f"list {target.name} packages", [go, "list", "-deps", *packages], target.module, log_path)
        total = len([line for line in listed.splitlines() if line and not line.startswith("go: ")])
        out = bin_dir if len(packages) > 1 else bin_dir / next(iter(target.packages))
        _step(
            f"build {', '.join(target.packages)}",
            [go, "build", "-v", "-trimpath", "-ldflags", target.ldflags, "-o", str(out), *packages],
            target.module,
            log_path,
            progress_total=total,
        )
    for name in BINARIES:
        if not (bin_dir / name).is_file():
            raise BuildError(f"control plane build produced no {name}; see {log_path}")
    elapsed = time.monotonic() - started
    (staging / "build-info.json").write_text(json.dumps({"seconds": round(elapsed, 1), "go": _go_version()}))
    (staging / "manifest.json").write_text(json.dumps(_manifest(bin_dir), indent=2))
    if directory.exists():
        shutil.rmtree(directory)
    staging.rename(directory)
    minutes, seconds = divmod(int(elapsed), 60)
    print(f"[controlplane] built in {minutes}m{seconds:02d}s into {directory}", file=sys.stderr, flush=True)
    return directory / "bin"


def ensure_binaries() -> Path:
    """The directory holding the binaries, building them first when the cache lacks them."""
    directory = cache_dir()
    if found := cached_binaries(directory):
        return found
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / ".build.lock").open("w") as lock:
        # Another process may be building the same entry: wait for it, then look again.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := cached_binaries(directory):
            return found
        if directory.exists():
            print(f"[controlplane] cache entry {directory} is incomplete or changed; rebuilding", file=sys.stderr)
        return build(directory)


def main() -> int:
    try:
        print(ensure_binaries())
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
