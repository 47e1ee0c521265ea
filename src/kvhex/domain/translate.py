"""Raw tier events -> public events (``BlockStored`` / ``BlockRemoved``), with provenance.

A raw ``Stored`` carries the exact ``ReqContext`` whose work stored its keys (or, for keys
stored with no request at hand, the ``ChunkRecord`` its tier kept). Its keys are announced as
chains: consecutive keys where each chunk's parent is the previous chunk's last block become
one full ``BlockStored`` (the hashes of every block in order, the parent of the first, the
tokens and per-block extra keys of all), as vLLM announces a request's GPU blocks; a chain
breaks only where it must (a placeholder, another group or block size, a gap). A key the
context cannot resolve (see ``locator``) is a placeholder (``token_ids=[]``,
``block_size=0``, the key's single hash). The ``Announcer`` hands the keys over in runs,
parent first; translation is the last use of the context: the raw event, and with it the
context, is released afterwards.

For removals only the detached chunk hashes are kept, per residency (medium, locality,
ownership), from a key's first translated store until its last residency is removed (evaluated
after the whole batch, so a removal followed by a store of the same key in one batch keeps
them). A removal of several keys gives one ``BlockRemoved`` per KV group with every
constituent hash.

A tier-wide ``Cleared`` (a reset) becomes per-key ``BlockRemoved`` events for exactly the keys
that tier held, with its medium, locality and ownership, rather than ``AllBlocksCleared``:
vLLM's ``AllBlocksCleared`` names no medium, so a consumer would also drop the GPU's and every
other tier's blocks.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any, cast

from kvhex.domain.events import (
    BlockRemoved,
    BlockStored,
    Cleared,
    ExternalHash,
    PublicEvent,
    Removed,
    Stored,
    TierEvent,
)
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.locator import ChunkRecord, describe, spans
from kvhex.domain.provenance import Provenance
from kvhex.domain.tiers import TierIdentity

_BULK = 8
"""Hashes from which converting them all at once beats one by one."""
_LITTLE_ENDIAN = sys.byteorder == "little"
Residency = tuple[str, str | None, str | None]
"""(medium, locality, ownership): one residency of announced keys."""

ExtraKeys = list[tuple[Any, ...] | None]


def _residency(tier: TierIdentity) -> Residency:
    return tier.medium.name, tier.locality.value if tier.locality else None, tier.ownership


def _low_64_bits(hashes: list[bytes]) -> list[int]:
    """The low 64 bits of each hash's big-endian value (its last 8 bytes), as vLLM publishes
    them with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``; hashes of one length (one hash
    function: the common case) are converted in one pass over their bytes."""
    if len(hashes) >= _BULK:
        sizes = set(map(len, hashes))
        if len(sizes) == 1 and (size := sizes.pop()) % 8 == 0:
            words = array("Q", b"".join(hashes))
            if _LITTLE_ENDIAN:
                words.byteswap()
            step = size // 8
            return words[step - 1 :: step].tolist()
    from_bytes = int.from_bytes
    return [from_bytes(h[-8:], "big") for h in hashes]


class _Chain:
    """Consecutive records of one ``Stored`` whose chunks follow each other: one event."""

    __slots__ = ("extra_keys", "first", "hashes", "tokens")

    def __init__(self, first: ChunkRecord) -> None:
        self.first = first
        self.hashes: list[bytes] | None = None  # grown copies, from the second record on
        self.tokens: list[int] = []
        self.extra_keys: ExtraKeys | None = None

    def continues(self, record: ChunkRecord) -> bool:
        first = self.first
        last = self.hashes[-1] if self.hashes is not None else first.block_hashes[-1]
        return (
            record.parent_block_hash == last
            and record.block_size == first.block_size
            and record.group_idx == first.group_idx
            and record.lora_name == first.lora_name
        )

    def extend(self, record: ChunkRecord) -> None:
        first = self.first
        if self.hashes is None:  # the first record's lists are its own: copy before growing
            self.hashes = list(first.block_hashes)
            self.tokens = list(first.token_ids)
            if first.extra_keys is not None:
                self.extra_keys = list(first.extra_keys)
        if record.extra_keys is not None and self.extra_keys is None:
            self.extra_keys = [None] * len(self.hashes)
        if self.extra_keys is not None:
            more = record.extra_keys
            self.extra_keys.extend(more if more is not None else [None] * len(record.block_hashes))
        self.hashes.extend(record.block_hashes)
        self.tokens.extend(record.token_ids)

    def record(self) -> ChunkRecord:
        if self.hashes is None:
            return self.first
        return self.first._replace(
            block_hashes=self.hashes, token_ids=self.tokens, extra_keys=self.extra_keys
        )


class EventTranslator:
    """Stateful translator for one engine's event stream (scheduler thread only).

    Args:
        geometry: the model's groups, used to classify placeholder stores (cache-spec kind
            and window) when the context cannot; survives every reset.
        int_hashes: publish hashes as the low 64 bits of their big-endian value (vLLM's
            ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) instead of bytes.
    """

    def __init__(self, geometry: KvGeometry | None = None, *, int_hashes: bool = False) -> None:
        self.geometry = geometry
        self.int_hashes = int_hashes
        # each key's hashes as first published; per residency, the keys it holds, each with
        # None (it published those hashes) or the hashes it published itself (a placeholder
        # where another residency has the key in full, or the reverse): each copy is
        # withdrawn with exactly the hashes it was announced with
        self._hashes: dict[OffloadKey, list[ExternalHash]] = {}
        self._resident: dict[Residency, dict[OffloadKey, list[ExternalHash] | None]] = {}
        self.full_stores = 0
        """Keys announced in full."""
        self.placeholder_stores = 0
        """Keys announced as placeholders."""

    # -- queries -------------------------------------------------------------------------
    def resident_keys(self, tier: TierIdentity) -> list[OffloadKey]:
        """Keys announced stored on ``tier``'s residency and not removed since."""
        return list(self._resident.get(_residency(tier), ()))

    @property
    def detached_keys(self) -> int:
        """Keys whose chunk hashes are kept for future removals."""
        return len(self._hashes)

    # -- translation ---------------------------------------------------------------------
    def translate(self, raw: Iterable[TierEvent]) -> list[PublicEvent]:
        """Public events for ``raw``, in order."""
        out: list[PublicEvent] = []
        maybe_gone: list[OffloadKey] = []
        for event in raw:
            if isinstance(event, Stored):
                self._stored(event, out)
            elif isinstance(event, Removed):
                self._removed(event.keys, event.tier, out, maybe_gone)
            elif isinstance(event, Cleared):
                keys = self._resident.get(_residency(event.tier))
                if keys:
                    self._removed(tuple(keys), event.tier, out, maybe_gone)
        if maybe_gone:
            self._forget_gone(maybe_gone)
        return out

    def _forget_gone(self, keys: list[OffloadKey]) -> None:
        """Drop the detached hashes of ``keys`` no residency holds any more."""
        hashes = self._hashes
        residencies = list(self._resident.values())
        if len(residencies) == 1:  # one residency (host memory alone): one test per key
            (resident,) = residencies
            for key in keys:
                if key not in resident:
                    hashes.pop(key, None)
            return
        for key in keys:
            if key in hashes and not any(key in r for r in residencies):
                del hashes[key]

    def _ext(self, block_hash: bytes) -> ExternalHash:
        if self.int_hashes:
            return int.from_bytes(block_hash[-8:], "big")  # the low 64 bits
        return block_hash

    def _stored(self, event: Stored, out: list[PublicEvent]) -> None:
        where = _residency(event.tier)
        ctx = event.ctx
        prov = ctx.provenance if ctx is not None else None
        if event.records is None and prov is not None:
            self._stored_from_request(event, prov, where, out)
        else:
            self._stored_from_records(event, where, out)

    def _stored_from_request(
        self, event: Stored, prov: Provenance, where: Residency, out: list[PublicEvent]
    ) -> None:
        """Keys stored by a request: resolved in one pass, each run of whole chunks that
        follow each other in the request described at once (one slice of its tokens)."""
        resident = self._resident.setdefault(where, {})
        detached = self._hashes
        run: list[OffloadKey] = []
        first = last = 0
        group: KvGroup | None = None
        whole = False

        def flush() -> None:
            record = describe(prov, first, last, cast("KvGroup", group))  # a run has one
            hashes = self._announce(record, where, prov.session_id, out)
            n = len(run)
            per = len(hashes) // n
            for i, key in enumerate(run):
                mine = hashes[i * per : (i + 1) * per] if n > 1 else hashes
                known = detached.get(key)
                if known is None:
                    detached[key] = mine
                    resident[key] = None
                else:
                    resident[key] = None if known == mine else mine
            self.full_stores += n

        for key, span in zip(event.keys, spans(event.ctx, event.keys), strict=True):
            if span is None:
                if run:
                    flush()
                    run = []
                self._announce_placeholder(key, where, event, out)
                continue
            start, end, key_group = span
            key_whole = end - start == key_group.tokens_per_chunk
            if run and whole and key_whole and key_group is group and start == last:
                run.append(key)
                last = end
                continue
            if run:
                flush()
            run, first, last, group, whole = [key], start, end, key_group, key_whole
        if run:
            flush()

    def _stored_from_records(self, event: Stored, where: Residency, out: list[PublicEvent]) -> None:
        """Keys described by records (or by nothing: placeholders): consecutive records whose
        chunks follow each other announced as one chain."""
        resident = self._resident.setdefault(where, {})
        detached = self._hashes
        records = event.records
        chain: _Chain | None = None
        for i, key in enumerate(event.keys):
            record = records[i] if records is not None else None
            if record is None:
                if chain is not None:
                    self._announce(chain.record(), where, None, out)
                    chain = None
                self._announce_placeholder(key, where, event, out)
                continue
            mine = self._published(record.block_hashes)
            known = detached.get(key)
            if known is None:
                detached[key] = mine
                resident[key] = None
            else:
                resident[key] = None if known == mine else mine
            self.full_stores += 1
            if chain is not None and chain.continues(record):
                chain.extend(record)
                continue
            if chain is not None:
                self._announce(chain.record(), where, None, out)
            chain = _Chain(record)
        if chain is not None:
            self._announce(chain.record(), where, None, out)

    def _published(self, hashes: list[bytes]) -> list[ExternalHash]:
        """``hashes`` as announced: bytes, or the low 64 bits of each (its last 8 bytes)."""
        if self.int_hashes:
            return cast("list[ExternalHash]", _low_64_bits(hashes))
        return cast("list[ExternalHash]", hashes)

    def _announce(
        self,
        record: ChunkRecord,
        where: Residency,
        session_id: str | None,
        out: list[PublicEvent],
    ) -> list[ExternalHash]:
        """Append ``record``'s ``BlockStored``; returns its hashes as published (shared with
        the event: read-only)."""
        medium, locality, ownership = where
        published = self._published(record.block_hashes)
        raw_parent = record.parent_block_hash
        parent = None if raw_parent is None else self._ext(raw_parent)
        # positional: one event per chain, this is the hot loop
        out.append(
            BlockStored(
                published,
                parent,
                record.token_ids,
                record.block_size,
                record.lora_id,
                medium,
                record.lora_name,
                record.extra_keys,
                record.group_idx,
                record.kv_cache_spec_kind,
                record.kv_cache_spec_sliding_window,
                locality,
                ownership,
                session_id,
            )
        )
        return published

    def _announce_placeholder(
        self, key: OffloadKey, where: Residency, event: Stored, out: list[PublicEvent]
    ) -> None:
        medium, locality, ownership = where
        placeholder = self._placeholder(key, medium, locality, ownership, event)
        out.append(placeholder)
        mine = placeholder.block_hashes
        known = self._hashes.setdefault(key, mine)
        self.placeholder_stores += 1
        self._resident.setdefault(where, {})[key] = None if known == mine else mine

    def _placeholder(
        self,
        key: OffloadKey,
        medium: str,
        locality: str | None,
        ownership: str | None,
        event: Stored,
    ) -> BlockStored:
        group_idx = int.from_bytes(key[-GROUP_IDX_BYTES:], "big")
        geometry = self.geometry
        ctx = event.ctx
        if ctx is not None and ctx.provenance is not None:
            geometry = ctx.provenance.geometry
        group = geometry.group(group_idx) if geometry is not None else None
        return BlockStored(
            block_hashes=[self._ext(key[:-GROUP_IDX_BYTES])],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=group_idx,
            kv_cache_spec_kind=group.kind_name if group else None,
            kv_cache_spec_sliding_window=group.sliding_window if group else None,
            locality=locality,
            ownership=ownership,
        )

    def _removed(
        self,
        keys: tuple[OffloadKey, ...],
        tier: TierIdentity,
        out: list[PublicEvent],
        maybe_gone: list[OffloadKey],
    ) -> None:
        medium, locality, ownership = where = _residency(tier)
        resident = self._resident.get(where, {})
        by_group: dict[int, list[ExternalHash]] = {}
        hashes, ext = self._hashes, self._ext
        for key in keys:
            published = resident.pop(key, None) or hashes.get(key) or [ext(key[:-GROUP_IDX_BYTES])]
            group = by_group.setdefault(int.from_bytes(key[-GROUP_IDX_BYTES:], "big"), [])
            group.extend(published)
            maybe_gone.append(key)
        for group_idx, group_hashes in by_group.items():
            out.append(BlockRemoved(group_hashes, medium, group_idx, locality, ownership))
