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
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.locator import locate
from kvhex.domain.tiers import TierIdentity

__all__ = ["EventTranslator"]

_MASK64 = (1 << 64) - 1
Residency = tuple[str, str | None, str | None]
"""(medium, locality, ownership): one residency of announced keys."""

ExtraKeys = list[tuple[Any, ...] | None]


def _residency(tier: TierIdentity) -> Residency:
    return tier.medium.name, tier.locality.value if tier.locality else None, tier.ownership


class _Chain:
    """A ``BlockStored`` being built from consecutive keys of one ``Stored``."""

    __slots__ = (
        "block_size",
        "extra_keys",
        "group_idx",
        "hashes",
        "kind",
        "last",
        "lora_id",
        "lora_name",
        "owned",
        "parent",
        "tokens",
        "window",
    )

    def __init__(
        self,
        *,
        hashes: list[bytes],
        parent: bytes | None,
        tokens: list[int],
        block_size: int,
        extra_keys: ExtraKeys | None,
        group_idx: int,
        kind: str | None,
        window: int | None,
        lora_id: int | None,
        lora_name: str | None,
    ) -> None:
        self.hashes = hashes
        self.parent = parent
        self.tokens = tokens
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.group_idx = group_idx
        self.kind = kind
        self.window = window
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.last = hashes[-1]
        self.owned = False

    def extend(self, hashes: list[bytes], tokens: list[int], extra_keys: ExtraKeys | None) -> None:
        if not self.owned:  # the first key's lists are its payload's: copy before growing
            self.owned = True
            self.hashes = list(self.hashes)
            self.tokens = list(self.tokens)
            if self.extra_keys is not None:
                self.extra_keys = list(self.extra_keys)
        if extra_keys is not None and self.extra_keys is None:
            self.extra_keys = [None] * len(self.hashes)
        if self.extra_keys is not None:
            self.extra_keys.extend(extra_keys if extra_keys is not None else [None] * len(hashes))
        self.hashes.extend(hashes)
        self.tokens.extend(tokens)
        self.last = hashes[-1]


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
        self._hashes: dict[OffloadKey, list[bytes]] = {}
        self._resident: dict[Residency, dict[OffloadKey, None]] = {}
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
        for key in maybe_gone:
            if key in self._hashes and not any(key in r for r in self._resident.values()):
                del self._hashes[key]
        return out

    def _ext(self, block_hash: bytes) -> ExternalHash:
        if self.int_hashes:
            return int.from_bytes(block_hash, "big") & _MASK64
        return block_hash

    def _stored(self, event: Stored, out: list[PublicEvent]) -> None:
        tier = event.tier
        medium, locality, ownership = where = _residency(tier)
        resident = self._resident.setdefault(where, {})
        detached = self._hashes
        ctx = event.ctx
        prov = ctx.provenance if ctx is not None else None
        session_id = prov.session_id if prov is not None else None
        records = event.records
        chain: _Chain | None = None
        for i, key in enumerate(event.keys):
            record = records[i] if records is not None else None
            if record is not None:
                hashes, parent, tokens, block_size, extra_keys, group_idx = record[:6]
                kind, window, lora_id, lora_name = record[6:]
            else:
                payload = locate(ctx, key) if prov is not None else None
                if payload is None:
                    if chain is not None:
                        self._flush(chain, where, session_id, out)
                        chain = None
                    out.append(self._placeholder(key, medium, locality, ownership, event))
                    detached.setdefault(key, [key[:-GROUP_IDX_BYTES]])
                    self.placeholder_stores += 1
                    resident[key] = None
                    continue
                hashes, parent, tokens, block_size, extra_keys, group = payload
                assert prov is not None
                group_idx, kind, window = group.group_idx, group.kind_name, group.sliding_window
                lora_id, lora_name = prov.lora_id, prov.lora_name
            detached[key] = hashes  # shared with the event: events are read-only
            self.full_stores += 1
            resident[key] = None
            if (
                chain is not None
                and parent == chain.last
                and block_size == chain.block_size
                and group_idx == chain.group_idx
                and lora_name == chain.lora_name
            ):
                chain.extend(hashes, tokens, extra_keys)
                continue
            if chain is not None:
                self._flush(chain, where, session_id, out)
            chain = _Chain(
                hashes=hashes,
                parent=parent,
                tokens=tokens,
                block_size=block_size,
                extra_keys=extra_keys,
                group_idx=group_idx,
                kind=kind,
                window=window,
                lora_id=lora_id,
                lora_name=lora_name,
            )
        if chain is not None:
            self._flush(chain, where, session_id, out)

    def _flush(
        self, chain: _Chain, where: Residency, session_id: str | None, out: list[PublicEvent]
    ) -> None:
        medium, locality, ownership = where
        if self.int_hashes:
            ext = self._ext
            published: list[ExternalHash] = [ext(h) for h in chain.hashes]
            parent: ExternalHash | None = None if chain.parent is None else ext(chain.parent)
        else:
            published = cast("list[ExternalHash]", chain.hashes)
            parent = chain.parent
        # positional: one event per chain, this is the hot loop
        out.append(
            BlockStored(
                published,
                parent,
                chain.tokens,
                chain.block_size,
                chain.lora_id,
                medium,
                chain.lora_name,
                chain.extra_keys,
                chain.group_idx,
                chain.kind,
                chain.window,
                locality,
                ownership,
                session_id,
            )
        )

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
        ext = self._ext
        for key in keys:
            detached = self._hashes.get(key) or [key[:-GROUP_IDX_BYTES]]
            group = by_group.setdefault(int.from_bytes(key[-GROUP_IDX_BYTES:], "big"), [])
            group.extend(ext(h) for h in detached)
            resident.pop(key, None)
            maybe_gone.append(key)
        for group_idx, group_hashes in by_group.items():
            out.append(BlockRemoved(group_hashes, medium, group_idx, locality, ownership))
