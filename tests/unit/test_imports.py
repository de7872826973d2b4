"""Imports run one way: the pure rooms (the API, PCI, the KubeVirt rendering, admission's
rules) know nothing of the controller or the agent, the agent nothing of the controller,
and no module imports itself back through others. Read from the source, as Python would
import it at start-up (imports under TYPE_CHECKING and inside functions left out)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "operator"


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "kubeletapi" in parts:  # generated gRPC stubs
            continue
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(body: list[ast.stmt]) -> set[str]:
    """The passthrough modules a module body imports when it runs."""
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nested += [s for handler in getattr(node, "handlers", []) for s in handler.body]
            found |= _imports(nested)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("passthrough"):
            for alias in node.names:  # `from passthrough.api import views` imports a module
                found.add(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("passthrough")}
    return found


GRAPH = {name: {m for m in _imports(ast.parse(path.read_text()).body) if m in MODULES and m != name}
         for name, path in MODULES.items()}  # fmt: skip


def _reaches(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_module_imports_itself_back() -> None:
    circles = sorted(name for name in GRAPH if name in _reaches(name))
    assert not circles, f"import circles through: {circles}"


@pytest.mark.parametrize(("room", "forbidden"), [
    ("passthrough.api", ("passthrough.controller", "passthrough.agent", "passthrough.admission", "passthrough.kube",
                         "passthrough.deviceplugin", "passthrough.dra")),
    ("passthrough.pci", ("passthrough.controller", "passthrough.agent", "passthrough.admission", "passthrough.kube")),
    ("passthrough.kubevirt", ("passthrough.controller", "passthrough.agent", "passthrough.admission")),
    ("passthrough.admission.rules", ("passthrough.controller",)),
    ("passthrough.admission.claims", ("passthrough.controller",)),
    ("passthrough.agent", ("passthrough.controller", "passthrough.admission")),
    # The agent's loop puts a scan together from rooms that know nothing of it, nor of each other's jobs.
    *[(f"passthrough.agent.{room}", ("passthrough.agent.loop", "passthrough.agent.main"))
      for room in ("reporter", "ownnode", "moves", "admit", "watches")],
    # The DRA driver's passes lean on its rooms (health, other servers, claims prepared, binding answers), never back.
    *[(f"passthrough.dra.{room}", ("passthrough.dra.driver", "passthrough.agent.loop", "passthrough.agent.main"))
      for room in ("healthwatch", "elsewhere", "registration", "health", "others", "slice", "binding", "prepared", "cdi",
                   "preparer", "answers")],
    ("passthrough.metrics", ("passthrough.controller", "passthrough.deviceplugin", "passthrough.agent")),
])  # fmt: skip
def test_a_room_reaches_none_of_what_it_must_not_know(room: str, forbidden: tuple[str, ...]) -> None:
    members = [name for name in GRAPH if name == room or name.startswith(room + ".")]
    assert members, f"no module {room}"
    wrong = sorted(f"{name} -> {target}" for name in members for target in _reaches(name)
                   if target.startswith(forbidden))  # fmt: skip
    assert not wrong, f"{room} reaches what it must not know: {wrong}"
