"""The one way the suite builds its Go programs (the control plane, the node's programs, KubeVirt's,
runc, the small readers of our own): from wrapper modules whose go.mod pins the releases, the
dependencies through the Go module proxy, unmodified.

A `GoBuild` says what goes into one cache entry; `ensure` finds the entry or builds it. Each
builder keeps its own cache key (everything that goes into its binaries), so an entry is found
again exactly when nothing that goes in has changed. The entry is built in a staging directory
beside it and moved in place, and it is complete only once its manifest (each binary's size and
mtime) is written and still matches: an interrupted or tampered build is done again. A lock per
kind of entry lets parallel test runs build it once.
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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
BUILD_INFO = "build-info.json"  # how long the build took, with which Go (bench_controlplane reads it)


class BuildError(RuntimeError):
    """A step of the build failed, or it cannot run here; the message says which and what to do."""


def cache_root() -> Path:
    if env := os.environ.get("PASSTHROUGH_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "passthrough-operator"


def go() -> str:
    found = shutil.which("go")
    if found is None:
        raise BuildError("the suite's programs are built with Go, and `go` is not on PATH; install Go 1.26 or newer")
    return found


def go_version() -> str:
    return subprocess.run([go(), "version"], capture_output=True, text=True, check=True).stdout.strip()


def go_env(cgo: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # Static binaries without a C toolchain unless asked; the go.mod files' own toolchain, never a download.
    env.update(CGO_ENABLED="1" if cgo else "0", GOFLAGS="-mod=readonly", GOTOOLCHAIN="local")
    return env


def required_version(module: Path, path: str) -> str:
    """The release of `path` that `module`'s go.mod requires."""
    match = re.search(rf"^(?:require)?\s*{re.escape(path)} (v\S+)", (module / "go.mod").read_text(), re.M)
    if not match:
        raise BuildError(f"{module}/go.mod does not require {path}")
    return match.group(1)


def hash_files(digest: hashlib._Hash, paths: Iterable[Path], base: Path) -> None:
    """Each file's path under `base` and its bytes, in the order given, into `digest`."""
    for path in paths:
        digest.update(str(path.relative_to(base)).encode() + b"\0")
        digest.update(path.read_bytes())


@dataclass(frozen=True)
class Program:
    """One `go build` in one module: the binaries it makes (name -> package) and how."""

    module: Path
    packages: dict[str, str]
    tags: str = ""
    ldflags: str = ""


@dataclass(frozen=True)
class GoBuild:
    """One cache entry: the programs built into it, where, and how its progress lines read."""

    label: str  # the progress lines' tag
    what: str  # what is built, for messages
    entry: Path  # the cache entry, named by its key
    programs: tuple[Program, ...]
    bin_dir: str = "bin"  # where the binaries lie in the entry ("": the entry itself)
    cgo: bool = False
    prepare: Callable[[], None] | None = None  # what the build needs first (a C library's headers)

    @property
    def binaries(self) -> tuple[str, ...]:
        return tuple(name for program in self.programs for name in program.packages)

    @property
    def log_path(self) -> Path:
        return self.entry.parent / f"{self.entry.name}.build.log"


