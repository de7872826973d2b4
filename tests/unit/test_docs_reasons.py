"""Every reason the code writes is in the reasons table (api/reasons.py), and the table has no
reason the code never writes.

The code is read, not run: a reason is a string literal in one of the places a reason goes
(a parameter or field named `reason`, a `{"reason": ...}` body, a (status, reason, message)
or (type, reason, message) tuple, a variable named `reason` or `REASON`), followed through
a conditional expression and a module constant. A reason compared against (`exc.reason ==
"NotFound"`, `reason in WAITING`'s members) must be in the table too: a misspelt one would
never match.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from passthrough.api import reasons
from passthrough.api.names import CAMEL_CASE_REASON

ROOT = Path(__file__).resolve().parents[2] / "operator" / "passthrough"
# A (status or type, reason, message) tuple begins with one of these.
LEADS = {"True", "False", "Unknown", "Normal", "Warning"}
# Modules whose `reason` is another system's word: the API server's HTTP reason phrase.
FOREIGN = {"kube/client.py"}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(ROOT.rglob("*.py"))
            if "kubeletapi" not in p.parts and str(p.relative_to(ROOT)) not in FOREIGN}  # fmt: skip


def _reason_slots(trees: dict[str, ast.Module]) -> dict[str, int]:
    """Callable name -> the position of its `reason` argument: functions and methods with a
    parameter named so (self left out), classes whose __init__ has one, dataclasses with a field."""
    slots: dict[str, int] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                if names and names[0] in ("self", "cls"):
                    names = names[1:]
                if "reason" in names:
                    slots[node.name] = names.index("reason")
            elif isinstance(node, ast.ClassDef):
                fields = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                init = next((s for s in node.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
                if init is not None:
                    names = [a.arg for a in init.args.args][1:]
                    if "reason" in names:
                        slots[node.name] = names.index("reason")
                elif "reason" in fields and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                    slots[node.name] = fields.index("reason")
    return slots


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    return {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for t in node.targets if isinstance(t, ast.Name)}  # fmt: skip


def _strings(value: ast.expr | None, constants: dict[str, ast.expr]) -> set[str]:
    """The literal reasons an expression can be: constants, both arms of a conditional, a
    module constant's value, the members of a literal set, tuple or list."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return {value.value}
    if isinstance(value, ast.IfExp):
        return _strings(value.body, constants) | _strings(value.orelse, constants)
    if isinstance(value, ast.Name) and value.id in constants:
        return _strings(constants[value.id], constants)
    if isinstance(value, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e, constants) for e in value.elts)) if value.elts else set()
    if isinstance(value, ast.Call) and ast.unparse(value.func) in ("frozenset", "set", "tuple") and value.args:
        return _strings(value.args[0], constants)
    return set()


def _is_reason(target: ast.expr) -> bool:
    name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else ""
    return name in ("reason", "REASON") or name.endswith(("_REASON", "_reason"))


