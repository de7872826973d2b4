"""The bad-input corpus: hypothesis strategies that generate broken sysfs trees, pci.ids files
and platform values, and the regressions they found, kept as small files and replayed on every run.

Profiles: `corpus` (the default: derandomized, so every run tries the same examples, and
sized to keep the corpus tests near a minute on two cores) and `corpus-deep` (random, many
more examples, failures kept in .hypothesis/), chosen with PASSTHROUGH_CORPUS_PROFILE=deep.

With PASSTHROUGH_CORPUS_RECORD=1, a property that fails writes its falsifying example to
`regressions/<kind>/pending-<test>.<ext>` (hypothesis replays the shrunk example last, so the
file ends up holding the minimal one); give it a name that says what it is, and a `why`, and
it is replayed from then on. Without it the example is only printed (hypothesis' `note`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, settings

REGRESSIONS = Path(__file__).resolve().parent / "regressions"

settings.register_profile(
    "corpus",
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "corpus-deep",
    parent=settings.get_profile("corpus"),
    max_examples=3000,
    derandomize=False,
    database=settings.default.database,
)


def profile(max_examples: int | None = None) -> settings:
    """The settings for a corpus property (a decorator); `max_examples` scales the default profile's."""
    deep = os.environ.get("PASSTHROUGH_CORPUS_PROFILE") == "deep"
    chosen = settings.get_profile("corpus-deep" if deep else "corpus")
    if max_examples is not None and not deep:
        return settings(chosen, max_examples=max_examples)
    return chosen


def scratch_dir() -> str | None:
    """Where generated trees go: memory (/dev/shm) where there is one, as each example makes and
    removes a few hundred files; None (the system's temporary directory) elsewhere."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def regressions(kind: str) -> list[Any]:
    """pytest params of every kept example of `kind` (sysfs, pciids, values), named by file."""
    import pytest

    found = []
    for path in sorted((REGRESSIONS / kind).iterdir()):
        if path.name.startswith(".") or path.name.startswith("pending-"):
            continue
        found.append(pytest.param(path, id=path.stem))
    return found


def load_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def load_yaml_documents(path: Path) -> Iterator[Any]:
    """A values regression: the YAML document exactly as `passthrough render` reads it."""
    with open(path, encoding="utf-8") as f:
        yield from yaml.safe_load_all(f)


def record(kind: str, test: str, payload: Any, ext: str = "json") -> Path | None:
    """Keep a falsifying example where a maintainer finds it (see the module docstring)."""
    if not os.environ.get("PASSTHROUGH_CORPUS_RECORD"):
        return None
    folder = REGRESSIONS / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"pending-{re.sub(r'[^A-Za-z0-9_]+', '-', test)}.{ext}"
    if ext == "json":
        text = json.dumps(payload, indent=1, ensure_ascii=True) + "\n"
    elif isinstance(payload, bytes):
        path.write_bytes(payload)
        return path
    else:
        text = payload
    path.write_text(text, encoding="utf-8")
    return path
