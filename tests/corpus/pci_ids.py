"""Broken pci.ids files: cut short at every kind of line, binary, not UTF-8, badly indented, huge.

The generators return bytes (what `PciIds.load` reads) with what a correct parser must still
find in them, so a property can say both "never raises" and "loses nothing it could read".
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

from hypothesis import strategies as st

# One entry of every kind, each on its own line; the line numbers are those of the file.
SAMPLE_LINES = [
    "#",  # 1
    "#\tList of PCI ID's",  # 2
    "#\tVersion: 2031.01.02",  # 3
    "",  # 4
    "10de  NVIDIA Corporation",  # 5   vendor
    "\t2236  GA102GL [A10]",  # 6   device
    "\t\t10de 1482  A10 card",  # 7   subsystem
    "\t1aef  GA102 High Definition Audio Controller",  # 8
    "1af4  Red Hat, Inc.",  # 9
    "\t1041  Virtio 1.0 network device",  # 10
    "",  # 11
    "C 03  Display controller",  # 12  class
    "\t02  3D controller",  # 13  subclass
    "\t\t00  Normal decoding",  # 14  programming interface
    "C 01  Mass storage controller",  # 15
    "\t08  Non-Volatile memory controller",  # 16
    "\t\t02  NVM Express",  # 17
]
SAMPLE = ("\n".join(SAMPLE_LINES) + "\n").encode()
# What each complete line adds: (line number, lookup, expected).
ENTRIES = [
    (5, ("vendor_name", "10de"), "NVIDIA Corporation"),
    (6, ("device_name", "10de", "2236"), "GA102GL [A10]"),
    (7, ("subsystem_name", "10de", "2236", "10de", "1482"), "A10 card"),
    (8, ("device_name", "10de", "1aef"), "GA102 High Definition Audio Controller"),
    (9, ("vendor_name", "1af4"), "Red Hat, Inc."),
    (10, ("device_name", "1af4", "1041"), "Virtio 1.0 network device"),
    (12, ("class_name", "03"), "Display controller"),
    (13, ("class_name", "0302"), "3D controller"),
    (14, ("class_name", "030200"), "3D controller (Normal decoding)"),
    (15, ("class_name", "01"), "Mass storage controller"),
    (16, ("class_name", "0108"), "Non-Volatile memory controller"),
    (17, ("class_name", "010802"), "Non-Volatile memory controller (NVM Express)"),
]

# Lines the format does not allow, each in the place where it is wrong.
DAMAGED_LINES = [
    "\t22zz  Bad ID",  # not hex
    "10de",  # no name
    "10d  short",  # 3 digits
    "\t\t10de  half a subsystem",
    "zzzz  Vendor",
    "C 3  Bad class",
    "\t\t\tthree tabs deep",
    "  2236  spaces, not a tab",
    "    \t2236  spaces then a tab",
    "\t 2236  a tab then a space",
    "\t2236",
    "\t\t10de 1482",
    "\t\t10de:1482  a colon",
    "C",
    "C 03",
    "\x00\x01\x02",
    "\ufeff10de  BOM in the middle",
]


def cut_short() -> st.SearchStrategy[tuple[bytes, int]]:
    """SAMPLE cut at any byte: (the bytes, the offset)."""
    return st.integers(0, len(SAMPLE)).map(lambda n: (SAMPLE[:n], n))


def complete_entries(cut: int) -> list[tuple[tuple, str]]:
    """The entries whose line (with its newline) lies wholly before `cut`."""
    ends = []
    offset = 0
    for line in SAMPLE_LINES:
        offset += len(line.encode()) + 1
        ends.append(offset)
    return [(lookup, value) for number, lookup, value in ENTRIES if ends[number - 1] <= cut]


def with_damaged_line() -> st.SearchStrategy[tuple[bytes, int, str]]:
    """SAMPLE with one damaged line put in after any line: (bytes, its line number, the line)."""
    garbage = st.one_of(
        st.sampled_from(DAMAGED_LINES),
        st.sampled_from(["\t", "\t\t", "  ", "C ", ""]).flatmap(
            lambda lead: st.text(st.characters(blacklist_characters="\n\r", blacklist_categories=("Cs",)),
                                 min_size=1, max_size=20).map(lambda t: lead + t)  # fmt: skip
        ),
    ).filter(_is_damaged)
    return st.tuples(st.integers(0, len(SAMPLE_LINES)), garbage).map(_insert)


def _insert(position_line: tuple[int, str]) -> tuple[bytes, int, str]:
    position, line = position_line
    lines = [*SAMPLE_LINES[:position], line, *SAMPLE_LINES[position:]]
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape"), position + 1, line


def _is_damaged(line: str) -> bool:
    """What the format's header calls an entry line, in any context; anything else is damaged."""
    stripped = line.rstrip("\r")
    if not stripped.strip() or stripped.startswith("#"):
        return False
    entry = re.compile(
        r"(\t{0,2}[0-9A-Fa-f]{4}|\t\t[0-9A-Fa-f]{4}[ \t]+[0-9A-Fa-f]{4}|C[ \t]+[0-9A-Fa-f]{2}|\t{1,2}[0-9A-Fa-f]{2})[ \t]+[^ \t].*"
    )
    return not entry.fullmatch(stripped)


