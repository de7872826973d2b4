"""The bad-input corpus (tests/corpus): generated broken sysfs trees, pci.ids files and platform
values, and the regressions they found, replayed on every run.

Nothing raises; every device ruled out says why and what to do; a damaged pci.ids line is
named by its number; every refused value is named by its field path, in our words, not
pydantic's; and the CLI answers bad input with exit 1 or 2 and a message, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import given, note
from hypothesis import strategies as st

from passthrough import cli
from passthrough.agent import report
from passthrough.api.models import PassthroughConfigSpec, PCIAttributes
from passthrough.kubevirt.render import render
from passthrough.kubevirt.values import ValuesError, parse_values
from passthrough.pci import pciids
from passthrough.pci.discovery import Device, Discovery, discover
from passthrough.pci.pciids import PciIds
from tests import corpus
from tests.corpus import pci_ids as ids_corpus
from tests.corpus import sysfs_trees, values as values_corpus

REPO = Path(__file__).resolve().parents[2]
DB_PATH = REPO / "e2e" / "data" / "pci.ids.2025-07-11"
DB = PciIds.load(DB_PATH)
INT64 = range(-(2**63), 2**63)


@contextlib.contextmanager
def kept_if_failing(kind: str, test: str, payload: object, ext: str = "json") -> Iterator[None]:
    """Note the example (printed with a failure), and keep it under regressions/ when recording."""
    note(json.dumps(payload, ensure_ascii=True) if ext == "json" else repr(payload))
    try:
        yield
    except Exception:
        corpus.record(kind, test, payload, ext)
        raise


@contextlib.contextmanager
def scratch() -> Iterator[Path]:
    """A directory per example, removed after it (huge generated files must not pile up)."""
    with tempfile.TemporaryDirectory(prefix="corpus-", dir=corpus.scratch_dir()) as folder:
        yield Path(folder)


# --- sysfs trees --------------------------------------------------------------------------


def check_discovery(description: dict, root: Path) -> tuple[sysfs_trees.Host, Discovery]:
    host = sysfs_trees.materialise(description, root)
    found = discover(host.sysfs, host.proc, DB)
    for device in found.devices:
        check_device(device)
    assert all(isinstance(p, str) and p for p in found.problems)
    return host, found


def check_device(device: Device) -> None:
    if device.eligible:
        assert device.reason == "", device
    else:
        why, sep, todo = device.reason.partition("; ")
        assert why.strip() and sep and todo.strip(), f"{device.address}: {device.reason!r} does not say why and what to do"
    if device.reported:
        # What the agent writes for it must be an object the API server takes.
        attributes = report.attributes(device, "node-a")
        assert PCIAttributes.model_validate(attributes).model_dump(by_alias=True) == attributes, device.address
        for key in ("iommuGroup", "numaNode"):
            assert attributes[key] in INT64 and attributes[key] >= -1, f"{device.address}: {key} {attributes[key]}"


_BASELINES: dict[str, tuple[dict[str, tuple], dict[str, str]]] = {}


def baseline(base: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """The verdicts on the unbroken host, and each device's directory relative to the root."""
    if base not in _BASELINES:
        with scratch() as root:
            host, found = check_discovery({"base": base, "changes": []}, root)
            dirs = {a: str(p.relative_to(host.root)) for a, p in sysfs_trees.device_dirs(host.sysfs).items()}
            _BASELINES[base] = ({d.address: verdict(d, host.root) for d in found.devices}, dirs)
    return _BASELINES[base]


def verdict(device: Device, root: Path) -> tuple:
    return (device.eligible, device.reason.replace(str(root), "<root>"), device.reported, device.vendor_id,
            device.device_id, device.class_code, device.driver, device.iommu_group, device.numa_node,
            device.name, device.resource_name)  # fmt: skip


def check_others_unharmed(description: dict, host: sysfs_trees.Host, found: Discovery) -> None:
    """Devices outside the IOMMU groups of the broken ones are judged as on the unbroken host."""
    touched = sysfs_trees.affected(description)
    if touched is None:
        return
    before, dirs = baseline(description["base"])
    below = {a for a in dirs for t in touched if t in dirs and (dirs[a] + "/").startswith(dirs[t] + "/")}
    touched |= below
    now = {d.address: d for d in found.devices}
    groups = {before[a][7] for a in touched if a in before} | {now[a].iommu_group for a in touched if a in now}
    for address, was in before.items():
        if address in touched or was[7] in groups:
            continue
        assert address in now, f"{address} vanished"
        assert verdict(now[address], host.root) == was, f"{address} changed"


