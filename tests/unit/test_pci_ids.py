"""The pci.ids parser: the real editions, the format's corners, and generated databases."""

from __future__ import annotations

import os
import re
import tracemalloc
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from passthrough.pci import pciids
from passthrough.pci.pciids import PciIds

DATA = Path(__file__).resolve().parents[2] / "e2e" / "data"
EDITION_2025 = DATA / "pci.ids.2025-07-11"
EDITION_2023 = DATA / "pci.ids.2023-04-10"


def test_the_2025_edition_loads_with_its_version_and_names():
    db = PciIds.load(EDITION_2025)
    assert db.problem == ""
    assert db.edition == "2025.07.11"
    assert db.path == EDITION_2025
    assert db.vendor_name("10de") == "NVIDIA Corporation"
    assert db.device_name("10de", "2236") == "GA102GL [A10]"
    assert db.damaged_lines == 0


def test_a_loaded_database_keeps_its_index_not_the_file_and_reads_names_from_the_file_it_indexed(tmp_path):
    path = tmp_path / "pci.ids"
    path.write_bytes(EDITION_2025.read_bytes())
    tracemalloc.start()
    try:
        db = PciIds.load(path)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < path.stat().st_size / 3, f"{kept} bytes kept for a {path.stat().st_size}-byte file"
    # A package update replaces the file (a new one renamed over it): names still come from
    # the file the index was made from, not from the new one at offsets that mean nothing there.
    replacement = tmp_path / "pci.ids.new"
    replacement.write_bytes(EDITION_2023.read_bytes())
    os.replace(replacement, path)
    assert db.device_name("10de", "2236") == "GA102GL [A10]"
    assert db.subsystem_name("10de", "2206", "10de", "146d") == "GA102 [GeForce RTX 3080 20GB]"
    assert db.class_name("030200") == "3D controller"


def test_the_2023_edition_names_cards_differently():
    db = PciIds.load(EDITION_2023)
    assert db.edition == "2023.04.10"
    assert db.device_name("10de", "2321") == "GH100"
    assert db.device_name("10de", "2335") is None


def test_ids_are_looked_up_case_insensitively():
    db = PciIds.parse("10DE  NVIDIA Corporation\n\t2236  GA102GL [A10]\n\t\t10De 1482  A10 card\n")
    assert db.vendor_name("10de") == db.vendor_name("10DE") == "NVIDIA Corporation"
    assert db.device_name("10De", "2236") == "GA102GL [A10]"
    assert db.subsystem_name("10de", "2236", "10DE", "1482") == "A10 card"


def test_class_lines_are_not_vendors():
    text = (
        "0c0a  A vendor whose ID looks like a class\n"
        "C 0c  Serial bus controller\n\t03  USB controller\n\t\t30  XHCI\n"
    )
    db = PciIds.parse(text)
    assert db.vendor_name("0c0a") == "A vendor whose ID looks like a class"
    assert db.device_name("0c0a", "0003") is None
    assert db.class_name("0c") == "Serial bus controller"
    assert db.class_name("0c03") == "USB controller"
    assert db.class_name("0c0330") == "USB controller (XHCI)"
    assert db.class_name("0c0300") == "USB controller"
    assert db.class_name("0cff00") == "Serial bus controller"
    assert db.class_name("ff") is None


def test_a_vendor_after_the_class_section_is_a_vendor_again():
    db = PciIds.parse("C 03  Display controller\n\t00  VGA compatible controller\n1002  AMD\n\t74a1  MI300X\n")
    assert db.device_name("1002", "74a1") == "MI300X"
    assert db.class_name("0300") == "VGA compatible controller"


def test_damaged_lines_are_skipped_and_counted():
    text = "10de  NVIDIA Corporation\n\t22zz  Bad ID\n\t2236  GA102GL [A10]\nnot a line\n\t2237  GA102GL [A10G]\n"
    db = PciIds.parse(text)
    assert db.damaged_lines == 2
    assert db.device_name("10de", "2236") == "GA102GL [A10]"
    # A damaged line changes no context: the next device still belongs to NVIDIA.
    assert db.device_name("10de", "2237") == "GA102GL [A10G]"
    assert db.problem == ""


def test_of_two_entries_for_one_id_the_first_wins():
    db = PciIds.parse("10de  NVIDIA\n\t2236  First\n\t2236  Second\n")
    assert db.device_name("10de", "2236") == "First"


def test_a_missing_file_gives_an_empty_database_that_says_what_to_do(tmp_path):
    db = PciIds.load(tmp_path / "nope")
    assert db.vendor_name("10de") is None
    assert "nope" in db.problem and "hex" in db.problem and "--pci-ids" in db.problem


def test_no_file_on_the_search_path_is_a_problem_naming_the_places_looked(tmp_path, monkeypatch):
    monkeypatch.setattr(pciids, "SEARCH_PATHS", (str(tmp_path / "a.ids"), str(tmp_path / "b.ids")))
    db = PciIds.load()
    assert db.path is None
    assert "a.ids" in db.problem and "b.ids" in db.problem


def test_the_first_existing_file_on_the_search_path_is_used(tmp_path, monkeypatch):
    second = tmp_path / "second.ids"
    second.write_text("10de  NVIDIA Corporation\n")
    monkeypatch.setattr(pciids, "SEARCH_PATHS", (str(tmp_path / "first.ids"), str(second)))
    db = PciIds.load()
    assert db.path == second and db.problem == ""