def manifest(bin_dir: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    return {name: {"size": (bin_dir / name).stat().st_size, "mtime_ns": (bin_dir / name).stat().st_mtime_ns}
            for name in names}  # fmt: skip


def complete(entry: Path, names: Iterable[str], bin_dir: str = "bin") -> Path | None:
    """The directory of the binaries when `entry` is complete and unchanged, else None."""
    try:
        if json.loads((entry / MANIFEST).read_text()) == manifest(entry / bin_dir, names):
            return entry / bin_dir
    except (OSError, ValueError):
        pass
    return None


def _adopt(build: GoBuild) -> Path | None:
    """An entry written before the builders shared this runner, whole as they left it: KubeVirt's
    and the small programs' wrote no manifest (their build-info.json came with the final move),
    runc's recorded its one binary without its name. Its manifest is written now, so it is found
    as every other entry is and not built again."""
    bin_dir = build.entry / build.bin_dir
    try:
        recorded = json.loads((build.entry / MANIFEST).read_text())
    except (OSError, ValueError):
        recorded = None
    try:
        if recorded is None:
            whole = (build.entry / BUILD_INFO).is_file() and all((bin_dir / n).is_file() for n in build.binaries)
        else:
            [name] = build.binaries
            whole = recorded == manifest(bin_dir, [name])[name]
    except (OSError, ValueError):
        return None
    if not whole:
        return None
    (build.entry / MANIFEST).write_text(json.dumps(manifest(bin_dir, build.binaries), indent=2))
    return bin_dir


class _Progress:
    """Prints a line every few seconds while `go build -v` names the packages it compiles."""

    def __init__(self, label: str, step: str, total: int, log) -> None:
        self.label, self.step, self.total, self.log = label, step, total, log
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
        print(f"[{self.label}] {self.step}: {self.done} of up to {self.total} packages compiled"
              f" ({elapsed // 60}m{elapsed % 60:02d}s)", file=sys.stderr, flush=True)  # fmt: skip


def step(label: str, name: str, args: list[str], cwd: Path, log_path: Path, env: dict[str, str] | None = None,
         progress_total: int = 0) -> str:
    """Run one command of a build, its output into `log_path`; with `progress_total`, progress
    lines as `go build -v` names packages. Returns its output (without progress)."""
    with log_path.open("a") as log:
        log.write(f"\n$ (cd {cwd} && {' '.join(args)})\n")
        log.flush()
        print(f"[{label}] {name} ...", file=sys.stderr, flush=True)
        proc = subprocess.Popen(args, cwd=cwd, env=env or go_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
        assert proc.stdout is not None
        output = ""
        if progress_total:
            progress = _Progress(label, name, progress_total, log)
            feeder = threading.Thread(target=progress.feed, args=(proc.stdout,), daemon=True)
            feeder.start()
            rc = proc.wait()
            feeder.join()
        else:
            output = proc.stdout.read()
            log.write(output)
            rc = proc.wait()
    if rc != 0:
        raise BuildError(f"{label} build failed at step '{name}' (exit {rc}); see {log_path}")
    return output


def _build(build: GoBuild) -> Path:
    entry = build.entry
    for stale in entry.parent.glob(f"{entry.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if build.prepare:
        build.prepare()
    staging = entry.parent / f"{entry.name}.partial-{os.getpid()}"
    bin_dir = staging / build.bin_dir
    bin_dir.mkdir(parents=True)
    log_path = build.log_path
    log_path.write_text(f"# {build.what} build, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    env = go_env(build.cgo)
    # Below the tests and whatever else shares the machine; alone, it runs as fast.
    command = ["nice", "-n", "10", go()]
    started = time.monotonic()
    for program in build.programs:
        names, packages = ", ".join(program.packages), list(program.packages.values())
        tags = ["-tags", program.tags] if program.tags else []
        # Lists what the build compiles, for the progress lines; fetches the modules it needs.
        listed = step(build.label, f"list {names} packages", [*command, "list", *tags, "-deps", *packages],
                      program.module, log_path, env)  # fmt: skip
        total = len([line for line in listed.splitlines() if line and not line.startswith("go: ")])
        out = f"{bin_dir}/" if len(packages) > 1 else str(bin_dir / next(iter(program.packages)))
        ldflags = ["-ldflags", program.ldflags] if program.ldflags else []
        step(build.label, f"build {names}", [*command, "build", "-v", "-trimpath", *tags, *ldflags, "-o", out, *packages],
             program.module, log_path, env, progress_total=total)  # fmt: skip
        for name, package in program.packages.items():  # `go build -o DIR/` names each after its package's folder
            if len(packages) > 1 and Path(package).name != name:
                (bin_dir / Path(package).name).rename(bin_dir / name)
    for name in build.binaries:
        if not (bin_dir / name).is_file():
            raise BuildError(f"the {build.what} build produced no {name}; see {log_path}")
    elapsed = time.monotonic() - started
    (staging / BUILD_INFO).write_text(json.dumps({"seconds": round(elapsed, 1), "go": go_version()}))
    (staging / MANIFEST).write_text(json.dumps(manifest(bin_dir, build.binaries), indent=2))
    if entry.exists():
        shutil.rmtree(entry)
    staging.rename(entry)
    minutes, seconds = divmod(int(elapsed), 60)
    print(f"[{build.label}] built in {minutes}m{seconds:02d}s into {entry}", file=sys.stderr, flush=True)
    return entry / build.bin_dir


def ensure(build: GoBuild) -> Path:
    """The directory of `build`'s binaries, building them first when the cache lacks them.
    Raises BuildError (no `go`, a failed step) with a message that says what to do."""
    if found := complete(build.entry, build.binaries, build.bin_dir):
        return found
    build.entry.parent.mkdir(parents=True, exist_ok=True)
    with (build.entry.parent / ".build.lock").open("w") as lock:
        # Another process may be building the same entry: wait for it, then look again.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if found := complete(build.entry, build.binaries, build.bin_dir) or _adopt(build):
            return found
        if build.entry.exists():
            print(f"[{build.label}] cache entry {build.entry} is incomplete or changed; rebuilding", file=sys.stderr)
        return _build(build)


def pkg_config_has(library: str) -> bool:
    """Whether cgo would find `library`'s headers and link flags (pkg-config's answer)."""
    return shutil.which("pkg-config") is not None and subprocess.run(["pkg-config", "--exists", library]).returncode == 0


def debian_packages(label: str, packages: tuple[str, ...], present: Callable[[], bool]) -> None:
    """Install `packages` from Debian (apt-get) unless `present()` holds already: what a cgo build
    needs first. A progress line for each step, the output in a log beside the cache's entries;
    BuildError, saying what to install, where that cannot be done here."""
    if present():
        return
    wanted = " ".join(packages)
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise BuildError(f"the {label} build needs {wanted} (a C library's headers for cgo); "
                         f"install them (apt-get install {wanted}) or run as root where apt-get can")  # fmt: skip
    log_path = cache_root() / "debian-packages.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", *packages]
    try:
        step(label, f"apt-get install {wanted}", install, Path("/"), log_path, env)
    except BuildError:  # stale or missing package lists (a fresh machine): update once and try again
        step(label, "apt-get update", ["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=600"], Path("/"), log_path, env)
        step(label, f"apt-get install {wanted}", install, Path("/"), log_path, env)
    if not present():
        raise BuildError(f"{wanted} installed, and the {label} build still cannot find what it needs; see {log_path}")


LIBVIRT_DEV = ("libvirt-dev", "pkg-config")  # virt-launcher's code links libvirt's C library (libvirt.org/go/libvirt)


def libvirt_dev(label: str) -> Callable[[], None]:
    """A GoBuild's `prepare` for programs that import libvirt's Go bindings."""
    return lambda: debian_packages(label, LIBVIRT_DEV, lambda: pkg_config_has("libvirt"))


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def main(label: str, ensure_path: Callable[[], Path], optional: str = "") -> int:
    """`python -m e2e.<builder>`: build (or find) and print the path. Where it cannot be built, one
    line says why and the exit is 1; with `optional` (the tests that skip without it), 0 instead,
    except under CI=true, where `make test` must have made everything."""
    try:
        print(ensure_path())
    except BuildError as exc:
        if optional and not under_ci():
            print(f"[{label}] {optional} will skip: {exc}", file=sys.stderr, flush=True)
            return 0
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0