@corpus.profile()
@given(sysfs_trees.trees())
def test_discovery_never_raises_and_every_device_ruled_out_says_why_and_what_to_do(description):
    with kept_if_failing("sysfs", "discovery", description), scratch() as root:
        check_discovery(description, root)


@corpus.profile(80)
@given(sysfs_trees.scoped_trees())
def test_a_broken_device_hides_no_device_outside_its_iommu_group(description):
    with kept_if_failing("sysfs", "others-unharmed", description), scratch() as root:
        host, found = check_discovery(description, root)
        check_others_unharmed(description, host, found)


@pytest.mark.parametrize("path", corpus.regressions("sysfs"))
def test_sysfs_regression(path, capsys):
    description = corpus.load_json(path)
    with scratch() as root:
        host, found = check_discovery(description, root / "host")
        check_others_unharmed(description, host, found)
        # The command an admin runs on such a host: a table.
        code, out, err = run_in_process(capsys, "discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc),
                                        "--pci-ids", str(DB_PATH))  # fmt: skip
    assert code == 0 and out.startswith("IOMMU: "), err


# --- pci.ids ------------------------------------------------------------------------------


def load_bytes(data: bytes, folder: Path) -> PciIds:
    path = folder / "pci.ids"
    path.write_bytes(data)
    return PciIds.load(path)


def lookup(db: PciIds, how: tuple) -> str | None:
    return getattr(db, how[0])(*how[1:])


def check_damage_notes(db: PciIds, lines: int) -> None:
    numbers = [n for n, _ in db.damage]
    assert numbers == sorted(numbers) and all(1 <= n <= lines for n in numbers)
    assert len(numbers) >= min(db.damaged_lines, pciids.NOTED_DAMAGE)
    if db.damage:
        assert f"line {numbers[0]}: " in db.damage_report and "reinstall" in db.damage_report
    else:
        assert db.damage_report == ""


@corpus.profile()
@given(ids_corpus.cut_short())
def test_a_pci_ids_cut_short_keeps_every_whole_line_and_names_a_cut_one(cut):
    data, offset = cut
    with kept_if_failing("pciids", "cut-short", ids_corpus.as_regression(data, f"cut at byte {offset}")), scratch() as d:
        db = load_bytes(data, d)
        for how, expected in ids_corpus.complete_entries(offset):
            assert lookup(db, how) == expected
        check_damage_notes(db, data.count(b"\n") + 1)
        last = data.decode().split("\n")[-1]
        if ids_corpus._is_damaged(last):
            assert (data.count(b"\n") + 1) in [n for n, _ in db.damage]
        assert db.problem == "" or "no vendor entries" in db.problem


@corpus.profile()
@given(ids_corpus.with_damaged_line())
def test_a_damaged_pci_ids_line_is_reported_with_its_number_and_hides_nothing(damaged):
    data, number, line = damaged
    with kept_if_failing("pciids", "damaged-line", ids_corpus.as_regression(data, f"line {number} damaged", damaged_line=number)), scratch() as d:  # fmt: skip
        db = load_bytes(data, d)
        assert db.problem == "" and db.damaged_lines == 1
        [(noted, text)] = db.damage
        assert noted == number and repr(line[:60]) in text
        assert f"line {number}: " in db.damage_report
        for how, expected in ids_corpus.complete_entries(len(ids_corpus.SAMPLE)):
            assert lookup(db, how) == expected


@corpus.profile()
@given(ids_corpus.binary())
def test_any_bytes_as_pci_ids_never_raise(data):
    with kept_if_failing("pciids", "binary", ids_corpus.as_regression(data, "binary")), scratch() as d:
        db = load_bytes(data, d)
        check_damage_notes(db, data.count(b"\n") + 1)
        assert bool(db.problem) == (not db._vendors)


@corpus.profile(60)
@given(ids_corpus.invalid_utf8())
def test_bytes_that_are_not_utf8_are_noted_with_their_line(bad):
    data, number = bad
    with kept_if_failing("pciids", "not-utf8", ids_corpus.as_regression(data, f"line {number} not UTF-8")), scratch() as d:
        db = load_bytes(data, d)
        assert db.problem == "" and db.damaged_lines == 0
        assert [n for n, _ in db.damage] == [number] and "not UTF-8" in db.damage_report
        spoilt = next(expected for line, _, expected in ids_corpus.ENTRIES if line == number)
        for _, how, expected in ids_corpus.ENTRIES:
            if spoilt not in expected:  # a class name carries its subclass's
                assert lookup(db, how) == expected


