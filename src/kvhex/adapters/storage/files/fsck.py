"""Read-only verification of a local file tier's root (what ``kvhex fsck`` runs).

For each namespace directory under the root (see :mod:`kvhex.adapters.storage.files.slabs` for the
layout) it checks that ``config.json`` is readable, names this layout version and hashes to
the directory's name; that every slab file starts with a slot table and holds all its slots;
that every record of the tables names a slot whose header names the record's key and whose
payload matches the header's checksum; and it reports slots that hold a whole-looking block
without a record (orphans: a crash between a block's write and its record leaves them;
harmless, the slot is reused), intact blocks whose chunk record (kept in the header, beside
the key) fails its CRC-32 or does not parse (harmless: the block is announced as a
placeholder, and served), slabs a crash left half-created, and files the tier does not know
(foreign, ignored by the tier).

Findings per record:

* ``CORRUPT``: the block is where the record says, but its bytes are wrong (bad magic, a
  payload length that is not the slot's, a checksum that does not match the payload).
* ``MISSING``: the record names a block that is not there: the slot is past the end of a
  truncated slab, or it was unmarked or reused for another key (a removal whose record a
  power loss kept). The tier itself treats these as misses and drops them.

Nothing is modified and no lock is taken: slabs are opened read-only (never ``flock``ed, so
live instances are not disturbed). A live instance may change the tier while it is checked;
run it on a quiet tier for an exact answer. The report is a plain value: :func:`check_root`
is usable from Python.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvhex.adapters.storage.files._index import (
    KNOWN_ENTRIES,
    SLAB_DIR,
    TableError,
    is_slab_id,
    read_table,
    table_bytes,
)
from kvhex.adapters.storage.format import (
    CONFIG,
    HEADER_AREA,
    LAYOUT_VERSION,
    MAGIC,
    KeptRecord,
    header_matches,
    kept_record,
    namespace_digest,
    parse_header,
)
from kvhex.adapters.storage.records import decode_record
from kvhex.domain.keys import OffloadKey

_HEX = frozenset("0123456789abcdef")


class Finding(enum.Enum):
    """What is wrong with a block a slot table names."""

    CORRUPT = "corrupt"
    MISSING = "missing"


@attrs.frozen
class BlockFinding:
    """One record whose block is not intact: its key (hex), where it points, why."""

    key: str
    finding: Finding
    reason: str
    slab: str
    slot: int


@attrs.frozen
class Orphan:
    """A slot holding a whole-looking block that no record names (harmless)."""

    key: str
    slab: str
    slot: int


@attrs.frozen
class BadRecord:
    """An intact block whose chunk record is damaged (harmless: announced as a placeholder)."""

    key: str
    slab: str
    slot: int


@attrs.frozen
class NamespaceReport:
    """The verdict on one namespace directory.

    ``problems`` are namespace-wide (configuration, slab tables and sizes); ``findings`` name
    single blocks. ``block_bytes`` counts the payload of intact blocks, ``slab_bytes`` the
    size of the slab files. ``bad_records`` and ``orphans`` are harmless.
    """

    name: str
    path: str
    config: Mapping[str, Any] | None
    problems: tuple[str, ...]
    blocks_ok: int
    blocks_corrupt: int
    blocks_missing: int
    findings: tuple[BlockFinding, ...]
    orphans: tuple[Orphan, ...]
    unfinished_slabs: tuple[str, ...]
    foreign: tuple[str, ...]
    slabs: int
    slab_bytes: int
    block_bytes: int
    bad_records: tuple[BadRecord, ...] = ()

    @property
    def clean(self) -> bool:
        """No namespace problem and no corrupt or missing block."""
        return not self.problems and not self.findings


@attrs.frozen
class FsckReport:
    """The verdict on a root: each namespace, and foreign entries beside them."""

    root: str
    namespaces: tuple[NamespaceReport, ...]
    foreign: tuple[str, ...]

    @property
    def clean(self) -> bool:
        """Every namespace is clean (foreign files and orphans do not count)."""
        return all(ns.clean for ns in self.namespaces)

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready builtins (``clean`` included)."""
        out: dict[str, Any] = attrs.asdict(self, value_serializer=_plain)
        out["clean"] = self.clean
        for ns, data in zip(self.namespaces, out["namespaces"], strict=True):
            data["clean"] = ns.clean
        return out


