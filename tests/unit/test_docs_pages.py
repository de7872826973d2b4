"""The site's generated pages (troubleshooting, the reference) say what the code says now, and
the README stays a front door that points into the site."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", REPO / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATE = _generator()


@pytest.mark.parametrize("page", sorted(GENERATE.PAGES))
def test_the_checked_in_page_is_what_the_code_generates(page: str) -> None:
    on_disk = (REPO / "docs" / page).read_text()
    assert on_disk == GENERATE.PAGES[page](), f"docs/{page} is stale: run `make docs-generate`"


def test_every_reason_has_its_entry_on_the_troubleshooting_page() -> None:
    from passthrough.api import reasons

    headings = set(re.findall(r"^### (\w+)$", (REPO / "docs" / "troubleshooting.md").read_text(), re.M))
    assert headings == set(reasons.REASONS)


def test_a_reason_added_to_the_table_changes_the_page(monkeypatch) -> None:
    from passthrough.api import reasons

    monkeypatch.setitem(reasons.REASONS, "SomethingNew", reasons.Reason("It means this.", "Do that.", ("NodePCIDevice/Ready",)))
    page = GENERATE.troubleshooting()
    assert "### SomethingNew" in page and page != (REPO / "docs" / "troubleshooting.md").read_text()


def test_placeholders_in_generated_prose_are_shown_not_taken_for_html() -> None:
    assert GENERATE._prose("kubectl delete npci <name> and `kubectl get pci -n <ns>`") == (
        "kubectl delete npci &lt;name&gt; and `kubectl get pci -n <ns>`"
    )
    assert GENERATE._cell("a | b\nc") == "a \\| b c"


README = (REPO / "README.md").read_text()


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 300, "the README is for a first read: move the details into docs/"
    for heading in ("## Two commands", "## Install on a real cluster", "## From an assignment to a VM"):
        assert heading in README


def test_every_relative_link_of_the_readme_exists() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local), "the README links into the site"
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, f"the README links to files that do not exist: {missing}"
