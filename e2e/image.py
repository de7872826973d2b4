"""Build and run the container image (the Dockerfile) where there is no Docker daemon and no registry.

The builder is buildah from Debian's packages, with the vfs storage driver and chroot
isolation (no overlay mounts, user namespaces or OCI runtime needed). The Dockerfile's base,
debian:bookworm-slim, is made here from Debian's packages by mmdebstrap, cached under
~/.cache/passthrough-operator/image/ and stored under the name the Dockerfile pulls, so the
same Dockerfile builds unchanged wherever the real base can be pulled. `make image` and
tests/integration/test_image.py both build through `build()`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import metadata
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from e2e.build import cache_root

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"
CHART = ROOT / "charts" / "passthrough-operator" / "Chart.yaml"
PACKAGE = "passthrough-operator"

BASE = "docker.io/library/debian:bookworm-slim"
SUITE = "bookworm"
MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
# What the official slim images leave out (debuerreotype's --slimify), so the local base
# weighs what the real one does.
SLIM_EXCLUDES = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/groff/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/lintian/*",
    "path-exclude=/usr/share/linda/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
)
TOOLS = {"buildah": "buildah", "mmdebstrap": "mmdebstrap"}  # command -> Debian package
CONTEXT_LABEL = "io.passthrough.context"  # digest of what went into the image


class ImageError(RuntimeError):
    """A step failed; the message names it (and its output's tail)."""


def _log(message: str) -> None:
    print(f"[image] {message}", file=sys.stderr, flush=True)


def name() -> str:
    """What the chart pulls by default: passthrough-operator:<appVersion>."""
    return f"passthrough-operator:{yaml.safe_load(CHART.read_text())['appVersion']}"


def _run(args: Sequence[str], step: str, env: dict[str, str] | None = None, quiet: bool = True) -> str:
    proc = subprocess.run(
        list(args),
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE if quiet else None,
        stderr=subprocess.STDOUT if quiet else None,
        text=True,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout or "").splitlines()[-30:])
        raise ImageError(f"{step} failed (exit {proc.returncode}): {' '.join(args[:3])} ...\n{tail}")
    return proc.stdout or ""


def buildah(*args: str, step: str = "buildah", quiet: bool = True) -> str:
    # vfs: plain copies, no overlay mount needed (a CI sandbox may not allow one); chroot:
    # no runc or crun, no user namespace.
    return _run(["buildah", "--storage-driver", "vfs", *args], step, {"BUILDAH_ISOLATION": "chroot"}, quiet)


# -- the tools ------------------------------------------------------------------------------


def why_unavailable() -> str | None:
    """Why the image cannot be built here (one line), or None once buildah and mmdebstrap are on PATH.

    Missing tools are installed from Debian's packages (apt-get) when that is possible.
    """
    missing = [package for command, package in TOOLS.items() if shutil.which(command) is None]
    if not missing:
        return None
    if not sys.platform.startswith("linux"):
        return "building the image needs Linux (buildah with the vfs driver)"
    if shutil.which("apt-get") is None:
        return f"{', '.join(missing)} not on PATH and no apt-get to install them from Debian's packages"
    if os.geteuid() != 0:
        return f"{', '.join(missing)} not on PATH; installing them (apt-get) and building with vfs need root"
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", *missing]
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    _log(f"installing {' '.join(missing)} (apt-get)")
    try:
        _run(install, "apt-get install", env)
    except ImageError:
        try:  # stale or missing package lists (a fresh machine): update once and try again
            _run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=600"], "apt-get update", env)
            _run(install, "apt-get install", env)
        except ImageError as exc:
            return f"cannot install {' '.join(missing)} from Debian's packages: {str(exc).splitlines()[0]}"
    still = [command for command in TOOLS if shutil.which(command) is None]
    return f"{', '.join(still)} still not on PATH after apt-get install" if still else None


# -- the base image -------------------------------------------------------------------------


