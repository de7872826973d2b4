"""The performance page's form for a benchmark's figures, so a run's output is pasted as is.

Each section of docs/performance.md opens with a line saying when, on what and with which
command the figures were taken, then one or more Markdown tables whose last column is the
goal ("—" where none was set). A benchmark builds its rows and prints `page(...)` last.
"""

from __future__ import annotations

import datetime
import os
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

COLUMNS = ("figure", "value", "goal")
NO_GOAL = "—"

Row = Sequence[object]


def machine() -> str:
    """The CPUs this process may use and their model, as `nproc` and /proc/cpuinfo say."""
    cpus = len(os.sched_getaffinity(0))
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpus} CPUs ({model})" if model else f"{cpus} CPUs"


def command(argv: Sequence[str] | None = None) -> str:
    """The command line as a reader would type it again: the script's name and its arguments."""
    argv = list(sys.argv if argv is None else argv)
    return shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else ""


def cell(value: object) -> str:
    # A pipe would end the cell early; a newline would end the row.
    text = NO_GOAL if value is None or value == "" else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def figure_rows(values: dict[str, object], goals: dict[str, str | None]) -> list[Row]:
    """Rows in the page's order (that of `goals`: each figure's label and its goal) for the figures measured."""
    unknown = set(values) - set(goals)
    if unknown:
        raise ValueError(f"figures the page does not have: {sorted(unknown)}")
    return [(label, values[label], goal) for label, goal in goals.items() if label in values]


def table(rows: Iterable[Row], columns: Sequence[str] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    for row in rows:
        row = list(row)
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells, the table {len(columns)} columns")
        lines.append("| " + " | ".join(cell(value) for value in row) + " |")
    return "\n".join(lines)


def page(
    *tables: str,
    when: datetime.date | None = None,
    on: str | None = None,
    argv: Sequence[str] | None = None,
    note: str = "",
) -> str:
    """The lead line (date, machine, command, then any note) and the tables, as the page has them."""
    when = when or datetime.datetime.now(datetime.timezone.utc).date()
    lead = f"{when.isoformat()}, {on or machine()}, `{command(argv)}`." + (f" {note}" if note else "")
    return "\n\n".join([lead, *tables])


def figures_page(measured: dict[str, object], goals: dict[str, str | None], **lead) -> str:
    """One table of figures (label, value, goal) under its lead line: the form of most sections."""
    return page(table(figure_rows(measured, goals)), **lead)
