"""The record a block keeps in its header area: its chunk described in full
(:class:`~kvhex.domain.locator.ChunkRecord`), so that a restart, or another instance on the
same storage, announces the block as a full ``BlockStored`` instead of a placeholder.

A put whose job has a request computes each block's record on the scheduler thread
(:func:`~kvhex.domain.locator.record_of`: the request's tokens are live there) and the IO
thread encodes it (:func:`encode_record`) into the header area, after the key, with its own
length and CRC-32 (:func:`~kvhex.adapters.storage.format.pack_header`). Anything the encoding
cannot hold exactly (a value that is not ``None``, an ``int`` of 64 bits, ``str``, ``bytes``
or a tuple of them; a record longer than the header area keeps) gives no record: the block is
then announced as a placeholder, never with a payload that could be wrong.

Encoding (version 1; integers big-endian)::

    version u8 | flags u8 | group_idx u32 | block_size u32 | blocks u16 | hash length u8
    | token width u8 | [parent hash] | block hashes | token ids | [lora_id i64]
    | [lora_name: u16 length, UTF-8] | [kv_cache_spec_kind: u8 length, UTF-8]
    | [kv_cache_spec_sliding_window i64] | [extra keys]

``flags`` say which optional fields follow. The ``blocks * block_size`` token ids are stored
in ``width`` bytes each (1 to 4: the fewest that hold the largest id) as byte planes (every
id's lowest byte, then every id's next byte, ...), which C-speed slices of their 32-bit
little-endian words build and take apart. Extra keys are either one value for every block or
one per block, each a tagged value: ``0`` ``None``, ``1`` ``int`` (i64), ``2`` ``str`` (u16
length, UTF-8), ``3`` ``bytes`` (u16 length), ``4`` tuple (u16 count, then its values; at
most :data:`MAX_DEPTH` deep).

:func:`decode_record` gives the record back only when every byte parses and it describes the
key it is read under (its last block hash and its group are the key's).
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from kvhex.adapters.storage.format import KeptRecord, kept_record, record_room
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.locator import ChunkRecord, describe, spans
from kvhex.domain.request import ReqContext
from kvhex.ports.codec import RecordSealing

VERSION = 1
MAX_DEPTH = 8
"""Deepest nesting of tuples in an extra key (vLLM's: a tuple of pairs, 2)."""

_HEAD = struct.Struct(">BBIIHBB")
_I64 = struct.Struct(">q")
_U16 = struct.Struct(">H")
_TAGGED_LEN = struct.Struct(">BH")
_PARENT, _LORA_ID, _LORA_NAME, _KIND, _WINDOW, _EXTRA_EACH, _EXTRA_SAME = (1 << i for i in range(7))
_KNOWN_FLAGS = (1 << 7) - 1
_NONE, _INT, _STR, _BYTES, _TUPLE = range(5)
_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder == "big"  # planes are taken from little-endian words
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1


class _Unfit(Exception):
    """A record the encoding cannot hold exactly."""


class _Bad(Exception):
    """Bytes that are not a record of the key they were read under."""


def chunk_records(
    ctx: ReqContext | None, keys: Sequence[OffloadKey]
) -> dict[OffloadKey, ChunkRecord] | None:
    """The record of each of ``keys`` ``ctx``'s request can describe (scheduler thread: the
    request's tokens are live there), or ``None`` without a request."""
    prov = ctx.provenance if ctx is not None else None
    if prov is None:
        return None
    return {
        key: describe(prov, *span)
        for key, span in zip(keys, spans(ctx, keys), strict=True)
        if span is not None
    }


def encode_records(
    records: dict[OffloadKey, ChunkRecord] | None,
) -> dict[OffloadKey, bytes] | None:
    """:func:`encode_record` of each of ``records`` (an IO thread), those that fit."""
    if not records:
        return None
    out = {}
    for key, record in records.items():
        data = encode_record(record, key)
        if data is not None:
            out[key] = data
    return out


def sealed_records(
    encoded: dict[OffloadKey, bytes], sealer: RecordSealing
) -> dict[OffloadKey, bytes]:
    """``encoded`` records sealed by a keyed codec (an IO thread), those that still fit a
    header area (a record too long once sealed is not kept: a placeholder later)."""
    out = {}
    for key, data in encoded.items():
        sealed = sealer.seal_record(data, key)
        if len(sealed) <= record_room(len(key)):
            out[key] = sealed
    return out


def encode_record(record: ChunkRecord, key: OffloadKey) -> bytes | None:
    """``record``'s bytes for the header of ``key``'s block, or ``None`` when the encoding
    cannot hold it exactly or it does not fit the header area."""
    try:
        data = _encode(record)
    except (_Unfit, OverflowError, TypeError, ValueError, UnicodeError, struct.error):
        return None
    return data if len(data) <= record_room(len(key)) else None


def _encode(record: ChunkRecord) -> bytes:
    (hashes, parent, tokens, block_size, extra, group_idx, kind, window, lora_id, lora_name) = (
        record
    )
    blocks = len(hashes)
    if not 0 < blocks <= 0xFFFF or type(block_size) is not int or block_size <= 0:
        raise _Unfit
    if len(tokens) != blocks * block_size:
        raise _Unfit
    width = len(hashes[0])
    if not 0 < width <= 0xFF or (blocks > 1 and len(set(map(len, hashes))) > 1):
        raise _Unfit
    flags = 0
    parts: list[bytes] = [b"", b""]  # the head, then the parent, once they are known
    if parent is not None:
        if len(parent) != width:
            raise _Unfit
        flags |= _PARENT
        parts[1] = parent
    parts.append(b"".join(hashes))
    ids = array(_U32, tokens)  # OverflowError: an id outside 0..2**32-1
    if _SWAP:
        ids.byteswap()
    words = ids.tobytes()
    planes = [words[0::4], words[1::4], words[2::4], words[3::4]]
    while len(planes) > 1 and not planes[-1].strip(b"\0"):  # high bytes all zero
        planes.pop()
    token_bytes = len(planes)
    parts += planes
    if lora_id is not None:
        flags |= _LORA_ID
        parts.append(_I64.pack(_int(lora_id)))
    if lora_name is not None:
        flags |= _LORA_NAME
        parts.append(_text(lora_name, 0xFFFF, _U16))
    if kind is not None:
        flags |= _KIND
        parts.append(_text(kind, 0xFF, None))
    if window is not None:
        flags |= _WINDOW
        parts.append(_I64.pack(_int(window)))
    if extra is not None:
        if len(extra) != blocks or any(e is not None and type(e) is not tuple for e in extra):
            raise _Unfit  # one per block, each a tuple or None
        first = extra[0]
        if all(e == first for e in extra):
            flags |= _EXTRA_SAME
            _value(first, parts, 0)
        else:
            flags |= _EXTRA_EACH
            for each in extra:
                _value(each, parts, 0)
    parts[0] = _HEAD.pack(VERSION, flags, group_idx, block_size, blocks, width, token_bytes)
    return b"".join(parts)


def _int(value: Any) -> int:
    if type(value) is not int or not _I64_MIN <= value <= _I64_MAX:
        raise _Unfit
    return value


def _text(value: Any, most: int, length: struct.Struct | None) -> bytes:
    if type(value) is not str:
        raise _Unfit
    data = value.encode()
    if len(data) > most:
        raise _Unfit
    return (length.pack(len(data)) if length else bytes((len(data),))) + data


def _value(value: Any, parts: list[bytes], depth: int) -> None:
    """Append ``value`` tagged (see the module docstring)."""
    kind = type(value)
    if value is None:
        parts.append(b"\0")
    elif kind is int:
        parts.append(bytes((_INT,)) + _I64.pack(_int(value)))
    elif kind is str:
        data = value.encode()
        if len(data) > 0xFFFF:
            raise _Unfit
        parts += (_TAGGED_LEN.pack(_STR, len(data)), data)
    elif kind is bytes:
        if len(value) > 0xFFFF:
            raise _Unfit
        parts += (_TAGGED_LEN.pack(_BYTES, len(value)), value)
    elif kind is tuple and depth < MAX_DEPTH and len(value) <= 0xFFFF:
        parts.append(_TAGGED_LEN.pack(_TUPLE, len(value)))
        for item in value:
            _value(item, parts, depth + 1)
    else:  # bool, float, a list, an int or str subclass, a tuple too deep: not exact
        raise _Unfit


def decode_record(data: bytes, key: OffloadKey) -> ChunkRecord | None:
    """The record ``data`` holds, or ``None`` unless all of it parses as a record of
    ``key``'s chunk (see the module docstring)."""
    try:
        return _Reader(data).record(key)
    except (_Bad, struct.error, UnicodeError, IndexError, ValueError):
        return None


class _Reader:
    """Reads a record's fields in order; every read is bounds-checked."""

    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        at = self.at
        if n < 0 or at + n > len(self.data):
            raise _Bad
        self.at = at + n
        return self.data[at : at + n]

    def unpack(self, fmt: struct.Struct) -> tuple[Any, ...]:
        return fmt.unpack(self.take(fmt.size))

    def record(self, key: OffloadKey) -> ChunkRecord:
        version, flags, group_idx, block_size, blocks, width, token_bytes = self.unpack(_HEAD)
        if version != VERSION or flags & ~_KNOWN_FLAGS or not blocks or not block_size:
            raise _Bad
        if not width or not 0 < token_bytes <= 4 or (flags & _EXTRA_EACH and flags & _EXTRA_SAME):
            raise _Bad
        parent = self.take(width) if flags & _PARENT else None
        joined = self.take(blocks * width)
        hashes = [joined[i : i + width] for i in range(0, len(joined), width)]
        if hashes[-1] != key[:-GROUP_IDX_BYTES] or group_idx != int.from_bytes(
            key[-GROUP_IDX_BYTES:], "big"
        ):
            raise _Bad  # a record, but not of this key's chunk
        tokens = self._tokens(blocks * block_size, token_bytes)
        lora_id = self.unpack(_I64)[0] if flags & _LORA_ID else None
        lora_name = self.take(self.unpack(_U16)[0]).decode() if flags & _LORA_NAME else None
        kind = self.take(self.take(1)[0]).decode() if flags & _KIND else None
        window = self.unpack(_I64)[0] if flags & _WINDOW else None
        extra: list[tuple[Any, ...] | None] | None = None
        if flags & _EXTRA_SAME:
            extra = [self._block_keys()] * blocks
        elif flags & _EXTRA_EACH:
            extra = [self._block_keys() for _ in range(blocks)]
        if self.at != len(self.data):
            raise _Bad
        return ChunkRecord(
            hashes,
            parent,
            tokens,
            block_size,
            extra,
            group_idx,
            kind,
            window,
            lora_id,
            lora_name,
        )

    def _tokens(self, count: int, token_bytes: int) -> list[int]:
        words = bytearray(4 * count)
        for i in range(token_bytes):
            words[i::4] = self.take(count)
        ids = array(_U32)
        ids.frombytes(words)
        if _SWAP:
            ids.byteswap()
        return ids.tolist()

    def _block_keys(self) -> tuple[Any, ...] | None:
        value = self._value(0)
        if value is not None and type(value) is not tuple:
            raise _Bad
        return value

    def _value(self, depth: int) -> Any:
        tag = self.take(1)[0]
        if tag == _NONE:
            return None
        if tag == _INT:
            return self.unpack(_I64)[0]
        (length,) = self.unpack(_U16)
        if tag == _STR:
            return self.take(length).decode()
        if tag == _BYTES:
            return self.take(length)
        if tag == _TUPLE and depth < MAX_DEPTH:
            return tuple(self._value(depth + 1) for _ in range(length))
        raise _Bad


RecordOpener = Callable[[bytes, OffloadKey], bytes | None]
"""Opens a sealed record (``RecordSealing.open_record``) for a tier whose codec chain seals
them; ``None`` when it does not open."""


def header_record(
    header: bytes, key: OffloadKey, opener: RecordOpener | None = None
) -> ChunkRecord | None:
    """The record ``key``'s block keeps in its header area ``header``, or ``None`` (none
    kept, damaged, not a record of ``key``, or sealed and not opened by ``opener``)."""
    state, data = kept_record(header)
    if state is not KeptRecord.INTACT:
        return None
    if opener is not None:
        opened = opener(data, key)
        if opened is None:
            return None
        data = opened
    return decode_record(data, key)