def _base_tarball() -> Path:
    """debian:bookworm-slim's equivalent, made by mmdebstrap once and cached."""
    directory = cache_root() / "image"
    tarball = directory / f"debian-{SUITE}-slim.tar"
    if tarball.is_file():
        return tarball
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build may be making it: wait, then look again
        if tarball.is_file():
            return tarball
        partial = directory / f"{tarball.name}.partial-{os.getpid()}"
        started = time.monotonic()
        _log(f"making the base ({BASE}) from Debian's packages with mmdebstrap ...")
        args = [
            "mmdebstrap",
            "--variant=minbase",
            # usr-is-merged, not usrmerge (which pulls in perl): as the official image.
            "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
            "--dpkgopt=force-unsafe-io",
            *(f"--dpkgopt={option}" for option in SLIM_EXCLUDES),
            "--format=tar",
            SUITE,
            str(partial),
            *MIRRORS,
        ]
        try:
            _run(args, "mmdebstrap")
            partial.rename(tarball)
        finally:
            partial.unlink(missing_ok=True)
        _log(f"base made in {time.monotonic() - started:.0f}s: {tarball} ({tarball.stat().st_size >> 20} MiB)")
    return tarball


def image_id(reference: str) -> str | None:
    try:
        return buildah("inspect", "--type", "image", "--format", "{{.FromImageID}}", reference).strip()
    except ImageError:
        return None


def _label(reference: str, key: str) -> str:
    template = f'{{{{index .OCIv1.Config.Labels "{key}"}}}}'
    return buildah("inspect", "--type", "image", "--format", template, reference).strip()


def ensure_base() -> str:
    """The base image's ID, importing the cached tarball under the Dockerfile's FROM name first if needed."""
    if found := image_id(BASE):
        return found
    tarball = _base_tarball()
    container = buildah("from", "scratch", step="buildah from scratch").strip()
    try:
        buildah("add", container, str(tarball), "/", step="buildah add (base tarball)")
        buildah("config", "--cmd", "bash", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                container, step="buildah config")  # fmt: skip
        buildah("commit", "--rm", container, BASE, step="buildah commit (base)")
    except ImageError:
        with contextlib.suppress(ImageError):
            buildah("rm", container)
        raise
    _log(f"stored the base as {BASE}")
    return image_id(BASE) or ""


# -- the lock -------------------------------------------------------------------------------


def runtime_closure() -> dict[str, str]:
    """Every distribution the package needs at run time (not its extras), at the version in this
    environment (.venv, where the tests ran): canonical name -> version."""
    found: dict[str, str] = {}
    todo: list[tuple[str, frozenset[str]]] = [(PACKAGE, frozenset())]
    seen: set[tuple[str, frozenset[str]]] = set()
    while todo:
        dist_name, extras = todo.pop()
        if (dist_name, extras) in seen:
            continue
        seen.add((dist_name, extras))
        dist = metadata.distribution(dist_name)
        if canonicalize_name(dist_name) != PACKAGE:
            found[canonicalize_name(dist_name)] = dist.version
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": extra}) for extra in (extras or {""})):
                continue
            todo.append((str(canonicalize_name(req.name)), frozenset(req.extras)))
    return dict(sorted(found.items()))


def lock_text() -> str:
    pins = "".join(f"{dist}=={version}\n" for dist, version in runtime_closure().items())
    return (
        "# The image's runtime dependencies, the whole closure, pinned to the versions the tests ran\n"
        "# with (.venv) for CPython 3.11 on Linux. Written by `make image` (e2e/image.py); the\n"
        "# Dockerfile installs exactly these, without resolving, and `pip check`s the result.\n" + pins
    )


def refresh_lock() -> bool:
    """Rewrite requirements.lock from .venv; True when it changed."""
    text = lock_text()
    if LOCK.is_file() and LOCK.read_text() == text:
        return False
    LOCK.write_text(text)
    return True


def locked() -> dict[str, str]:
    """requirements.lock as canonical name -> version."""
    pins = {}
    for line in LOCK.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            dist, _, version = line.partition("==")
            pins[str(canonicalize_name(dist))] = version.strip()
    return pins


# -- the build ------------------------------------------------------------------------------


def context_files() -> list[Path]:
    """The build context as .dockerignore allows it: the `!` lines, less the `**/` patterns."""
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    roots = [ROOT / line[1:] for line in lines if line.startswith("!")]
    excluded = [line[3:] for line in lines if line.startswith("**/")]
    files = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            parts = path.relative_to(ROOT).parts
            if path.is_file() and not any(fnmatch(part, pattern) for part in parts for pattern in excluded):
                files.append(path)
    return files


