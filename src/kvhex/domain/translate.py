"""Raw tier events -> public events (``BlockStored`` / ``BlockRemoved``), with provenance.

A raw ``Stored`` carries the exact ``ReqContext`` whose work stored its keys; each key becomes
one ``BlockStored``: full when the context resolves it (see ``locator``), a placeholder
(``token_ids=[]``, ``block_size=0``, the key's single hash) otherwise. Translation is the last
use of the context: the raw event, and with it the context, is released afterwards.

For removals only the detached chunk hashes are kept, per residency ``(medium, ownership)``,
from a key's first translated store until its last residency is removed (evaluated after the
whole batch, so a removal followed by a store of the same key in one batch keeps them). A
removal of several keys gives one ``BlockRemoved`` per KV group with every constituent hash.

A tier-wide ``Cleared`` (a reset) becomes per-key ``BlockRemoved`` events for exactly the keys
that tier held, with its medium, locality and ownership, rather than ``AllBlocksCleared``:
vLLM's ``AllBlocksCleared`` names no medium, so a consumer would also drop the GPU's and every
other tier's blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

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
Residency = tuple[str, str | None]


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
        self.placeholder_stores = 0

    # -- queries -------------------------------------------------------------------------
    def resident_keys(self, medium: str, ownership: str | None) -> list[OffloadKey]:
        """Keys announced stored and not yet removed on that residency."""
        return list(self._resident.get((medium, ownership), ()))

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
                where = (event.tier.medium.name, event.tier.ownership)
                keys = self._resident.get(where)
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
        medium = tier.medium.name
        ownership = tier.ownership
        locality = tier.locality.value if tier.locality else None
        resident = self._resident.setdefault((medium, ownership), {})
        detached = self._hashes
        ctx = event.ctx
        prov = ctx.provenance if ctx is not None else None
        if prov is not None:
            lora_id, lora_name, session_id = prov.lora_id, prov.lora_name, prov.session_id
        append = out.append
        for key in event.keys:
            payload = locate(ctx, key) if prov is not None else None
            if payload is not None:
                hashes, parent, token_ids, block_size, extra_keys, group = payload
                if self.int_hashes:
                    ext = self._ext
                    published: list[ExternalHash] = [ext(h) for h in hashes]
                    parent_published = None if parent is None else ext(parent)
                else:
                    published = cast("list[ExternalHash]", hashes)
                    parent_published = parent
                # positional: one event per stored chunk, this is the hot loop
                append(
                    BlockStored(
                        published,
                        parent_published,
                        token_ids,
                        block_size,
                        lora_id,
                        medium,
                        lora_name,
                        extra_keys,
                        group.group_idx,
                        group.kind_name,
                        group.sliding_window,
                        locality,
                        ownership,
                        session_id,
                    )
                )
                detached[key] = hashes  # shared with the event: events are read-only
                self.full_stores += 1
            else:
                append(self._placeholder(key, medium, locality, ownership, event))
                detached.setdefault(key, [key[:-GROUP_IDX_BYTES]])
                self.placeholder_stores += 1
            resident[key] = None

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
        medium = tier.medium.name
        resident = self._resident.get((medium, tier.ownership), {})
        by_group: dict[int, list[ExternalHash]] = {}
        ext = self._ext
        for key in keys:
            detached = self._hashes.get(key) or [key[:-GROUP_IDX_BYTES]]
            group = by_group.setdefault(int.from_bytes(key[-GROUP_IDX_BYTES:], "big"), [])
            group.extend(ext(h) for h in detached)
            resident.pop(key, None)
            maybe_gone.append(key)
        locality = tier.locality.value if tier.locality else None
        for group_idx, group_hashes in by_group.items():
            out.append(BlockRemoved(group_hashes, medium, group_idx, locality, tier.ownership))