@pytest.mark.parametrize("path", corpus.regressions("pciids"))
def test_pci_ids_regression(path, tmp_path):
    entry = corpus.load_json(path)
    data = ids_corpus.regression_bytes(entry)
    db = load_bytes(data, tmp_path)
    check_damage_notes(db, data.count(b"\n") + 1)
    if "damaged_line" in entry:
        assert entry["damaged_line"] in [n for n, _ in db.damage]
    for how, expected in entry.get("finds", []):
        assert lookup(db, tuple(how)) == expected


def test_a_50_mb_pci_ids_made_on_the_fly_is_read_whole_with_its_damage_counted():
    with scratch() as folder:
        path = folder / "huge.ids"
        vendors = ids_corpus.write_huge(path, 50 << 20)
        db = PciIds.load(path)
    assert db.problem == "" and db.edition == "2099.01.01"
    last = vendors - 1
    assert db.device_name(f"{last % 65536:04x}", "0007") == f"Device 7 of vendor {last % 65536}"
    assert db.damaged_lines == vendors // 1000 and len(db.damage) == pciids.NOTED_DAMAGE
    assert f"and {vendors // 1000 - pciids.NOTED_DAMAGE} more damaged lines" in db.damage_report


def test_a_pci_ids_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(pciids, "MAX_SIZE", 4096)
    path = tmp_path / "big.ids"
    ids_corpus.write_huge(path, 8192)
    db = PciIds.load(path)
    assert "too large to be a PCI ID database" in db.problem and "--pci-ids" in db.problem
    assert db.vendor_name("0000") is None


@pytest.mark.parametrize("special", ["/dev/null", "/dev/zero"])
def test_a_device_given_as_pci_ids_is_refused_unread(special):
    # /dev/zero never ends: reading it whole would take every byte of memory.
    db = PciIds.load(special)
    assert "is not a regular file" in db.problem and "--pci-ids" in db.problem


# --- platform values ----------------------------------------------------------------------


def check_values(document: object) -> PassthroughConfigSpec | None:
    """parse_values returns a spec the operator can use, or a ValuesError in our words, naming each field."""
    try:
        spec = parse_values(document)
    except ValuesError as e:
        assert e.problems, "a ValuesError that lists no problem"
        for problem in e.problems:
            check_problem(document, problem)
        return None
    render(spec)  # an accepted spec renders
    grace = spec.devices.notFoundGracePeriodSeconds
    assert values_corpus.timedelta_fits(grace), f"devices.notFoundGracePeriodSeconds {grace} accepted, but no timedelta holds it"
    return spec


def check_problem(document: object, problem: str) -> None:
    where, sep, text = problem.partition(": ")
    assert sep and text.strip(), f"{problem!r} names no field"
    assert not values_corpus.RAW.search(problem), f"{problem!r} is pydantic's wording, not a sentence for an admin"
    if where == "values":
        return
    try:
        found, _ = values_corpus.walk(document, where)
    except LookupError as e:
        raise AssertionError(f"{problem!r}: the path is not in the values ({e})") from None
    assert found or text == "is required", f"{problem!r}: no {where} in the values"


@corpus.profile(200)
@given(values_corpus.values())
def test_parse_values_returns_a_spec_or_names_each_wrong_field_in_our_words(document):
    with kept_if_failing("values", "parse-values", yaml_text(document), ext="yaml"):
        check_values(document)


def yaml_text(document: object) -> str:
    return yaml.safe_dump(document, allow_unicode=False, sort_keys=False)


@pytest.mark.parametrize("path", corpus.regressions("values"))
def test_values_regression(path, capsys):
    for document in load_regression_values(path):
        check_values(document)
    check_exit(*run_in_process(capsys, "render", "--values", str(path)), "render")


def load_regression_values(path: Path) -> list[object]:
    try:
        return list(corpus.load_yaml_documents(path))
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError):
        return []  # a file only the CLI reads (not YAML, nested too deep): the CLI must say so


# --- the CLI ------------------------------------------------------------------------------


# A UTF-8 locale as on an admin's machine (en_US.UTF-8): Python then writes strictly, where
# the C locale of a container lets surrogate escapes through.
STRICT_UTF8 = "utf-8:strict"


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passthrough", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO / "operator"), "PYTHONIOENCODING": STRICT_UTF8},
                          errors="backslashreplace")  # fmt: skip


def check_exit(code: int, out: str, err: str, command: str) -> None:
    assert "Traceback" not in err, err[-3000:]
    assert code in (0, 1, 2), (code, err)
    if code == 0:
        return
    assert out == "", "output on stdout from a refusal"
    lines = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert lines and lines[0].startswith(f"passthrough {command}: "), err
    if command != "render":  # render lists the problems, one per line, below its first
        assert len(lines) == 1, err