def context_digest(base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in context_files():
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _pip_setting(variable: str, key: str) -> str:
    if value := os.environ.get(variable):
        return value
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run([sys.executable, "-m", "pip", "config", "get", key],
                              capture_output=True, text=True, timeout=60).stdout.strip()  # fmt: skip
    return ""


def _pip_settings() -> list[str]:
    """This host's pip index and CA bundle, for the build stage (a mirror, a TLS-intercepting proxy)."""
    index = _pip_setting("PIP_INDEX_URL", "global.index-url") or "https://pypi.org/simple"
    args = ["--build-arg", f"PIP_INDEX_URL={index}"]
    cert = _pip_setting("PIP_CERT", "global.cert")
    if cert and Path(cert).is_file():
        # A secret: mounted for the build stage's pip steps only, in no layer of the image.
        args += ["--secret", f"id=pip-ca,src={Path(cert).resolve()}", "--build-arg", "PIP_CERT=/run/secrets/pip-ca"]
    return args


@dataclass(frozen=True)
class Built:
    name: str
    id: str
    seconds: float
    rebuilt: bool  # False: the image was already built from the same context and base


def build(tag: str | None = None) -> Built:
    """Build the Dockerfile into `tag` (default: name()), unless it already holds this context's build."""
    tag = tag or name()
    if reason := why_unavailable():
        raise ImageError(reason)
    started = time.monotonic()
    base_id = ensure_base()
    directory = cache_root() / "image"
    directory.mkdir(parents=True, exist_ok=True)
    # One build at a time on this machine: two share buildah's apt cache mount, whose lock the
    # second one's apt-get fails on (exit 100). Wait, then look again: it may be this context.
    with (directory / ".image.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(tag, base_id, started)


def _build(tag: str, base_id: str, started: float) -> Built:
    digest = context_digest(base_id)
    current = image_id(tag)
    if current and _label(tag, CONTEXT_LABEL) == digest:
        _log(f"{tag} is up to date (context {digest})")
        return Built(tag, current, time.monotonic() - started, rebuilt=False)
    _log(f"building {tag} from {DOCKERFILE.name} (buildah, vfs) ...")
    buildah(
        "build",
        "--pull=never",  # the base is the one stored above; everything else comes from the Dockerfile
        "--layers=false",  # one layer per stage: vfs copies the whole tree for each layer
        "--label", f"{CONTEXT_LABEL}={digest}",
        *_pip_settings(),
        "--tag", tag,
        "--file", str(DOCKERFILE),
        str(ROOT),
        step=f"buildah build {tag}",
        quiet=False,
    )  # fmt: skip
    built = Built(tag, image_id(tag) or "", time.monotonic() - started, rebuilt=True)
    if current and current != built.id:
        # The previous build, now untagged: vfs keeps a full copy of every image.
        with contextlib.suppress(ImageError):
            buildah("rmi", current)
    _log(f"built {tag} in {built.seconds:.0f}s ({size(tag)})")
    return built


def size(reference: str) -> str:
    """The image's size on disk, uncompressed, as `buildah images` shows it ("228 MB")."""
    return buildah("images", "--format", "{{.Size}}", reference).strip()


# -- running it -----------------------------------------------------------------------------


@dataclass
class Container:
    """A working container of the image: run commands in it, read its filesystem."""

    id: str
    root: Path

    def run(self, args: Sequence[str], volumes: Sequence[str] = ()) -> subprocess.CompletedProcess:
        """Run `args` as the image's user; the result is not checked. (Chroot isolation shares
        the host's network: buildah refuses --network none with it.)"""
        command = ["buildah", "--storage-driver", "vfs", "run", "--isolation", "chroot"]
        command += [f"--volume={volume}" for volume in volumes]
        return subprocess.run([*command, self.id, "--", *args], capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def container(reference: str) -> Iterator[Container]:
    ctr = buildah("from", "--pull=never", reference, step=f"buildah from {reference}").strip()
    try:
        yield Container(ctr, Path(buildah("mount", ctr).strip()))
    finally:
        with contextlib.suppress(ImageError):
            buildah("rm", ctr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.image", description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=None, help=f"image name (default {name()}, the chart's)")
    parser.add_argument("--keep-lock", action="store_true", help="build with requirements.lock as it is")
    args = parser.parse_args(argv)
    try:
        if not args.keep_lock and refresh_lock():
            _log(f"{LOCK.name} rewritten from .venv's versions")
        built = build(args.tag)
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{built.name} {built.id[:12]} {size(built.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