def _plain(_: Any, __: Any, value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return dict(value)
    return value


def check_root(root: str | os.PathLike[str]) -> FsckReport:
    """Check every namespace under ``root`` (or ``root`` itself when it is a namespace).

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a directory.
    """
    base = Path(root)
    if not base.exists():
        raise FileNotFoundError(2, "no such directory", str(base))
    if not base.is_dir():
        raise NotADirectoryError(20, "not a directory", str(base))
    if (base / CONFIG).exists():
        return FsckReport(str(base), (check_namespace(base),), ())
    namespaces = []
    foreign = []
    for entry in sorted(base.iterdir()):
        if entry.is_dir() and not entry.is_symlink() and _looks_like_namespace(entry):
            namespaces.append(check_namespace(entry))
        else:
            foreign.append(entry.name + ("/" if entry.is_dir() else ""))
    return FsckReport(str(base), tuple(namespaces), tuple(foreign))


def _looks_like_namespace(path: Path) -> bool:
    if len(path.name) == 16 and set(path.name) <= _HEX:
        return True
    return any((path / name).exists() for name in (CONFIG, SLAB_DIR))


def check_namespace(path: str | os.PathLike[str]) -> NamespaceReport:
    """Check one namespace directory (never raises for what it finds inside)."""
    return _Checker(Path(path)).run()


@attrs.define
class _Checker:
    """Collects one namespace's verdict."""

    path: Path
    problems: list[str] = attrs.Factory(list)
    findings: list[BlockFinding] = attrs.Factory(list)
    orphans: list[Orphan] = attrs.Factory(list)
    bad_records: list[BadRecord] = attrs.Factory(list)
    unfinished: list[str] = attrs.Factory(list)
    foreign: list[str] = attrs.Factory(list)
    ok: int = 0
    slab_count: int = 0
    slab_bytes: int = 0
    coded: bool = False
    """The namespace's blocks are coded frames (its config names a codec chain): a block's
    payload may be shorter than its slot; its checksum is checked, its decoding is not (that
    takes the codecs and their keys)."""
    sealed: bool = False
    """The blocks' records are sealed by a keyed codec: their integrity (CRC-32) is checked,
    what they hold is not."""

    def run(self) -> NamespaceReport:
        config = self._config()
        slot_bytes = self._slot_bytes(config)
        self._foreign_entries()
        slabs = self._slab_files()
        if slot_bytes is not None:
            for name, path in slabs.items():
                self._slab(name, path, slot_bytes)
        corrupt = sum(f.finding is Finding.CORRUPT for f in self.findings)
        return NamespaceReport(
            name=self.path.name,
            path=str(self.path),
            config=config,
            problems=tuple(self.problems),
            blocks_ok=self.ok,
            blocks_corrupt=corrupt,
            blocks_missing=len(self.findings) - corrupt,
            findings=tuple(self.findings),
            orphans=tuple(self.orphans),
            unfinished_slabs=tuple(self.unfinished),
            foreign=tuple(self.foreign),
            slabs=self.slab_count,
            slab_bytes=self.slab_bytes,
            block_bytes=self.ok * (slot_bytes or 0),
            bad_records=tuple(self.bad_records),
        )

    # -- namespace-wide ------------------------------------------------------------------
    def _config(self) -> dict[str, Any] | None:
        try:
            config = json.loads((self.path / CONFIG).read_bytes())
        except FileNotFoundError:
            self.problems.append(f"{CONFIG} missing")
            return None
        except (OSError, ValueError) as exc:
            self.problems.append(f"{CONFIG} unreadable: {exc}")
            return None
        if not isinstance(config, dict):
            self.problems.append(f"{CONFIG} is not a JSON object")
            return None
        namespace = {k: v for k, v in config.items() if k != "layout_version"}
        digest = namespace_digest(namespace)
        if config.get("layout_version") == LAYOUT_VERSION and digest != self.path.name:
            self.problems.append(
                f"{CONFIG} describes namespace {digest}, not this directory's name"
            )
        return config

    def _slot_bytes(self, config: Mapping[str, Any] | None) -> int | None:
        if config is None:
            return None
        layout = config.get("layout_version")
        if layout != LAYOUT_VERSION:
            self.problems.append(
                f"layout version {layout!r}; this kvhex checks version {LAYOUT_VERSION}"
            )
            return None
        field = "stored_bytes" if "codec" in config else "slot_bytes"
        slot_bytes = config.get(field)
        if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool) or slot_bytes <= 0:
            self.problems.append(f"{CONFIG} records no valid {field} ({slot_bytes!r})")
            return None
        self.coded = field == "stored_bytes"
        chain = config.get("codec")
        self.sealed = isinstance(chain, list) and any(
            isinstance(c, dict) and c.get("records") == "sealed" for c in chain
        )
        return slot_bytes

    def _foreign_entries(self) -> None:
        for entry in sorted(os.listdir(self.path)):
            if entry not in KNOWN_ENTRIES:
                self.foreign.append(entry)

    def _slab_files(self) -> dict[str, Path]:
        slab_dir = self.path / SLAB_DIR
        slabs: dict[str, Path] = {}
        try:
            entries = sorted(os.listdir(slab_dir))
        except FileNotFoundError:
            return slabs
        for entry in entries:
            stem, _, ext = entry.partition(".")
            full = slab_dir / entry
            if is_slab_id(stem) and ext == "slab" and full.is_file():
                slabs[stem] = full
            elif is_slab_id(stem) and ext == "new" and full.is_file():
                self.unfinished.append(entry)
            else:
                self.foreign.append(f"{SLAB_DIR}/{entry}")
        return slabs

    # -- blocks --------------------------------------------------------------------------
    def _slab(self, name: str, path: Path, slot_bytes: int) -> None:
        slot_size = HEADER_AREA + slot_bytes
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            self.problems.append(f"slab {name} unreadable: {exc.strerror or exc}")
            return
        try:
            self.slab_count += 1
            size = os.fstat(fd).st_size
            self.slab_bytes += size
            try:
                slots, records = read_table(fd)
            except (OSError, TableError) as exc:
                self.problems.append(f"slab {name}: {exc}")
                return
            base = table_bytes(slots)
            count = max(0, (size - base) // slot_size)
            if size != base + slots * slot_size:
                self.problems.append(
                    f"slab {name}: {size} bytes, not its table and {slots} slots of "
                    f"{slot_size} bytes"
                )
            named = {}
            for slot, key, _ in records:
                named[slot] = key
                if slot >= count:
                    reason = f"slot {slot} is past the end of the slab ({count} slots)"
                    self._found(key, Finding.MISSING, reason, name, slot)
            for slot in range(min(count, slots)):
                offset = base + slot * slot_size
                if slot in named:
                    data = os.pread(fd, slot_size, offset)
                    self._verify(named[slot], data, slot_bytes, name, slot)
                else:
                    self._orphan(os.pread(fd, 512, offset), slot_bytes, name, slot)
        finally:
            os.close(fd)

    def _verify(self, key: bytes, data: bytes, slot_bytes: int, slab: str, slot: int) -> None:
        header = data[:HEADER_AREA]
        payload = memoryview(data)[HEADER_AREA:]
        if self.coded:  # a frame, up to the slot's length
            parsed = parse_header(header)
            if parsed is not None and 0 < parsed.length <= len(payload) == slot_bytes:
                payload = payload[: parsed.length]
                slot_bytes = parsed.length
        if len(payload) == slot_bytes and header_matches(header, OffloadKey(key), payload):
            self.ok += 1
            state, record = kept_record(header)
            if state is KeptRecord.DAMAGED or (
                state is KeptRecord.INTACT
                and not self.sealed
                and decode_record(record, OffloadKey(key)) is None
            ):
                self.bad_records.append(BadRecord(key.hex(), slab, slot))
            return
        finding, reason = _diagnose(header, key, slot_bytes, len(payload))
        self._found(key, finding, reason, slab, slot)

    def _orphan(self, data: bytes, slot_bytes: int, slab: str, slot: int) -> None:
        header = parse_header(data)
        if (
            header is not None
            and header.magic == MAGIC
            and (header.length == slot_bytes or (self.coded and 0 < header.length < slot_bytes))
            and len(header.key) > 4
        ):
            self.orphans.append(Orphan(header.key.hex(), slab, slot))

    def _found(self, key: bytes, finding: Finding, reason: str, slab: str, slot: int) -> None:
        self.findings.append(BlockFinding(key.hex(), finding, reason, slab, slot))


def _diagnose(header: bytes, key: bytes, slot_bytes: int, got: int) -> tuple[Finding, str]:
    """Why a block failed :func:`header_matches`."""
    parsed = parse_header(header)
    if parsed is None:
        return Finding.MISSING, "the slot is cut short (slab truncated)"
    magic, length, _, held = parsed
    if magic == bytes(len(MAGIC)):
        return Finding.MISSING, "the slot is unmarked (block removed; stale record)"
    if magic == MAGIC and held != key:
        return Finding.MISSING, f"the slot holds another block ({held.hex()}; stale record)"
    if magic != MAGIC:
        reason = "bad magic in the block header"
    elif length != slot_bytes:
        reason = f"header records {length} payload bytes, slots hold {slot_bytes}"
    elif got != slot_bytes:
        reason = f"payload cut short ({got} of {slot_bytes} bytes)"
    else:
        reason = "payload checksum mismatch"
    return Finding.CORRUPT, reason
