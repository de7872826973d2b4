"""The PCI ID database (pci.ids): vendor, device, subsystem and class names by hex ID.

Loading never fails: a missing or damaged file gives an empty database whose `problem`
says that names fall back to hex IDs, and how to fix it. A damaged line is skipped and noted
with its line number (`damage`, `damage_report`); the rest of the file is still used.

The file is read whole once, at load, to check every line (damage is reported then) and to
index where each vendor's and class's lines begin; then only the index is kept, and a name
is read from its line in the file when it is first asked for (through the descriptor opened
at load: a package update that replaces the file leaves the one indexed readable). A dict of
every name took about 9 MiB of the agent's memory, and the file's bytes kept 1.5 MiB.
"""

from __future__ import annotations

import functools
import os
import re
import stat
import threading
import weakref
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator
from pathlib import Path

SEARCH_PATHS = ("/usr/share/hwdata/pci.ids", "/usr/share/misc/pci.ids", "/usr/share/pci.ids")

# Names are split from IDs on any run of blanks: the file uses two spaces, hand edits do not.
# These judge one line (read as text, its CRs at the end taken off): they are the format.
_VENDOR = re.compile(r"([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_DEVICE = re.compile(r"\t([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_SUBSYSTEM = re.compile(r"\t\t([0-9A-Fa-f]{4})[ \t]+([0-9A-Fa-f]{4})[ \t]+([^ \t].*)")
_CLASS = re.compile(r"C[ \t]+([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_SUBCLASS = re.compile(r"\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_PROG_IF = re.compile(r"\t\t([0-9A-Fa-f]{2})[ \t]+([^ \t].*)")
_EDITION = re.compile(r"#\s*Version:\s*(\S+)")

# The load-time check reads the bytes a whole block of lines at a time with these: each
# accepts only lines that the patterns above accept in that place (and comments and blank
# lines); any other line, damaged or merely unusual (a CR in it), is judged on its own by
# the patterns above. Each line ends in a newline here: the last line, without one, is
# always judged on its own.
_H4, _H2 = rb"[0-9A-Fa-f]{4}", rb"[0-9A-Fa-f]{2}"
_REST = rb"[ \t]++[^ \t\r\n][^\r\n]*+\n"  # blanks, a name, the line's end
_SKIP = rb"(?:#[^\n]*+|[ \t\r\x0b\x0c]*+)\n"  # a comment or a blank line
_DEV = rb"\t" + _H4 + _REST
_SUB = rb"\t\t" + _H4 + rb"[ \t]++" + _H4 + _REST
_SUBC = rb"\t" + _H2 + _REST
_PROG = rb"\t\t" + _H2 + _REST
# Below a vendor (class) with no device (subclass) yet: the group is the first device (subclass).
_V_FIRST = rb"(?:" + _SKIP + rb")*+(?:(" + _DEV + rb")(?:" + _SUB + b"|" + _DEV + b"|" + _SKIP + rb")*+)?+"
_C_FIRST = rb"(?:" + _SKIP + rb")*+(?:(" + _SUBC + rb")(?:" + _PROG + b"|" + _SUBC + b"|" + _SKIP + rb")*+)?+"
_V_MORE = re.compile(rb"(?:" + _SUB + b"|" + _DEV + b"|" + _SKIP + rb")*+")
_C_MORE = re.compile(rb"(?:" + _PROG + b"|" + _SUBC + b"|" + _SKIP + rb")*+")
_V_FIRST_RE, _C_FIRST_RE = re.compile(_V_FIRST), re.compile(_C_FIRST)
_SKIPS = re.compile(rb"(?:" + _SKIP + rb")*+")
# A vendor (groups 1, 2) or class (groups 3, 4) line with the lines below it.
_HEAD = re.compile(rb"(" + _H4 + rb")" + _REST + _V_FIRST + rb"|C[ \t]++(" + _H2 + rb")" + _REST + _C_FIRST)
_EDITION_HINT = re.compile(rb"^#[^\n]*?Version:", re.M)
_NON_ASCII = re.compile(rb"[\x80-\xff]")
_ID2 = re.compile("[0-9a-f]{2}")
_ID4 = re.compile("[0-9a-f]{4}")
_ID6 = re.compile("[0-9a-f]{6}")

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
# Names looked up lately, kept: the agent asks for the same few on every scan.
CACHED_LOOKUPS = 512
# Vendors (classes) whose device (subclass) lines were looked up lately: where those lines are,
# by ID, is kept (8 bytes a line: 15 KiB for NVIDIA's).
CACHED_VENDORS = 16
_OFFSET = (1 << 40) - 1  # a line's offset, below its ID, in one index entry
_LINE = 256  # bytes read for one line at first: the file's longest is about 150

_VENDOR_CONTEXT, _CLASS_CONTEXT = 1, 2


class _Tier:
    """The lines below a vendor (class) line: devices (subclasses), and below each of those its
    subsystems (programming interfaces). `head`, `child`, `grandchild`: the patterns that judge
    each kind of line; `child_start`: the start of every line that may be a child (group 1:
    its ID); `run_start`: of every line that may be a grandchild (groups: its IDs) or a child
    (the last group: its ID), to read the lines below a child up to the next."""

    def __init__(self, head: re.Pattern, child: re.Pattern, grandchild: re.Pattern, digits: int, ids: int) -> None:
        self.head, self.child, self.grandchild = head, child, grandchild
        hexes = rb"([0-9A-Fa-f]{%d})" % digits
        self.child_start = re.compile(rb"^\t" + hexes + rb"[ \t]", re.M)
        tail = rb"[ \t]+".join([hexes] * ids)
        self.run_start = re.compile(rb"^\t(?:\t" + tail + rb"[ \t]|" + hexes + rb"[ \t])", re.M)


_VENDORS = _Tier(_VENDOR, _DEVICE, _SUBSYSTEM, digits=4, ids=2)
_CLASSES = _Tier(_CLASS, _SUBCLASS, _PROG_IF, digits=2, ids=1)


class _File:
    """Ranges of the file an index was made from, read through the descriptor opened then."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        weakref.finalize(self, os.close, fd)

    def __call__(self, start: int, stop: int) -> bytes:
        try:
            return os.pread(self.fd, max(0, stop - start), start)
        except OSError:
            return b""  # unreadable now (a disk error): the name falls back to hex IDs


class _Index:
    """Where a pci.ids's vendors and classes begin: names are read from their lines there."""

    __slots__ = ("read", "size", "errors", "starts", "vendors", "classes", "children", "lock")

    def __init__(self, data: bytes = b"", errors: str = "replace", starts: array | None = None,
                 vendors: array | None = None, classes: array | None = None) -> None:  # fmt: skip
        # The bytes from `start` to `stop`: of `data` until `PciIds.load` points this at the file.
        self.read: Callable[[int, int], bytes] = lambda start, stop: data[start:stop]
        self.size = len(data)
        self.errors = errors  # how the bytes are read as text: as at load, line by line
        # Where each vendor's or class's lines begin, in file order, then the file's end.
        self.starts = starts if starts is not None else array("Q", [len(data)])
        # (ID << 32 | its block's number in `starts`), sorted: an ID's blocks in file order.
        self.vendors = vendors if vendors is not None else array("Q")
        self.classes = classes if classes is not None else array("Q")
        # (tier, ID) -> the lines below it that may be devices (subclasses): (device ID << 40 |
        # offset), sorted; the most recently used last.
        self.children: dict[tuple[_Tier, int], array] = {}
        self.lock = threading.Lock()  # discovery runs in threads

    def line(self, pos: int) -> str:
        """The line that begins at `pos`, as text, as the format reads it (CRs at its end off)."""
        chunk = self.read(pos, min(pos + _LINE, self.size))
        while b"\n" not in chunk and pos + len(chunk) < self.size:  # a long line
            more = self.read(pos + len(chunk), min(pos + 2 * len(chunk), self.size))
            if not more:
                break
            chunk += more
        return self._text(chunk, 0)

    def _text(self, block: bytes, offset: int) -> str:
        """The line that begins at `offset` of `block`, as `line` reads it."""
        end = block.find(b"\n", offset)
        return block[offset : end if end >= 0 else len(block)].decode("utf-8", self.errors).rstrip("\r")

    def blocks(self, tier: _Tier, ident: int) -> Iterator[tuple[int, int]]:
        """(where it begins, where it ends) of each vendor's (class's) block with this ID, in file order."""
        index = self.vendors if tier is _VENDORS else self.classes
        i = bisect_left(index, ident << 32)
        while i < len(index) and index[i] >> 32 == ident:
            block = index[i] & 0xFFFFFFFF
            yield self.starts[block], self.starts[block + 1]
            i += 1

    def head(self, tier: _Tier, ident: int) -> str | None:
        """The name on the first vendor (class) line with this ID."""
        for start, _ in self.blocks(tier, ident):
            if m := tier.head.fullmatch(self.line(start)):
                return _name(m.group(2))
        return None

    def _child_lines(self, tier: _Tier, ident: int) -> array:
        """Where the lines that may be children of `ident` are: (child ID << 40 | offset), sorted."""
        key = (tier, ident)
        with self.lock:
            found = self.children.pop(key, None)
            if found is None:
                lines = []
                for start, stop in self.blocks(tier, ident):
                    block = self.read(start, stop)
                    lines += [int(m.group(1), 16) << 40 | start + m.start() for m in tier.child_start.finditer(block)]
                lines.sort()
                found = array("Q", lines)
                if len(self.children) >= CACHED_VENDORS:
                    del self.children[next(iter(self.children))]
            self.children[key] = found
        return found

    def _children(self, tier: _Tier, ident: int, child: str) -> Iterator[tuple[re.Match, int]]:
        """Each good device (subclass) line with ID `child` below vendor (class) `ident`, in
        file order: (its match, where it begins)."""
        lines = self._child_lines(tier, ident)
        wanted = int(child, 16)
        i = bisect_left(lines, wanted << 40)
        while i < len(lines) and lines[i] >> 40 == wanted:
            pos = lines[i] & _OFFSET
            if found := tier.child.fullmatch(self.line(pos)):
                yield found, pos
            i += 1

    def child(self, tier: _Tier, ident: int, child: str) -> str | None:
        for found, _ in self._children(tier, ident, child):
            return _name(found.group(2))
        return None

    def grandchild(self, tier: _Tier, ident: int, child: str, tail: tuple[str, ...]) -> str | None:
        """The first subsystem (programming interface) line with IDs `tail` that belongs to a
        device (subclass) `child` of `ident`: one below that device's line, before the next
        good device line."""
        wanted = tuple(t.encode() for t in tail)
        for _, pos in self._children(tier, ident, child):
            # The rest of its vendor's (class's) block; the line at `pos` is the child's own,
            # which begins with a tab and a hex digit, so no pattern matches at its second byte.
            block = self.read(pos + 1, self.starts[bisect_right(self.starts, pos)])
            for m in tier.run_start.finditer(block):
                *ids, child_id = m.groups()
                if child_id is not None:
                    if tier.child.fullmatch(self._text(block, m.start())):
                        break
                elif tuple(i.lower() for i in ids) == wanted and (found := tier.grandchild.fullmatch(self._text(block, m.start()))):
                    return _name(found.group(len(tail) + 1))
        return None

    def find(self, kind: str, *keys: str) -> str | None:
        """A name by its lower-case IDs; kept in an LRU cache by `PciIds`."""
        if kind == "class":
            return self.class_name(keys[0])
        if not all(_ID4.fullmatch(key) for key in keys):
            return None
        vendor = int(keys[0], 16)
        if kind == "vendor":
            return self.head(_VENDORS, vendor)
        if kind == "device":
            return self.child(_VENDORS, vendor, keys[1])
        return self.grandchild(_VENDORS, vendor, keys[1], keys[2:])

    def class_name(self, code: str) -> str | None:
        base = self.head(_CLASSES, int(code[:2], 16)) if _ID2.fullmatch(code[:2]) else None
        sub = prog_if = None
        if len(code) >= 4 and _ID4.fullmatch(code[:4]):
            sub = self.child(_CLASSES, int(code[:2], 16), code[2:4])
        if len(code) >= 6 and _ID6.fullmatch(code[:6]):
            prog_if = self.grandchild(_CLASSES, int(code[:2], 16), code[2:4], (code[4:6],))
        if sub is None:
            return base
        return f"{sub} ({prog_if})" if prog_if else sub


class PciIds:
    """A pci.ids, read. IDs are looked up case-insensitively."""

    def __init__(self, path: Path | None = None, edition: str = "", problem: str = "") -> None:
        self.path = path
        self.edition = edition
        self.problem = problem
        self.damaged_lines = 0  # lines skipped
        # (line number, what is wrong with it), in line order: the first NOTED_DAMAGE of the
        # skipped lines, and the first line that is not UTF-8 (read with U+FFFD, not skipped).
        self.damage: list[tuple[int, str]] = []
        self._use(_Index(), 0)

    def _use(self, index: _Index, vendors: int) -> None:
        self._index = index
        self._vendors = index.vendors  # empty when the file has no vendor line
        self._vendor_count = vendors
        # The cache holds the index, not the database: no reference cycle.
        self._find = functools.lru_cache(maxsize=CACHED_LOOKUPS)(index.find)

    def __repr__(self) -> str:
        return f"PciIds(path={self.path!r}, edition={self.edition!r}, vendors={self._vendor_count})"

    @classmethod
    def load(cls, path: str | Path | None = None, host_root: str | Path | None = None) -> PciIds:
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
                size = os.fstat(f.fileno()).st_size
                data = _read(f, size) if size <= MAX_SIZE else None
                file = _File(os.dup(f.fileno()))
        except OSError as e:
            return cls(path=path, problem=f"cannot read pci.ids {path} ({e.strerror or e}); {_CONSEQUENCE}; {_FIX}")
        if data is None or len(data) > MAX_SIZE:
            return cls(
                path=path,
                problem=f"pci.ids {path} is over {MAX_SIZE >> 20} MiB, too large to be a PCI ID database "
                f"(the real one is under 2 MiB); {_CONSEQUENCE}; {_FIX}",
            )
        db = cls._parse(data, path, "replace")
        db._index.read = file  # and not the bytes read: the index holds where each name is
        bad = _first_not_utf8(data)
        if bad is not None:
            line = data.count(b"\n", 0, bad) + 1
            column = bad - (data.rfind(b"\n", 0, bad) + 1) + 1
            db.damage.append((line, f"is not UTF-8 (byte 0x{data[bad]:02x} at column {column}); its bad bytes read as U+FFFD"))
            db.damage.sort(key=lambda note: note[0])
        return db

    @classmethod
    def parse(cls, text: str, path: Path | None = None) -> PciIds:
        # Kept as UTF-8 (lone surrogates too), and read back line by line as it was.
        return cls._parse(text.encode("utf-8", "surrogatepass"), path, "surrogatepass")

    @classmethod
    def _parse(cls, data: bytes, path: Path | None, errors: str) -> PciIds:
        db = cls(path=path)
        starts = array("Q")
        vendor_keys: list[int] = []
        class_keys: list[int] = []
        # Where the lines are: below a vendor, below a class, or neither (the file's start);
        # `child`: a device (subclass) line has come since.
        context, child = 0, False
        damaged = 0
        newlines = counted = 0  # newlines before `counted`: for the numbers of damaged lines
        pos, n = 0, len(data)
        while pos < n:
            # Blocks of good lines at a time.
            if context == _VENDOR_CONTEXT:
                m = _V_MORE.match(data, pos) if child else _V_FIRST_RE.match(data, pos)
            elif context == _CLASS_CONTEXT:
                m = _C_MORE.match(data, pos) if child else _C_FIRST_RE.match(data, pos)
            else:
                m = _SKIPS.match(data, pos)
            if not child and m.lastindex:
                child = True
            pos = m.end()
            if pos >= n:
                break
            if m := _HEAD.match(data, pos):
                block = len(starts)
                starts.append(pos)
                if m.group(1) is not None:
                    context, child = _VENDOR_CONTEXT, m.group(2) is not None
                    vendor_keys.append(int(m.group(1), 16) << 32 | block)
                else:
                    context, child = _CLASS_CONTEXT, m.group(4) is not None
                    class_keys.append(int(m.group(3), 16) << 32 | block)
                pos = m.end()
                continue
            # One line on its own: unusual, or damaged.
            end = data.find(b"\n", pos)
            if end < 0:
                end = n
            line = data[pos:end].decode("utf-8", errors).rstrip("\r")
            start, pos = pos, end + 1
            if not line or line.isspace():
                continue
            first = line[0]
            if first == "#":
                continue
            # A damaged line is skipped and changes no context, so it hides nothing after it.
            # Of two entries for one ID the first wins, as in the NVIDIA plugin's lookup.
            wrong = ""
            if first != "\t":
                if first == "C" and (m := _CLASS.fullmatch(line)):
                    context, child = _CLASS_CONTEXT, False
                    class_keys.append(int(m.group(1), 16) << 32 | len(starts))
                    starts.append(start)
                elif m := _VENDOR.fullmatch(line):
                    context, child = _VENDOR_CONTEXT, False
                    vendor_keys.append(int(m.group(1), 16) << 32 | len(starts))
                    starts.append(start)
                elif first in " \v\f":
                    wrong = "is indented with spaces; the format indents with tabs"
                else:
                    wrong = "is neither a vendor line (4 hex digits, blanks, a name) nor a class line (C, 2 hex digits, a name)"
            elif line.startswith("\t\t\t"):
                wrong = "is indented three tabs deep; the format has two levels below a vendor or class"
            elif context == _CLASS_CONTEXT:
                if line[1:2] != "\t" and _SUBCLASS.fullmatch(line):
                    child = True
                elif child and _PROG_IF.fullmatch(line):
                    pass
                elif line[1:2] != "\t":
                    wrong = "is not a subclass line (a tab, 2 hex digits, blanks, a name)"
                elif child:
                    wrong = "is not a programming interface line (two tabs, 2 hex digits, blanks, a name)"
                else:
                    wrong = "is a programming interface line outside any subclass"
            elif line[1:2] != "\t":
                if context == _VENDOR_CONTEXT and _DEVICE.fullmatch(line):
                    child = True
                elif context == _VENDOR_CONTEXT:
                    wrong = "is not a device line (a tab, 4 hex digits, blanks, a name)"
                else:
                    wrong = "is a device line outside any vendor"
            elif context == _VENDOR_CONTEXT and child and _SUBSYSTEM.fullmatch(line):
                pass
            elif context == _VENDOR_CONTEXT and child:
                wrong = "is not a subsystem line (two tabs, 4 hex digits, a blank, 4 hex digits, blanks, a name)"
            else:
                wrong = "is a subsystem line outside any device"
            if wrong:
                damaged += 1
                if damaged <= NOTED_DAMAGE:
                    newlines += data.count(b"\n", counted, start)
                    counted = start
                    db.damage.append((newlines + 1, f"{_show(line)} {wrong}"))
        starts.append(n)
        db.damaged_lines = damaged
        db.edition = _edition(data, errors)
        vendor_keys.sort()
        class_keys.sort()
        vendors = array("Q", vendor_keys)
        db._use(_Index(data, errors, starts, vendors, array("Q", class_keys)), len({key >> 32 for key in vendor_keys}))
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
        return self._find("vendor", vendor_id.lower())

    def device_name(self, vendor_id: str, device_id: str) -> str | None:
        return self._find("device", vendor_id.lower(), device_id.lower())

    def subsystem_name(self, vendor_id: str, device_id: str, subvendor_id: str, subdevice_id: str) -> str | None:
        return self._find("subsystem", vendor_id.lower(), device_id.lower(), subvendor_id.lower(), subdevice_id.lower())

    def class_name(self, class_code: str) -> str | None:
        """The name lspci shows for a class code of 2, 4 or 6 hex digits.

        The subclass name ("3D controller"), with the programming interface in brackets
        when it has one ("Non-Volatile memory controller (NVM Express)"); the base class
        name when the subclass is unknown.
        """
        return self._find("class", class_code.lower())


def _read(f, size: int) -> bytes:
    """The file whole, or MAX_SIZE + 1 bytes of it when it grows past that (`size`: what it
    says it holds): never a buffer of MAX_SIZE, as `read(MAX_SIZE + 1)` allocates, for a small one."""
    data = f.read(size + 1)
    if len(data) <= size:
        return data
    # It grew, or says size 0 (a file under /proc).
    chunks, total = [data], len(data)
    while total <= MAX_SIZE and (chunk := f.read(min(1 << 20, MAX_SIZE + 1 - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _first_not_utf8(data: bytes) -> int | None:
    """Where the first byte that is not UTF-8 is, line by line (as decoding it whole would say)."""
    pos = 0
    while m := _NON_ASCII.search(data, pos):
        start = data.rfind(b"\n", 0, m.start()) + 1
        end = data.find(b"\n", m.start())
        if end < 0:
            end = len(data)
        try:
            data[start:end].decode("utf-8")
        except UnicodeDecodeError as e:
            return start + e.start
        pos = end
    return None


def _edition(data: bytes, errors: str) -> str:
    """The version on the first comment line that has one."""
    for m in _EDITION_HINT.finditer(data):
        end = data.find(b"\n", m.start())
        line = data[m.start() : end if end >= 0 else len(data)].decode("utf-8", errors).rstrip("\r")
        if found := _EDITION.match(line):
            return found.group(1)
    return ""


def _show(line: str) -> str:
    # A binary file's "line" can be megabytes long.
    return repr(line) if len(line) <= 60 else repr(line[:60]) + "..."


def _name(text: str) -> str:
    # Only blanks: anything else at the end of a name is left for the naming rule to judge.
    return text.rstrip(" \t")
