"""Stock Debian kernels for the real-kernel rig: `apt-get download`, `dpkg-deb -x` into the cache.

Never installed into /boot and never through dpkg: the package is unpacked into
~/.cache/passthrough-operator/realkernel/<package>_<version>/, depmod'ed there (the .deb ships
no modules.dep) and marked complete, so an interrupted unpack is done again. QEMU and
busybox, which the rig needs beside the kernel, are installed from Debian's packages when
missing (as e2e/image.py does for buildah).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from e2e.build import cache_root

# Series -> the Debian metapackage that names its current kernel package. 6.1 is bookworm's
# own kernel, 6.12 came to bookworm through bookworm-updates/-security (earlier through
# bookworm-backports, which the rig adds in a private apt configuration when the host's
# sources do not know 6.12).
SERIES = {"6.1": "linux-image-amd64", "6.12": "linux-image-6.12-amd64"}
DEFAULT_SERIES = "6.1"
BACKPORTS = "deb http://deb.debian.org/debian bookworm-backports main"
TOOLS = {"qemu-system-x86_64": "qemu-system-x86", "busybox": "busybox-static"}  # command -> package
COMPLETE = ".complete"


class RigUnavailable(RuntimeError):
    """The rig cannot be had here (no QEMU, no kernel); the message says why, in one line."""


@dataclass(frozen=True)
class Kernel:
    """An unpacked kernel: the image to boot and the module tree that goes with it."""

    series: str  # "6.1"
    package: str  # linux-image-6.1.0-57-amd64
    version: str  # the package's version, 6.1.192-3
    release: str  # uname -r, 6.1.0-57-amd64
    tree: Path  # the unpacked package

    @property
    def image(self) -> Path:
        return self.tree / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        return self.tree / "lib" / "modules" / self.release


def _log(message: str) -> None:
    print(f"[realkernel] {message}", file=sys.stderr, flush=True)


def _run(args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise RigUnavailable(f"{' '.join(args[:3])} ... failed (exit {proc.returncode}): {tail}")
    return proc.stdout


# -- the tools ------------------------------------------------------------------------------

_APT_ENV = {"DEBIAN_FRONTEND": "noninteractive"}
_APT_LOCK = ("-o", "DPkg::Lock::Timeout=600")


def ensure_tools() -> None:
    """QEMU and a static busybox on PATH, installed with apt-get when missing; else RigUnavailable."""
    missing = sorted({package for command, package in TOOLS.items() if shutil.which(command) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise RigUnavailable(f"{', '.join(missing)} missing and no apt-get to install them from Debian's packages")
    if os.geteuid() != 0:
        raise RigUnavailable(f"{', '.join(missing)} missing; installing them (apt-get) needs root")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *_APT_LOCK, *missing]
    _log(f"installing {' '.join(missing)} (apt-get)")
    try:
        _run(install, _APT_ENV)
    except RigUnavailable:  # stale or missing package lists (a fresh machine): update once
        _run(["apt-get", "update", "-q", *_APT_LOCK], _APT_ENV)
        _run(install, _APT_ENV)
    still = [command for command in TOOLS if shutil.which(command) is None]
    if still:
        raise RigUnavailable(f"{', '.join(still)} still not on PATH after apt-get install")


# -- the kernel -----------------------------------------------------------------------------


def _kernels_dir() -> Path:
    return cache_root() / "realkernel"


def _apt_options(private: Path | None) -> list[str]:
    """apt options that read a private sources list (backports) instead of the host's."""
    if private is None:
        return []
    return [
        "-o", f"Dir::Etc::sourcelist={private / 'sources.list'}",
        "-o", "Dir::Etc::sourceparts=-",
        "-o", f"Dir::State::Lists={private / 'lists'}",
        "-o", f"Dir::Cache={private / 'cache'}",
    ]  # fmt: skip


