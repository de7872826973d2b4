"""The README, the site, the tests, the code and its comments speak of the product: no internal
work-item numbers and no diary of the work (which run came when, at which point of the work).
What happened when is git log's to tell."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATTERNS = [
    re.compile(r"\b(?:issues?|stop|work items?|tickets?) #?\d+\b", re.I),
    re.compile(r"\bthis (?:session|stop)\b", re.I),
    re.compile(r"\b(?:last|previous|next|earlier) stop\b", re.I),
]
SOURCES = ["README.md", "mkdocs.yml", "docs/**/*.md", "docs/**/*.py", "operator/**/*.py", "tests/**/*.py", "e2e/**/*.py",
           "charts/**/*.yaml", "charts/**/*.tpl", "Makefile", "Dockerfile"]  # fmt: skip


def _files() -> list[Path]:
    found = {p for pattern in SOURCES for p in REPO.glob(pattern) if p.is_file() and "kubeletapi" not in p.parts}
    return sorted(found)


def diary(text: str) -> list[str]:
    """The internal references and diary phrases in `text`, as found."""
    return [m.group(0) for pattern in PATTERNS for m in pattern.finditer(text)]


def test_no_work_item_numbers_or_diary_in_the_docs_tests_and_code() -> None:
    found = {}
    for path in _files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if hits := diary(line):
                found[f"{path.relative_to(REPO)}:{number}"] = hits
    assert not found, f"say what it is, not which work item or when: {found}"


# The examples are put together here so that this file holds none of them whole.
@pytest.mark.parametrize("words", [
    ("What an admin sees (Issue", "18's cases)"), ("the goal of stop", "31"), ("measured this", "session"),
    ("as at the last", "stop"), ("see issue", "#20"), ("in work item", "7"),
])  # fmt: skip
def test_each_kind_of_reference_is_found(words: tuple[str, str]) -> None:
    assert diary(" ".join(words))


@pytest.mark.parametrize("text", [
    "SIGTERM stops the agent", "a stop of 2 s", "the issuer signs it", "Stop the VM that holds it", " ".join(("stops", "10 processes")),
])  # fmt: skip
def test_the_product_s_own_words_pass(text: str) -> None:
    assert not diary(text)