def run_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """`passthrough ARGS` in this process (pytest's capture writes UTF-8 strictly, as a UTF-8 locale
    does); an exception escaping it fails the test as a traceback would."""
    capsys.readouterr()
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse
        code = e.code if isinstance(e.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


SUBPROCESS_CASES = {
    "discover, a driver name that is not UTF-8": ("discover", "sysfs/driver-name-not-utf8.json", "table"),
    "discover, sysfs entries that loop": ("discover", "sysfs/iommu-group-links-loop-in-two.json", "json"),
    "discover, a gzip file as pci.ids": ("discover", "pciids/gzip-given-as-pci-ids.json", "table"),
    "resource-name, pci.ids cut short": ("resource-name", "pciids/cut-inside-a-subsystem-id.json", ""),
    "render, values nested 600 deep": ("render", "values/nested-600-deep.yaml", ""),
    "render, not UTF-8": ("render", "values/not-utf8.yaml", ""),
    "render, every type wrong": ("render", "values/wrong-types-inside.yaml", ""),
}


@pytest.mark.parametrize("case", sorted(SUBPROCESS_CASES))
def test_the_cli_as_its_own_process_refuses_or_prints_never_a_traceback(case):
    command, regression, output = SUBPROCESS_CASES[case]
    path = corpus.REGRESSIONS / regression
    with scratch() as root:
        args: list[str] = [command]
        pci_ids = DB_PATH
        if regression.startswith("pciids/"):
            pci_ids = root / "pci.ids"
            pci_ids.write_bytes(ids_corpus.regression_bytes(corpus.load_json(path)))
        if command == "discover":
            description = corpus.load_json(path) if regression.startswith("sysfs/") else {"base": "gpu_node"}
            host = sysfs_trees.materialise(description, root / "host")
            args += ["--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc), "--pci-ids", str(pci_ids), "-o", output]
        elif command == "resource-name":
            args += ["--pci-ids", str(pci_ids), "10de:2236"]
        else:
            args += ["--values", str(path)]
        result = run_cli(*args)
    check_exit(result.returncode, result.stdout, result.stderr, command)


pci_ids_bytes = st.one_of(
    ids_corpus.binary(),
    ids_corpus.cut_short().map(lambda c: c[0]),
    ids_corpus.with_damaged_line().map(lambda d: d[0]),
    st.just(None),  # the good database
)


@corpus.profile(60)
@given(sysfs_trees.trees(), pci_ids_bytes, st.sampled_from(["json", "table"]), st.booleans())
def test_discover_on_a_broken_host_prints_or_refuses_with_one_line(capsys, description, ids, output, everything):
    with kept_if_failing("sysfs", "discover-cli", description), scratch() as root:
        host = sysfs_trees.materialise(description, root / "host")
        ids_path = DB_PATH if ids is None else root / "pci.ids"
        if ids is not None:
            ids_path.write_bytes(ids)
        args = ["discover", "--sysfs-root", str(host.sysfs), "--proc-root", str(host.proc), "--pci-ids", str(ids_path), "-o", output]
        code, out, err = run_in_process(capsys, *args, *(["--all"] if everything else []))
        check_exit(code, out, err, "discover")
        if code == 0 and output == "json":
            json.loads(out)
        code, out, err = run_in_process(capsys, "resource-name", "--pci-ids", str(ids_path), "10de:2236")
        check_exit(code, out, err, "resource-name")


@corpus.profile(150)
@given(values_corpus.values(), st.sampled_from(["yaml", "json"]), st.sampled_from(["kubevirt", "cozystack-package"]))
def test_render_on_any_values_prints_or_refuses_naming_the_fields(capsys, document, output, form):
    text = yaml_text(document)
    with kept_if_failing("values", "render-cli", text, ext="yaml"), scratch() as d:
        path = d / "values.yaml"
        path.write_text(text)
        code, out, err = run_in_process(capsys, "render", "--values", str(path), "-o", output, "--format", form)
        check_exit(code, out, err, "render")
        if code == 0:
            yaml.safe_load(out)


@corpus.profile(100)
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_render_on_any_file_prints_or_refuses(capsys, data):
    with kept_if_failing("values", "render-bytes", data, ext="bin"), scratch() as d:
        path = d / "values.yaml"
        path.write_bytes(data)
        code, out, err = run_in_process(capsys, "render", "--values", str(path))
        check_exit(code, out, err, "render")
