"""Each benchmark prints its figures in the form of its section of docs/performance.md: the lead
line (date, machine, command), the same tables with the same columns, and each figure under the
page's label with the page's goal beside it, so a run's output is pasted into the page as is.
No benchmark runs here: each script's table function is given figures."""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "e2e" / "bench"
PAGE = REPO / "docs" / "performance.md"
LEAD = {"when": datetime.date(2026, 1, 2), "on": "2 CPUs (Example CPU)", "argv": ["e2e/bench/bench_x.py", "--runs", "3"]}

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from e2e.bench import table  # noqa: E402


def bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_tables_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def tables(markdown: str) -> list[list[list[str]]]:
    """Each table's rows (header first, the separator left out) as lists of cells."""
    found, current = [], None
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if current is None:
                current = []
                found.append(current)
            if not all(re.fullmatch(r"-{3,}", cell) for cell in cells):
                current.append(cells)
        else:
            current = None
    return found


def sections() -> dict[str, str]:
    """Each benchmark script's section of the page, by the script's name in the section's heading."""
    by_script = {}
    for part in re.split(r"^## ", PAGE.read_text(), flags=re.M)[1:]:
        heading = part.splitlines()[0]
        for script in re.findall(r"`(bench_\w+)\.py`", heading):
            by_script[script] = part
    return by_script


SECTIONS = sections()


def page_tables(script: str) -> list[list[list[str]]]:
    assert script in SECTIONS, f"docs/performance.md has no section naming `{script}.py`"
    return tables(SECTIONS[script])


def assert_page_form(script: str, printed: str, goals: dict[str, str | None]) -> None:
    lead = printed.split("\n\n")[0]
    assert lead.startswith("2026-01-02, 2 CPUs (Example CPU), `bench_x.py --runs 3`."), lead
    ours, theirs = tables(printed), page_tables(script)
    assert [t[0] for t in ours] == [t[0] for t in theirs[: len(ours)]], "the columns differ from the page's"
    for rows in ours:
        assert all(len(row) == len(rows[0]) for row in rows)
    # Every figure under the page's label with the page's goal beside it.
    page_goals = {row[0]: row[-1] for t in theirs for row in t[1:]}
    for label, goal in goals.items():
        assert label in page_goals, f"{script}: the page has no figure {label!r}"
        assert page_goals[label] == table.cell(goal), f"{script}: {label!r} has goal {goal!r}, the page {page_goals[label]!r}"
    printed_goals = {row[0]: row[-1] for t in ours if t[0] == list(table.COLUMNS) for row in t[1:]}
    assert printed_goals == {label: table.cell(goal) for label, goal in goals.items() if label in printed_goals}


def test_the_helper_prints_the_lead_line_and_a_table_in_the_pages_form() -> None:
    printed = table.page(table.table([("a | b", 1.5, None)]), note="Kubernetes v1.", **LEAD)
    assert printed == (
        "2026-01-02, 2 CPUs (Example CPU), `bench_x.py --runs 3`. Kubernetes v1.\n\n"
        "| figure | value | goal |\n| --- | --- | --- |\n| a \\| b | 1.5 | — |"
    )


def test_a_figure_the_page_does_not_have_is_refused() -> None:
    with pytest.raises(ValueError, match="does not have"):
        table.figure_rows({"something new": "1 s"}, {"known": None})


def test_the_machine_names_its_cpus() -> None:
    assert re.match(r"\d+ CPUs", table.machine())


def test_controlplane() -> None:
    module = bench("bench_controlplane")
    printed = module.page_table(476.0, [3.69, 4.56, 5.33], {"etcd": 45 * 2**20, "kube-apiserver": 370 * 2**20}, **LEAD)
    assert_page_form("bench_controlplane", printed, module.GOALS)
    assert "| median 4.56 s (3.69 to 5.33 s over 3 starts) |" in printed
    assert set(module.GOALS) == {row[0] for row in page_tables("bench_controlplane")[0][1:]}
    recorded = module.page_table(739.0, [12.86], {"etcd": 58 * 2**20}, recorded=True, **LEAD)
    assert "| 739 s (recorded by the build of the cache entry) |" in recorded


def test_kubevirt() -> None:
    module = bench("bench_kubevirt")
    measured = {
        "config write to the KubeVirt CR showing it": "p50 217 ms, p99 223 ms over 50 changes",
        "writes per config change": "3 (KubeVirt CR APPLY 1, config/status APPLY 1, events POST 1)",
        "KubeVirt CR ceiling": "1.37 MiB at 10,000 assigned devices (143 bytes each); warned; 10,500 fit",
    }
    assert_page_form("bench_kubevirt", module.page_table(measured, **LEAD), module.GOALS)


def test_render() -> None:
    module = bench("bench_render")
    printed = module.page_table(2219, {"render": (5.78, 23.14), "parse_values + render": (18.46, 20.0)}, **LEAD)
    assert_page_form("bench_render", printed, module.GOALS)
    assert "| render the allow-list | p50 5.78 ms, p99 23.14 ms (2,219 entries) | 50 ms |" in printed