def test_a_directory_or_binary_garbage_never_raises(tmp_path):
    garbage = tmp_path / "garbage.ids"
    garbage.write_bytes(bytes(range(256)) * 64)
    for path in (tmp_path, garbage):
        db = PciIds.load(path)
        assert db.problem and db.vendor_name("10de") is None


def test_a_file_with_no_vendor_is_damaged():
    db = PciIds.parse("# just comments\n\n\t2236  orphan device\n")
    assert "damaged" in db.problem


# --- Generated databases ----------------------------------------------------------------

HEX = "0123456789abcdef"
hex4 = st.text(HEX, min_size=4, max_size=4)
hex2 = st.text(HEX, min_size=2, max_size=2)
# A name: anything on one line that does not start or end with a blank.
one_line = st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",))
names = st.text(one_line, min_size=1, max_size=30).filter(lambda s: s == s.strip(" \t") and not s.isspace())
cased = st.sampled_from([str.lower, str.upper])

subsystems = st.dictionaries(st.tuples(hex4, hex4), names, max_size=3)
devices = st.dictionaries(hex4, st.tuples(names, subsystems), max_size=4)
vendors = st.dictionaries(hex4, st.tuples(names, devices), min_size=1, max_size=5)
subclasses = st.dictionaries(hex2, st.tuples(names, st.dictionaries(hex2, names, max_size=2)), max_size=3)
classes = st.dictionaries(hex2, st.tuples(names, subclasses), max_size=3)


def render(vendors, classes, case) -> list[str]:
    lines = ["#", "#\tList of PCI ID's", "#\tVersion: 2031.01.02", ""]
    for vid, (vname, devs) in vendors.items():
        lines.append(f"{case(vid)}  {vname}")
        for did, (dname, subs) in devs.items():
            lines.append(f"\t{case(did)}  {dname}")
            lines += [f"\t\t{case(sv)} {case(sd)}  {sname}" for (sv, sd), sname in subs.items()]
        lines.append("")
    lines.append("# List of known device classes, subclasses and programming interfaces")
    for cid, (cname, subs) in classes.items():
        lines.append(f"C {case(cid)}  {cname}")
        for sid, (sname, progs) in subs.items():
            lines.append(f"\t{case(sid)}  {sname}")
            lines += [f"\t\t{case(pid)}  {pname}" for pid, pname in progs.items()]
    return lines


def assert_all_found(db, vendors, classes):
    for vid, (vname, devs) in vendors.items():
        assert db.vendor_name(vid.upper()) == vname
        for did, (dname, subs) in devs.items():
            assert db.device_name(vid, did.upper()) == dname
            for (sv, sd), sname in subs.items():
                assert db.subsystem_name(vid, did, sv.upper(), sd) == sname
    for cid, (cname, subs) in classes.items():
        assert db.class_name(cid) == cname
        for sid, (sname, progs) in subs.items():
            assert db.class_name(cid + sid) == sname
            for pid, pname in progs.items():
                assert db.class_name(cid + sid + pid) == f"{sname} ({pname})"


@settings(max_examples=200)
@given(vendors, classes, cased)
def test_every_entry_of_a_generated_database_is_found(vendors, classes, case):
    db = PciIds.parse("\n".join(render(vendors, classes, case)) + "\n")
    assert db.problem == "" and db.damaged_lines == 0 and db.edition == "2031.01.02"
    assert_all_found(db, vendors, classes)


# The format's entry lines (from the file's own header); a garbage line is anything else.
ID4, ID2 = "[0-9A-Fa-f]{4}", "[0-9A-Fa-f]{2}"
ENTRY = re.compile(rf"(\t{{0,2}}{ID4}|\t\t{ID4}[ \t]+{ID4}|C[ \t]+{ID2}|\t{{1,2}}{ID2})[ \t]+[^ \t].*")
garbage = st.one_of(
    st.text(st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)), max_size=40),
    st.sampled_from(["\t22zz  Bad ID", "10de", "\t\t10de  half a subsystem", "zzzz  Vendor", "C 3  Bad", "\t\t\tdeep"]),
).filter(lambda line: not ENTRY.fullmatch(line.rstrip("\r")))


@settings(max_examples=200)
@given(vendors, classes, st.lists(st.tuples(st.integers(min_value=0), garbage), max_size=10))
def test_garbage_lines_never_raise_and_never_hide_valid_entries(vendors, classes, insertions):
    lines = render(vendors, classes, str.lower)
    for position, line in insertions:
        lines.insert(position % (len(lines) + 1), line)
    db = PciIds.parse("\n".join(lines))
    assert_all_found(db, vendors, classes)


def test_the_nodes_pci_ids_under_the_host_root_comes_before_the_images(tmp_path):
    node = tmp_path / "host" / "usr" / "share" / "misc"
    node.mkdir(parents=True)
    (node / "pci.ids").write_text("10de  NVIDIA Corporation\n\t2236  GA102GL [A10]\n")
    db = PciIds.load(host_root=tmp_path / "host")
    assert db.path == node / "pci.ids" and db.device_name("10de", "2236") == "GA102GL [A10]"
    # A node without one: the image's own database (or a clear problem when there is none either).
    fallback = PciIds.load(host_root=tmp_path / "empty")
    assert fallback.path != node / "pci.ids"
    assert fallback.path is not None or str(tmp_path / "empty") in (fallback.problem or "")
