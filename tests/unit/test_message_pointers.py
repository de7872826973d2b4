"""Messages that send the reader to the manual name a page that exists: the README is a front
door now, and its old sections are pages of the site under docs/."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "operator" / "passthrough"


def _sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))]


def test_messages_name_pages_of_the_manual_that_exist():
    named = [(p, page) for p, text in _sources() for page in re.findall(r"docs/[\w./-]+\.md", text)]
    assert named  # the ServedByOtherPlugin message names the GPU pools page
    missing = [f"{p.relative_to(REPO)}: {page}" for p, page in named if not (REPO / page).is_file()]
    assert missing == []


def test_no_message_sends_the_reader_to_a_readme_section():
    found = [str(p.relative_to(REPO)) for p, text in _sources() if re.search(r"see the README", text, re.IGNORECASE)]
    assert found == []


def test_served_by_other_plugin_points_to_the_gpu_pools_page():
    from passthrough.agent import handover

    error = handover.other_plugin("0000:3b:00.0", "nvidia.com/GA102GL_A10")
    assert "docs/tasks/gpu-pools.md" in str(error.args) + str(vars(error))
    assert "README" not in str(error.args) + str(vars(error))