def test_admission() -> None:
    module = bench("bench_admission")
    measured = dict.fromkeys(module.GOALS, "p50 3.3 ms, p99 19.2 ms")
    assert_page_form("bench_admission", module.page_table(measured, **LEAD), module.GOALS)


def test_holders() -> None:
    module = bench("bench_holders")
    printed = module.page_table([0.07] * 9 + [0.08], [0.08] * 9 + [0.11], 54.1, 33.3, **LEAD)
    assert_page_form("bench_holders", printed, module.GOALS)
    assert "| p50 0.07 s, p90 0.08 s, max 0.08 s (10 rounds) |" in printed
    assert "| 54.1 MiB (USS 33.3 MiB) |" in printed


def test_dra() -> None:
    module = bench("bench_dra")
    measured = {
        "DRA: claim and pod to CreateContainer with its CDI devices": "p50 88 ms, p90 106 ms, max 156 ms",
        "at rest, rescans every second": "0 ResourceSlice writes, 0 NodePCIDevice writes in 30 s",
    }
    assert_page_form("bench_dra", module.page_table(measured, **LEAD), module.GOALS)


def test_agent() -> None:
    module = bench("bench_agent")
    measured = {
        "agent with device plugins": "first report 0.4 s after exec; RSS 49.5 MiB; 2.4 s CPU per idle hour",
        "discovery": "p50 123.1 ms, p99 170.2 ms over 50 runs (513 functions, 308 reported)",
    }
    assert_page_form("bench_agent", module.page_table(measured, **LEAD), module.GOALS)


def test_fleet() -> None:
    module = bench("bench_fleet")
    measured = {
        "first report (agent start to a watch seeing every device with its status)": "41.0 s (8,000 devices)",
        "failed scans": "0",
        "restart of all agents": "16.6 s to every first scan done, 0 writes",
    }
    printed = module.page_table(measured, **LEAD)
    assert_page_form("bench_fleet", printed, module.GOALS)
    assert printed.index("first report") < printed.index("failed scans") < printed.index("restart of all agents")


def test_operator() -> None:
    module = bench("bench_operator")
    burst = next(label for label in module.GOALS if label.startswith("**burst"))
    measured = {burst: "**median 1.10x** (0.96x, 1.10x, 1.24x over 3 bursts of 500)", "memory": "108 MiB peak RSS"}
    printed = module.page_table(measured, note="Load average 0.9 at the start.", **LEAD)
    assert_page_form("bench_operator", printed, module.GOALS)
    assert printed.splitlines()[0].endswith("`. Load average 0.9 at the start.")


def test_device_plugin() -> None:
    module = bench("bench_device_plugin")
    measured = {"agent RSS": "54 MiB (8 devices, 4 plugins)", "`Allocate` over gRPC": "p50 1.18 ms, p99 6.07 ms over 500"}
    printed = module.page_table(measured, **LEAD)
    assert_page_form("bench_device_plugin", printed, module.GOALS)
    assert "| `Allocate` over gRPC | p50 1.18 ms, p99 6.07 ms over 500 | — |" in printed


def test_realkernel() -> None:
    module = bench("bench_realkernel")
    shapes = {"nic (e1000e, 1-function group)": ([0.82, 0.9, 2.81], [0.75, 0.8, 0.99])}
    printed = module.page_table(shapes, {"boot to the command server": "14.6 s"}, **LEAD)
    assert_page_form("bench_realkernel", printed, module.GOALS)
    assert "| nic (e1000e, 1-function group) | p50 0.90 s, max 2.81 s | p50 0.80 s, max 0.99 s | — |" in printed


def test_kubevirt_vm() -> None:
    module = bench("bench_kubevirt_vm")
    printed = module.page_table([0.5, 0.6, 0.7], [2.3, 2.4], (3, 3), 1, **LEAD)
    assert_page_form("bench_kubevirt_vm", printed, module.GOALS)
    assert "| p50 600 ms, p90 680 ms (3 of 3 VMs) |" in printed
    assert "| 1 of 6 |" in printed
    assert_page_form("bench_kubevirt_vm", module.page_table([5.8], [6.1], (1, 1), 0, True, **LEAD), module.GOALS)


def test_every_figure_on_the_page_is_one_a_benchmark_prints() -> None:
    by_section: dict[str, set[str]] = {}
    for script in SECTIONS:
        module = bench(script)
        by_section.setdefault(SECTIONS[script], set()).update(module.GOALS)
    for section, labels in by_section.items():
        on_page = {row[0] for t in tables(section) if t[0] == list(table.COLUMNS) for row in t[1:]}
        assert labels == on_page, section.splitlines()[0]


def test_realnode_ha() -> None:
    module = bench("bench_realnode_ha")
    measured = dict.fromkeys(module.GOALS, "0 of 1,234")
    assert_page_form("bench_realnode_ha", module.page_table(measured, **LEAD), module.GOALS)
