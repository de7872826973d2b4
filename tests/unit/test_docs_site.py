"""The documentation site builds with `mkdocs build --strict` (a broken link or anchor, or a
page left out of the navigation, fails it), and builds offline: no web fonts, no plugin that
downloads at build time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e import support

REPO = Path(__file__).resolve().parents[2]


class _Loader(yaml.SafeLoader):
    """mkdocs.yml as data: its `!!python/name:` tags (Mermaid's fence) read as their text."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)


def _config() -> dict:
    return yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)  # noqa: S506 - a safe loader


def test_the_site_needs_nothing_from_the_network_to_build() -> None:
    config = _config()
    assert config["theme"]["font"] is False, "theme.font must be false: Material would fetch Google Fonts"
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config.get("plugins", [])]
    assert set(plugins) <= {"search"}, f"plugins that may download at build time: {plugins}"
    assert config.get("strict") is True


def test_the_site_builds_strictly(request, tmp_path: Path) -> None:
    try:
        import material  # noqa: F401
        import mkdocs  # noqa: F401
    except ImportError as exc:
        support.cannot_run(request, "documentation site", f"{exc.name} is not installed (make venv installs the docs extra)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    index = (tmp_path / "site" / "index.html").read_text()
    assert "passthrough-operator" in index
    pages = list((tmp_path / "site").rglob("*.html"))
    assert not [p for p in pages if "fonts.googleapis.com" in p.read_text()], "a page loads web fonts"
    concepts = (tmp_path / "site" / "concepts" / "index.html").read_text()
    assert concepts.count('class="mermaid"') >= 2, "the concepts page's diagrams are not Mermaid blocks"
