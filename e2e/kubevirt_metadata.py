"""KubeVirt's own reading of our DRA device-metadata files: builds `e2e/kubevirt_metadata/`, a
small Go program around virt-launcher's DRA host-device code (kubevirt.io/kubevirt at the release
its go.mod pins, unmodified, from the Go module proxy), and runs it on a directory of metadata
files and a VMI. What it prints is what virt-launcher would put in the domain: the tests compare
that with the addresses our driver meant, so KubeVirt, not our own reader, judges the files.

The binary is cached outside the work tree (beside the control plane's, `e2e/build.py`), keyed by
the Go release and the module's files; a lock lets parallel test runs build it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from e2e import build

MODULE = Path(__file__).resolve().parent / "kubevirt_metadata"
BINARY = "kubevirtmetadata"
CONTAINER_BASE = "/var/run/kubernetes.io/dra-device-attributes"  # what the program's base dir stands for


def kubevirt_version() -> str:
    return build._required_version(MODULE, "kubevirt.io/kubevirt")


def cache_key() -> str:
    """The Go release and the module's go.mod, go.sum and sources: a change to any means a new binary."""
    digest = hashlib.sha256(build._go_version().encode())
    for path in sorted([MODULE / "go.mod", MODULE / "go.sum", *MODULE.rglob("*.go")]):
        digest.update(str(path.relative_to(MODULE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    return build.cache_root() / "kubevirt-metadata" / f"kubevirt-{kubevirt_version()}-{cache_key()}"


def _go(args: list[str], log_path: Path) -> None:
    with log_path.open("a") as log:
        log.write(f"\n$ (cd {MODULE} && go {' '.join(args)})\n")
        log.flush()
        rc = subprocess.run([shutil.which("go") or "go", *args], cwd=MODULE, env=build._go_env(), stdout=log,
                            stderr=subprocess.STDOUT).returncode  # fmt: skip
    if rc != 0:
        raise build.BuildError(f"building KubeVirt's metadata reader failed at `go {args[0]}` (exit {rc}); see {log_path}")


def _build(directory: Path) -> Path:
    """Build into a staging file beside the entry, then move it in: a half-built binary is never found."""
    directory.mkdir(parents=True, exist_ok=True)
    log_path = directory / "build.log"
    log_path.write_text(f"# KubeVirt metadata reader build, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    staging = directory / f"{BINARY}.partial-{os.getpid()}"
    started = time.monotonic()
    print(f"[kubevirt-metadata] building KubeVirt {kubevirt_version()}'s DRA metadata reader ...", file=sys.stderr, flush=True)
    _go(["build", "-trimpath", "-o", str(staging), "."], log_path)
    elapsed = time.monotonic() - started
    (directory / "build-info.json").write_text(json.dumps({"seconds": round(elapsed, 1), "go": build._go_version()}))
    staging.rename(directory / BINARY)
    print(f"[kubevirt-metadata] built in {elapsed:.0f}s into {directory}", file=sys.stderr, flush=True)
    return directory / BINARY


def ensure_binary() -> Path:
    """The program, built first when the cache lacks it. Raises build.BuildError (no `go`, a
    failed build) with a message that says what to do."""
    if shutil.which("go") is None:
        raise build.BuildError("KubeVirt's metadata reader is built with Go, and `go` is not on PATH; install Go 1.26 or newer")
    directory = cache_dir()
    if (directory / BINARY).is_file():
        return directory / BINARY
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
        if (directory / BINARY).is_file():
            return directory / BINARY
        return _build(directory)


def local_path(base: Path, container_path: str) -> Path:
    """Where a file the launcher sees at `container_path` (under CONTAINER_BASE) lies under `base`."""
    relative = Path(container_path).relative_to(CONTAINER_BASE)
    return Path(base) / relative


def read_as_kubevirt(binary: Path, base: Path, vmi: dict[str, Any]) -> dict[str, Any]:
    """What virt-launcher makes of the metadata files under `base` for `vmi`: for its GPUs and its
    host devices, {"hostDevices": [{"alias", "type", "managed", "address", "xml"}], "error"?}."""
    vmi_file = Path(base) / "vmi.json"
    vmi_file.write_text(json.dumps(vmi))
    proc = subprocess.run([str(binary), str(base), str(vmi_file)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def main() -> int:
    try:
        print(ensure_binary())
    except build.BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