def scan(sources: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(reasons written, reasons compared against): reason -> the files where it is."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    slots = _reason_slots(trees)
    written: dict[str, set[str]] = {}
    compared: dict[str, set[str]] = {}

    def note(found: dict[str, set[str]], values: set[str], path: str) -> None:
        for value in values:
            # Free text in a `reason` (discovery's why-not, "" when eligible) and a Literal of
            # statuses are no reasons: a reason is one CamelCase word, never a status.
            if re.fullmatch(CAMEL_CASE_REASON, value) and value not in LEADS:
                found.setdefault(value, set()).add(path)

    for path, tree in trees.items():
        constants = _constants(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                positional = node.args.posonlyargs + node.args.args
                pairs = list(zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults))
                pairs += [(a, d) for a, d in zip(node.args.kwonlyargs, node.args.kw_defaults) if d is not None]
                for arg, default in pairs:
                    if arg.arg == "reason":
                        note(written, _strings(default, constants), path)
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                slot = slots.get(callee)
                if slot is not None and slot < len(node.args) and not isinstance(node.args[slot], ast.Starred):
                    note(written, _strings(node.args[slot], constants), path)
                for keyword in node.keywords:
                    if keyword.arg == "reason":
                        note(written, _strings(keyword.value, constants), path)
            elif isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "reason":
                        note(written, _strings(value, constants), path)
            elif isinstance(node, ast.Tuple) and len(node.elts) == 3:
                lead = node.elts[0]
                if isinstance(lead, ast.Constant) and lead.value in LEADS:
                    note(written, _strings(node.elts[1], constants), path)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(_is_reason(t) for t in targets):
                    note(written, _strings(node.value, constants), path)
            elif isinstance(node, ast.Compare) and _is_reason(node.left):
                for right in node.comparators:
                    note(compared, _strings(right, constants), path)
    return written, compared


@pytest.fixture(scope="module")
def found() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return scan(_sources())


def test_every_reason_the_code_writes_is_in_the_table(found) -> None:
    written, _ = found
    missing = {r: sorted(where) for r, where in written.items() if r not in reasons.REASONS}
    assert not missing, (f"reasons written but not in operator/passthrough/api/reasons.py: {missing}; add each with "
                         "what it means and what to do, then regenerate the docs (make docs-generate)")  # fmt: skip


def test_every_reason_compared_against_is_in_the_table(found) -> None:
    _, compared = found
    missing = {r: sorted(where) for r, where in compared.items() if r not in reasons.REASONS}
    assert not missing, f"the code compares against reasons the table does not have (misspelt?): {missing}"


def test_the_table_has_no_reason_the_code_never_writes(found) -> None:
    written, _ = found
    stale = sorted(set(reasons.REASONS) - set(written))
    assert not stale, f"reasons.py lists reasons no code writes: {stale}; remove them"


def test_every_entry_says_what_it_means_what_to_do_and_where() -> None:
    kinds = {reasons.NODE_PCI_DEVICE, reasons.PCI_DEVICE, reasons.CONFIG, reasons.RESOURCE_CLAIM, reasons.NODE}
    for name, reason in reasons.REASONS.items():
        assert re.fullmatch(CAMEL_CASE_REASON, name), name
        assert reason.meaning.endswith(".") and reason.todo.endswith("."), name
        assert reason.conditions or reason.events, f"{name}: neither a condition's reason nor an Event's"
        for where in reason.conditions:
            kind, _, type_ = where.partition("/")
            assert kind in kinds and type_, f"{name}: {where}"
        for where in reason.events:
            kind, _, type_ = where.partition("/")
            assert kind in kinds and type_ in ("Normal", "Warning"), f"{name}: {where}"


# The scanner itself: each spelling of a reason in the code is found (a scanner that finds
# nothing would pass the tests above while the table fell behind).
SPELLINGS = '''
from dataclasses import dataclass

REASON = "ByModuleConstant"

@dataclass(frozen=True)
class Cond:
    status: str
    reason: str
    message: str

class Failure(Exception):
    def __init__(self, reason, message):
        self.reason = reason

class Recorder:
    def post(self, involved, type_, reason, message):
        pass

def write(path, text, reason):
    pass

DEFAULT_REASON = "ByNamedConstant"

def answer(bound, reason=DEFAULT_REASON, other="NoReason"):
    pass

def keyword_only(*, reason="ByKeywordDefault"):
    pass

def spelled(recorder, flag):
    Cond("False", "ByDataclassField", "m")
    Failure("ByInitParameter", "m")
    recorder.post({}, "Warning", "ByMethodParameter", "m")
    write("p", "t", "ByFunctionParameter")
    write("p", "t", reason="ByKeyword")
    Failure(REASON, "m")
    body = {"type": "Ready", "reason": "ByDictBody"}
    events = [("Warning", "ByEventTuple", "m")]
    reason = "ByIfArm" if flag else "ByElseArm"
    if body["reason"] == "Compared" or reason in ("ComparedInTuple",):
        return "False", "ByConditionTuple", "m"
'''


def test_the_scanner_finds_each_spelling() -> None:
    written, compared = scan({"spellings.py": SPELLINGS})
    assert set(written) == {
        "ByModuleConstant", "ByDataclassField", "ByInitParameter", "ByMethodParameter", "ByFunctionParameter",
        "ByKeyword", "ByDictBody", "ByEventTuple", "ByIfArm", "ByElseArm", "ByConditionTuple", "ByNamedConstant",
        "ByKeywordDefault",
    }  # fmt: skip
    assert set(compared) == {"ComparedInTuple"}