def _private_apt(with_backports: bool) -> Path | None:
    if not with_backports:
        return None
    private = _kernels_dir() / "apt"
    (private / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (private / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    host_sources = _run(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE)", "Created-By: Packages"])
    lines = {f"deb {uri} {release} main" for uri, release in (row.split() for row in host_sources.splitlines() if row)}
    (private / "sources.list").write_text("\n".join(sorted({*lines, BACKPORTS})) + "\n")
    _run(["apt-get", *_apt_options(private), "update", "-q"], _APT_ENV)
    return private


def _candidate(meta: str, private: Path | None) -> tuple[str, str] | None:
    """(package, version) the metapackage depends on, from apt's current lists."""
    proc = subprocess.run(
        ["apt-cache", *_apt_options(private), "show", "--no-all-versions", meta], capture_output=True, text=True
    )
    depends = re.search(r"^Depends: (linux-image-\S+) \(= (\S+)\)", proc.stdout, re.M)
    return (depends.group(1), depends.group(2)) if depends else None


def _cached(series: str) -> list[Kernel]:
    found = []
    for marker in sorted(_kernels_dir().glob(f"*/{COMPLETE}")):
        data = json.loads(marker.read_text())
        if data.get("series") == series:
            found.append(kernel_at(marker.parent))
    return found


def kernel(series: str = DEFAULT_SERIES) -> Kernel:
    """The newest kernel of `series` Debian offers, unpacked into the cache (once). Where apt
    cannot give it (offline, no apt, a mirror that dropped the package), one unpacked before."""
    if series not in SERIES:
        raise RigUnavailable(f"unknown kernel series {series!r}; known: {', '.join(SERIES)}")
    try:
        return _fetch(series)
    except RigUnavailable as exc:
        cached = _cached(series)
        if not cached:
            raise RigUnavailable(f"kernel {series}: {exc}") from None
        _log(f"{str(exc).splitlines()[0]}; using the cached {cached[-1].package}")
        return cached[-1]


def _fetch(series: str) -> Kernel:
    for tool in ("apt-get", "apt-cache", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RigUnavailable(f"{tool} not on PATH: the rig takes its kernels from Debian's packages")
    private = None
    wanted = _candidate(SERIES[series], None)
    if wanted is None:  # a fresh machine without package lists, or a 6.12 only bookworm-backports has
        _run(["apt-get", "update", "-q", *_APT_LOCK], _APT_ENV)
        wanted = _candidate(SERIES[series], None)
        if wanted is None:
            private = _private_apt(with_backports=True)
            wanted = _candidate(SERIES[series], private)
        if wanted is None:
            raise RigUnavailable(f"apt knows no {SERIES[series]} (not in bookworm nor bookworm-backports)")
    package, version = wanted
    entry = _kernels_dir() / f"{package}_{version}"
    if not (entry / COMPLETE).is_file():
        entry.mkdir(parents=True, exist_ok=True)
        with (entry / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another session may be unpacking it: wait, then look again
            if not (entry / COMPLETE).is_file():
                _unpack(series, package, version, entry, private)
    return kernel_at(entry)


def kernel_at(entry: Path) -> Kernel:
    data = json.loads((entry / COMPLETE).read_text())
    return Kernel(data["series"], data["package"], data["version"], data["release"], entry / "tree")


def _unpack(series: str, package: str, version: str, entry: Path, private: Path | None) -> None:
    _log(f"fetching {package} {version} (apt-get download) into {entry}")
    shutil.rmtree(entry / "tree", ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=entry) as scratch:
        # apt's sandbox user cannot write into root's cache; the download is verified by apt
        # against the signed lists all the same.
        _run(["apt-get", *_apt_options(private), "download", "-q", f"{package}={version}"], cwd=Path(scratch))
        (deb,) = Path(scratch).glob("*.deb")
        _run(["dpkg-deb", "-x", str(deb), str(entry / "tree")])
    releases = [p.name for p in (entry / "tree" / "lib" / "modules").iterdir()]
    if len(releases) != 1 or not (entry / "tree" / "boot" / f"vmlinuz-{releases[0]}").is_file():
        raise RigUnavailable(f"{package}: unexpected layout (modules for {releases})")
    ensure_tools()
    # busybox's depmod writes modules.dep and modules.alias, all its modprobe needs.
    _run(["busybox", "depmod", "-b", str(entry / "tree"), releases[0]])
    record = {"series": series, "package": package, "version": version, "release": releases[0]}
    (entry / COMPLETE).write_text(json.dumps(record) + "\n")
    _log(f"{package} {version} ready ({releases[0]})")


def main() -> int:
    """`python -m e2e.guest.kernel` (make test): QEMU, busybox and every kernel series, ready.

    Where they cannot be had, one line says why and the real-kernel tests skip (exit 0), except
    under CI=true, where they are required (exit 1).
    """
    try:
        ensure_tools()
        for series in SERIES:
            found = kernel(series)
            print(f"[realkernel] {series}: {found.package} {found.version}, cached in {found.tree.parent}", file=sys.stderr)
    except RigUnavailable as exc:
        required = os.environ.get("CI", "").lower() == "true"
        _log(f"{'cannot' if required else 'the real-kernel tests will skip: cannot'} set up the rig: {exc}")
        return 1 if required else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
