"""A small Go program of the suite's own (a module directory under `e2e/`, its dependencies from
the Go module proxy, unmodified), built on first use as every Go program of the suite is
(`e2e/gobuild.py`): cached outside the work tree beside the control plane's binaries, keyed by
the Go release and the module's files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from e2e import gobuild


@dataclass(frozen=True)
class GoProgram:
    module: Path  # the module directory
    binary: str
    label: str  # its progress lines' tag and its cache directory's name
    what: str  # what it is, for progress lines and errors
    pinned: str  # the module path whose release names the cache entry
    cgo: bool = False  # built with cgo, against a C library
    prepare: Callable[[], None] | None = None  # what the build needs first (that library's headers)

    def version(self) -> str:
        return gobuild.required_version(self.module, self.pinned)

    def cache_key(self) -> str:
        """The Go release and the module's go.mod, go.sum and sources: a change to any means a new binary."""
        digest = hashlib.sha256(gobuild.go_version().encode())
        gobuild.hash_files(digest, sorted([self.module / "go.mod", self.module / "go.sum", *self.module.rglob("*.go")]),
                           self.module)  # fmt: skip
        return digest.hexdigest()[:12]

    def cache_dir(self) -> Path:
        stem = self.pinned.rsplit("/", 1)[-1]
        return gobuild.cache_root() / self.label / f"{stem}-{self.version()}-{self.cache_key()}"

    def ensure_binary(self) -> Path:
        """The program, built first when the cache lacks it. Raises gobuild.BuildError (no `go`, a
        failed build) with a message that says what to do."""
        program = gobuild.Program(self.module, {self.binary: "."})
        build = gobuild.GoBuild(self.label, self.what, self.cache_dir(), (program,), bin_dir="", cgo=self.cgo, prepare=self.prepare)
        return gobuild.ensure(build) / self.binary

    def main(self) -> int:
        """`python -m e2e.<its builder>`: build it (or find it) and print its path."""
        return gobuild.main(self.label, self.ensure_binary)