def binary() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=2000),
        st.binary(min_size=1, max_size=200).map(lambda b: SAMPLE[: len(SAMPLE) // 2] + b + SAMPLE[len(SAMPLE) // 2 :]),
        st.just(bytes(range(256)) * 8),
        st.just(b"\x00" * 4096),
        st.just(b"\xef\xbb\xbf" + SAMPLE),  # a byte-order mark
        st.just(SAMPLE.replace(b"\n", b"\r\n")),
        st.just(SAMPLE.replace(b"\n", b"\r")),  # old Mac line ends: one long line
        st.just(b"\x1f\x8b\x08\x00" + bytes(64)),  # a gzip header (pci.ids.gz given as pci.ids)
    )


def invalid_utf8() -> st.SearchStrategy[tuple[bytes, int]]:
    """SAMPLE with bytes that are not UTF-8 in one line's name: (bytes, that line's number)."""
    bad = st.sampled_from([b"\xff", b"\xc3", b"\xe2\x82", b"\xed\xa0\x80", b"\xc0\xaf", b"\x80\x80", b"\xf8\x88\x80\x80\x80"])
    named = [n for n, _, _ in ENTRIES]
    return st.tuples(st.sampled_from(named), bad).map(_with_bad_bytes)


def _with_bad_bytes(number_bad: tuple[int, bytes]) -> tuple[bytes, int]:
    number, bad = number_bad
    lines = [line.encode() for line in SAMPLE_LINES]
    lines[number - 1] += b" " + bad + b"x"
    return b"\n".join(lines) + b"\n", number


def as_regression(data: bytes, why: str, **expected: object) -> dict:
    """A regression file's body: text when the bytes are UTF-8, base64 when not."""
    try:
        body: dict = {"text": data.decode("utf-8")}
    except UnicodeDecodeError:
        body = {"b64": base64.b64encode(data).decode()}
    return {"why": why, **body, **expected}


def regression_bytes(entry: dict) -> bytes:
    return base64.b64decode(entry["b64"]) if "b64" in entry else entry["text"].encode("utf-8", "surrogateescape")


def huge_lines(vendors: int) -> Iterator[bytes]:
    """A well-formed database of `vendors` vendors with 8 devices each (about 300 bytes per vendor),
    made on the fly; every 1000th vendor has a damaged device line."""
    yield b"# Version: 2099.01.01\n"
    for v in range(vendors):
        chunk = [f"{v % 65536:04x}  Vendor number {v}\n"]
        chunk += [f"\t{d:04x}  Device {d} of vendor {v}\n" for d in range(8)]
        if v % 1000 == 999:
            chunk.append("\tzzzz  damaged\n")
        yield "".join(chunk).encode()


def write_huge(path: Path, size: int) -> int:
    """Write a database of at least `size` bytes to `path`; returns the number of vendors in it."""
    written = vendors = 0
    with open(path, "wb") as f:
        for chunk in huge_lines(10**9):
            f.write(chunk)
            written += len(chunk)
            vendors += 1
            if written >= size:
                break
    return vendors - 1  # the first chunk is the header
