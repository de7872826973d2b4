"""A small Go program of the suite's own (a module directory under `e2e/`, its dependencies from
the Go module proxy, unmodified), built on first use and cached outside the work tree beside the
control plane's binaries (`e2e/build.py`), keyed by the Go release and the module's files; a lock
lets parallel test runs build it once, and a half-built binary is never found.
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
from dataclasses import dataclass
from pathlib import Path

from e2e import build


@dataclass(frozen=True)
class GoProgram:
    module: Path  # the module directory
    binary: str
    label: str  # its progress lines' tag and its cache directory's name
    what: str  # what it is, for progress lines and errors
    pinned: str  # the module path whose release names the cache entry

    def version(self) -> str:
        return build._required_version(self.module, self.pinned)

    def cache_key(self) -> str:
        """The Go release and the module's go.mod, go.sum and sources: a change to any means a new binary."""
        digest = hashlib.sha256(build._go_version().encode())
        for path in sorted([self.module / "go.mod", self.module / "go.sum", *self.module.rglob("*.go")]):
            digest.update(str(path.relative_to(self.module)).encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:12]

    def cache_dir(self) -> Path:
        stem = self.pinned.rsplit("/", 1)[-1]
        return build.cache_root() / self.label / f"{stem}-{self.version()}-{self.cache_key()}"

    def _go(self, args: list[str], log_path: Path) -> None:
        with log_path.open("a") as log:
            log.write(f"\n$ (cd {self.module} && go {' '.join(args)})\n")
            log.flush()
            rc = subprocess.run([shutil.which("go") or "go", *args], cwd=self.module, env=build._go_env(), stdout=log,
                                stderr=subprocess.STDOUT).returncode  # fmt: skip
        if rc != 0:
            raise build.BuildError(f"building {self.what} failed at `go {args[0]}` (exit {rc}); see {log_path}")

    def _build(self, directory: Path) -> Path:
        """Build into a staging file beside the entry, then move it in."""
        directory.mkdir(parents=True, exist_ok=True)
        log_path = directory / "build.log"
        log_path.write_text(f"# {self.what} build, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        staging = directory / f"{self.binary}.partial-{os.getpid()}"
        started = time.monotonic()
        print(f"[{self.label}] building {self.what} ({self.pinned} {self.version()}) ...", file=sys.stderr, flush=True)
        self._go(["build", "-trimpath", "-o", str(staging), "."], log_path)
        elapsed = time.monotonic() - started
        (directory / "build-info.json").write_text(json.dumps({"seconds": round(elapsed, 1), "go": build._go_version()}))
        staging.rename(directory / self.binary)
        print(f"[{self.label}] built in {elapsed:.0f}s into {directory}", file=sys.stderr, flush=True)
        return directory / self.binary

    def ensure_binary(self) -> Path:
        """The program, built first when the cache lacks it. Raises build.BuildError (no `go`, a
        failed build) with a message that says what to do."""
        if shutil.which("go") is None:
            raise build.BuildError(f"{self.what} is built with Go, and `go` is not on PATH; install Go 1.26 or newer")
        directory = self.cache_dir()
        if (directory / self.binary).is_file():
            return directory / self.binary
        directory.parent.mkdir(parents=True, exist_ok=True)
        with (directory.parent / ".build.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then look again
            if (directory / self.binary).is_file():
                return directory / self.binary
            return self._build(directory)

    def main(self) -> int:
        """`python -m e2e.<its builder>`: build it (or find it) and print its path."""
        try:
            print(self.ensure_binary())
        except build.BuildError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        return 0
