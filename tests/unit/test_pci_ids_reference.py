"""The compact pci.ids database against the parser it replaced, kept here as the reference.

`PciIds` once read every name of pci.ids into dicts (about 9 MiB of the agent's memory); it now
keeps the file's bytes and an index, and reads a name from its line when asked. These tests hold
it to the old parser's answers: every vendor, device, subsystem and class of the real editions,
and the names, edition, problem and damage notes of generated, cut and damaged files.
"""

from __future__ import annotations

import os
import re
import stat
import tempfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from passthrough.pci import pciids
from passthrough.pci.pciids import PciIds
from tests import corpus
from tests.corpus import pci_ids as ids_corpus

# --- The reference: pciids.py before the compact index, verbatim from here to the tests ----

SEARCH_PATHS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids")

# Names are split from IDs on any run of blanks: the file uses two spaces, hand edits do not.
_VENDOR = re.compile(r"([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_DEVICE = re.compile(r"\t([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_SUBSYSTEM = re.compile(r"\t\t([0-9A-Fa-f]{4})[ \t]+([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_CLASS = re.compile(r"C[ \t]+([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_SUBCLASS = re.compile(r"\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_PROG_IF = re.compile(r"\t\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_EDITION = re.compile(r"#\s*Version:\s*(\S+)")

_CONSEQUENCE = (
    "device names fall back to hex IDs and GPU resource names become <domain>/<device-id>, "
    "which an allow-list written for named resources will not match"
)
_FIX = "install the hwdata (or pciutils) package, or pass --pci-ids FILE"
# The real file is under 2 MiB; one this size is something else, and reading it whole would
# cost the agent that much memory on every node.
MAX_SIZE = 256 << 20
# Damaged lines noted one by one; the rest are only counted (a binary file has thousands).
NOTED_DAMAGE = 20


class ReferencePciIds:
    """`PciIds` as it was (commit 5a6ef5d), verbatim but for its name: every name in dicts."""

    def __init__(self, path: Path | None = None, edition: str = "", problem: str = "") -> None:
        self.path = path
        self.edition = edition
        self.problem = problem
        self.damaged_lines = 0  # lines skipped
        # (line number, what is wrong with it), in line order: the first NOTED_DAMAGE of the
        # skipped lines, and the first line that is not UTF-8 (read with U+FFFD, not skipped).
        self.damage: list[tuple[int, str]] = []
        self._vendors: dict[str, str] = {}
        self._devices: dict[tuple[str, str], str] = {}
        self._subsystems: dict[tuple[str, str, str, str], str] = {}
        self._classes: dict[str, str] = {}  # "03", "0302", "030200"

    def __repr__(self) -> str:
        return f"PciIds(path={self.path!r}, edition={self.edition!r}, vendors={len(self._vendors)})"

    @classmethod
    def load(cls, path: str | Path | None = None, host_root: str | Path | None = None) -> ReferencePciIds:
        """The database at `path`, or the first of SEARCH_PATHS that exists; never raises.

        `host_root`: where the host's filesystem is mounted (the agent's pod sees the node's
        /usr/share at /host/usr/share): its SEARCH_PATHS come first, so names follow the
        node's own pci.ids as on the host, and the image's own database is the fallback.
        """
        if path is None:
            candidates = [*(str(Path(host_root) / p.lstrip("/")) for p in SEARCH_PATHS if host_root), *SEARCH_PATHS]
            found = next((Path(p) for p in candidates if Path(p).is_file()), None)
            if found is None:
                return cls(problem=f"no pci.ids found (looked in {', '.join(candidates)}); {_CONSEQUENCE}; {_FIX}")
            path = found
        path = Path(path)
        try:
            # A FIFO or a device (--pci-ids /dev/stdin, /dev/zero) would block or never end.
            if not stat.S_ISREG(os.stat(path).st_mode):
                return cls(path=path, problem=f"pci.ids {path} is not a regular file; {_CONSEQUENCE}; {_FIX}")
            with open(path, "rb") as f:
                data = f.read(MAX_SIZE + 1)
        except OSError as e:
            return cls(path=path, problem=f"cannot read pci.ids {path} ({e.strerror or e}); {_CONSEQUENCE}; {_FIX}")
        if len(data) > MAX_SIZE:
            return cls(
                path=path,
                problem=f"pci.ids {path} is over {MAX_SIZE >> 20} MiB, too large to be a PCI ID database "
                f"(the real one is under 2 MiB); {_CONSEQUENCE}; {_FIX}",
            )
        try:
            return cls.parse(data.decode("utf-8"), path)
        except UnicodeDecodeError as e:
            db = cls.parse(data.decode("utf-8", errors="replace"), path)
            line = data.count(b"\n", 0, e.start) + 1
            column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
            db.damage.append((line, f"is not UTF-8 (byte 0x{data[e.start]:02x} at column {column}); its bad bytes read as U+FFFD"))
            db.damage.sort(key=lambda note: note[0])
            return db

    @classmethod
    def parse(cls, text: str, path: Path | None = None) -> ReferencePciIds:
        db = cls(path=path)
        vendors, devices, subsystems, classes = db._vendors, db._devices, db._subsystems, db._classes
        vendor = device = klass = subclass = None
        in_classes = False
        damaged = 0
        for number, line in enumerate(text.split("\n"), start=1):
            line = line.rstrip("\r")
            if not line or line.isspace():
                continue
            first = line[0]
            if first == "#":
                if not db.edition:
                    m = _EDITION.match(line)
                    if m:
                        db.edition = m.group(1)
                continue
            # A damaged line is skipped and changes no context, so it hides nothing after it.
            # Of two entries for one ID the first wins, as in the NVIDIA plugin's lookup.
            wrong = ""
            if first != "\t":
                if first == "C" and (m := _CLASS.fullmatch(line)):
                    in_classes, vendor, device, subclass = True, None, None, None
                    klass = m.group(1).lower()
                    classes.setdefault(klass, _name(m.group(2)))
                elif m := _VENDOR.fullmatch(line):
                    in_classes, device, klass, subclass = False, None, None, None
                    vendor = m.group(1).lower()
                    vendors.setdefault(vendor, _name(m.group(2)))
                elif first in " \v\f":
                    wrong = "is indented with spaces; the format indents with tabs"
                else:
                    wrong = "is neither a vendor line (4 hex digits, blanks, a name) nor a class line (C, 2 hex digits, a name)"
            elif line.startswith("\t\t\t"):
                wrong = "is indented three tabs deep; the format has two levels below a vendor or class"
            elif in_classes:
                if line[1:2] != "\t" and klass and (m := _SUBCLASS.fullmatch(line)):
                    subclass = klass + m.group(1).lower()
                    classes.setdefault(subclass, _name(m.group(2)))
                elif subclass and (m := _PROG_IF.fullmatch(line)):
                    classes.setdefault(subclass + m.group(1).lower(), _name(m.group(2)))
                elif line[1:2] != "\t":
                    wrong = "is not a subclass line (a tab, 2 hex digits, blanks, a name)"
                elif subclass:
                    wrong = "is not a programming interface line (two tabs, 2 hex digits, blanks, a name)"
                else:
                    wrong = "is a programming interface line outside any subclass"
            elif line[1:2] != "\t":
                if vendor and (m := _DEVICE.fullmatch(line)):
                    device = m.group(1).lower()
                    devices.setdefault((vendor, device), _name(m.group(2)))
                elif vendor:
                    wrong = "is not a device line (a tab, 4 hex digits, blanks, a name)"
                else:
                    wrong = "is a device line outside any vendor"
            elif vendor and device and (m := _SUBSYSTEM.fullmatch(line)):
                key = (vendor, device, m.group(1).lower(), m.group(2).lower())
                subsystems.setdefault(key, _name(m.group(3)))
            elif vendor and device:
                wrong = "is not a subsystem line (two tabs, 4 hex digits, a blank, 4 hex digits, blanks, a name)"
            else:
                wrong = "is a subsystem line outside any device"
            if wrong:
                damaged += 1
                if damaged <= NOTED_DAMAGE:
                    db.damage.append((number, f"{_show(line)} {wrong}"))
        db.damaged_lines = damaged
        if not vendors:
            where = f"pci.ids {path}" if path else "pci.ids"
            db.problem = f"{where} is damaged (no vendor entries in it); {_CONSEQUENCE}; {_FIX}"
        return db

    @property
    def damage_report(self) -> str:
        """The damaged lines in one sentence that says what to do; "" when there are none."""
        if not self.damage:
            return ""
        where = f"pci.ids {self.path}" if self.path else "pci.ids"
        notes = "; ".join(f"line {number}: {text}" for number, text in self.damage)
        unnoted = self.damaged_lines - min(self.damaged_lines, NOTED_DAMAGE)
        more = f"; and {unnoted} more damaged lines" if unnoted else ""
        return (
            f"{where} has damaged lines ({notes}{more}); devices named on them fall back to hex IDs; "
            "reinstall the hwdata (or pciutils) package, or fix the file"
        )

    def vendor_name(self, vendor_id: str) -> str | None:
        return self._vendors.get(vendor_id.lower())

    def device_name(self, vendor_id: str, device_id: str) -> str | None:
        return self._devices.get((vendor_id.lower(), device_id.lower()))

    def subsystem_name(self, vendor_id: str, device_id: str, subvendor_id: str, subdevice_id: str) -> str | None:
        key = (vendor_id.lower(), device_id.lower(), subvendor_id.lower(), subdevice_id.lower())
        return self._subsystems.get(key)

    def class_name(self, class_code: str) -> str | None:
        """The name lspci shows for a class code of 2, 4 or 6 hex digits.

        The subclass name ("3D controller"), with the programming interface in brackets
        when it has one ("Non-Volatile memory controller (NVM Express)"); the base class
        name when the subclass is unknown.
        """
        code = class_code.lower()
        base = self._classes.get(code[:2])
        sub = self._classes.get(code[:4]) if len(code) >= 4 else None
        prog_if = self._classes.get(code[:6]) if len(code) >= 6 else None
        if sub is None:
            return base
        return f"{sub} ({prog_if})" if prog_if else sub


def _show(line: str) -> str:
    # A binary file's "line" can be megabytes long.
    return repr(line) if len(line) <= 60 else repr(line[:60]) + "..."


def _name(text: str) -> str:
    # Only blanks: anything else at the end of a name is left for the naming rule to judge.
    return text.rstrip(" \t")


# --- The tests -----------------------------------------------------------------------------

DATA = Path(__file__).resolve().parents[2] / "e2e" / "data"
EDITIONS = sorted(DATA.glob("pci.ids.*"))
# IDs no database has, or that are not IDs at all ("\u212a".lower() is "k").
NOT_IDS = ["", "0", "10d", "10de0", "zzzz", " 10de", "10de ", "10de\n", "\u212a\u212a\u212a\u212a", "\uff11\uff10de"]


def lookups(ref: ReferencePciIds) -> Iterator[tuple]:
    """Every lookup that finds a name in `ref`, in either case, and ones beside them that do not."""
    for vendor in ref._vendors:
        yield ("vendor_name", vendor)
        yield ("vendor_name", vendor.upper())
        yield ("device_name", vendor, "ffff")
    for vendor, device in ref._devices:
        yield ("device_name", vendor, device)
        yield ("device_name", vendor.upper(), device.upper())
        yield ("subsystem_name", vendor, device, vendor, "ffff")
    for vendor, device, subvendor, subdevice in ref._subsystems:
        yield ("subsystem_name", vendor, device, subvendor, subdevice)
        yield ("subsystem_name", vendor.upper(), device, subvendor.upper(), subdevice.upper())
        yield ("subsystem_name", vendor, device, subdevice, subvendor)
    for code in ref._classes:
        yield ("class_name", code)
        yield ("class_name", code.upper() + "ff")
        yield ("class_name", code + "0000"[len(code) - 2 :] + "ff")
    for bad in NOT_IDS:
        yield ("vendor_name", bad)
        yield ("device_name", "10de", bad)
        yield ("subsystem_name", "10de", "2236", bad, "1482")
        yield ("class_name", bad)
        yield ("class_name", "03" + bad)


def mismatches(new: PciIds, ref: ReferencePciIds, extra: list[tuple] = ()) -> list[str]:
    found = []
    for field in ("path", "edition", "problem", "damaged_lines", "damage", "damage_report"):
        if getattr(new, field) != getattr(ref, field):
            found.append(f"{field}: {getattr(new, field)!r} != {getattr(ref, field)!r}")
    if repr(new) != repr(ref).replace("ReferencePciIds(", "PciIds("):
        found.append(f"repr: {new!r} != {ref!r}")
    for how in [*lookups(ref), *extra]:
        got, expected = getattr(new, how[0])(*how[1:]), getattr(ref, how[0])(*how[1:])
        if got != expected:
            found.append(f"{how}: {got!r} != {expected!r}")
    return found


@pytest.mark.parametrize("edition", EDITIONS, ids=lambda p: p.name)
def test_every_name_of_a_real_edition_is_the_reference_parsers(edition):
    ref, new = ReferencePciIds.load(edition), PciIds.load(edition)
    assert len(ref._subsystems) > 10000 and ref.problem == ""
    assert mismatches(new, ref)[:10] == []


@pytest.mark.parametrize("edition", EDITIONS, ids=lambda p: p.name)
def test_a_real_edition_parsed_from_text_or_bytes_is_the_same(edition):
    text = edition.read_text(encoding="utf-8")
    assert mismatches(PciIds.parse(text, edition), ReferencePciIds.parse(text, edition))[:10] == []
    # CRLF line ends: every line is judged on its own, not in blocks.
    crlf = text.replace("\n", "\r\n")
    assert mismatches(PciIds.parse(crlf), ReferencePciIds.parse(crlf))[:10] == []


def test_a_real_edition_keeps_under_2_mib_with_names_looked_up():
    # The dicts of names took 9.2 MiB of this edition; the file's bytes are 1.47 MiB.
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        db = PciIds.load(DATA / "pci.ids.2025-07-11")
        for vendor in ("10de", "8086", "1002", "15b3", "144d", "1af4"):
            for device in ("2236", "2330", "1041", "0000"):
                db.vendor_name(vendor), db.device_name(vendor, device), db.subsystem_name(vendor, device, vendor, "1482")
        for code in ("030200", "030000", "010802", "020000", "060400", "0c0330"):
            db.class_name(code)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    assert db.device_name("10de", "2236") == "GA102GL [A10]"
    assert kept < 2 << 20, f"{kept / 2**20:.2f} MiB"


# Lines of every kind, with few IDs so that entries repeat, and the unusual ways to write them.
_ids4 = st.sampled_from(["10de", "10DE", "1af4", "cafe", "C0de", "0000"])
_ids2 = st.sampled_from(["03", "0c", "0C", "01"])
_names = st.sampled_from(["NVIDIA", "A10  ", "x\t", "\u00e9t\u00e9", "\u3000wide", "\x0bvt", "a\rb", "\ufeffbom", "#not a comment"])
_blank = st.sampled_from(["", " ", "\t", "\t\t", " \t ", "\x0b", "\x0c", "\x1c", "\u3000", "\x85", "\r"])
_gap = st.sampled_from(["  ", " ", "\t", " \t ", "\x0b", ""])
_line = st.one_of(
    st.builds(lambda i, g, n: f"{i}{g}{n}", _ids4, _gap, _names),
    st.builds(lambda i, g, n: f"\t{i}{g}{n}", _ids4, _gap, _names),
    st.builds(lambda i, j, g, n: f"\t\t{i} {j}{g}{n}", _ids4, _ids4, _gap, _names),
    st.builds(lambda g1, i, g2, n: f"C{g1}{i}{g2}{n}", _gap, _ids2, _gap, _names),
    st.builds(lambda i, g, n: f"\t{i}{g}{n}", _ids2, _gap, _names),
    st.builds(lambda i, g, n: f"\t\t{i}{g}{n}", _ids2, _gap, _names),
    st.sampled_from(["#", "# Version: 2031.01.02", "#\tVersion:\t2099", "#Version:", "# version: 1", "#\u3000Version:\u3000wide"]),
    _blank,
    st.sampled_from(ids_corpus.DAMAGED_LINES),
    st.text(st.characters(blacklist_characters="\n"), max_size=12),
)
_ending = st.sampled_from(["", "", "", "\r", "\r\r", " ", "\t", " \r"])
_text = st.lists(st.tuples(_line, _ending).map("".join), max_size=40).flatmap(
    lambda lines: st.sampled_from(["\n".join(lines), "\n".join(lines) + "\n"])
)
_spoilt = st.tuples(_text, st.lists(st.tuples(st.integers(0), st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\r", b"\x00"])), max_size=3))


def _spoil(text_and_bytes: tuple[str, list[tuple[int, bytes]]]) -> bytes:
    text, spoils = text_and_bytes
    data = text.encode("utf-8", "surrogatepass")
    for at, bad in spoils:
        at %= len(data) + 1
        data = data[:at] + bad + data[at:]
    return data


def _probes(data: bytes) -> list[tuple]:
    """Lookups of every ID the generators use, found or not."""
    ids4, ids2 = ["10de", "1af4", "cafe", "c0de", "0000"], ["03", "0c", "01"]
    probes: list[tuple] = [("vendor_name", v) for v in ids4]
    probes += [("device_name", v, d) for v in ids4 for d in ids4]
    probes += [("subsystem_name", v, d, s, s2) for v in ids4[:3] for d in ids4[:3] for s in ids4[:3] for s2 in ids4[:2]]
    probes += [("class_name", c + s + p) for c in ids2 for s in ["", *ids2] for p in (["", *ids2] if s else [""])]
    return probes


def compare_loaded(data: bytes) -> list[str]:
    with tempfile.TemporaryDirectory(dir=corpus.scratch_dir()) as folder:
        path = Path(folder) / "pci.ids"
        path.write_bytes(data)
        return mismatches(PciIds.load(path), ReferencePciIds.load(path), _probes(data))


@corpus.profile(300)
@given(_spoilt.map(_spoil))
def test_a_generated_file_reads_as_the_reference_reads_it(data):
    assert compare_loaded(data) == []


@corpus.profile(200)
@given(_text, st.lists(st.tuples(st.integers(0), st.sampled_from(["\ud800", "\udcff", "\ud83d\ude00", "\u212a", "\x00"])), max_size=3))
def test_generated_text_parses_as_the_reference_parses_it(text, inserts):
    for at, piece in inserts:
        at %= len(text) + 1
        text = text[:at] + piece + text[at:]
    new, ref = PciIds.parse(text, Path("x.ids")), ReferencePciIds.parse(text, Path("x.ids"))
    assert mismatches(new, ref, _probes(b"")) == []


@corpus.profile()
@given(st.one_of(ids_corpus.binary(), ids_corpus.cut_short().map(lambda c: c[0]), ids_corpus.with_damaged_line().map(lambda d: d[0]),
                 ids_corpus.invalid_utf8().map(lambda b: b[0])))  # fmt: skip
def test_the_corpus_files_read_as_the_reference_reads_them(data):
    assert compare_loaded(data) == []


@pytest.mark.parametrize("path", corpus.regressions("pciids"))
def test_a_kept_regression_reads_as_the_reference_reads_it(path):
    assert compare_loaded(ids_corpus.regression_bytes(corpus.load_json(path))) == []


def test_a_large_made_file_with_damage_reads_as_the_reference_reads_it(tmp_path):
    path = tmp_path / "big.ids"
    ids_corpus.write_huge(path, 6 << 20)  # a damaged device line every 1000 vendors
    new, ref = PciIds.load(path), ReferencePciIds.load(path)
    assert ref.damaged_lines > NOTED_DAMAGE
    assert mismatches(new, ref)[:10] == []


def test_a_file_that_says_it_holds_nothing_is_read_whole(tmp_path, monkeypatch):
    # As files under /proc do: read to the end, up to MAX_SIZE.
    path = tmp_path / "pci.ids"
    path.write_bytes(ids_corpus.SAMPLE)

    def fstat_size_0(fd):
        found = os.fstat(fd)
        return os.stat_result((*found[:6], 0, *found[7:10]))

    monkeypatch.setattr(pciids, "os", SimpleNamespace(stat=os.stat, fstat=fstat_size_0, dup=os.dup, pread=os.pread, close=os.close))
    assert mismatches(PciIds.load(path), ReferencePciIds.load(path)) == []
    monkeypatch.setattr(pciids, "MAX_SIZE", 100)
    assert "too large" in PciIds.load(path).problem
