"""Resolving a stored key, lazily and at translation time, to the blocks it holds.

The context's recorded end position (or the key's hash found among the request's live block
hashes) tells where the chunk ends. A full chunk is described at the group's block size: the
tail hash of each cache block, the hash before the chunk as parent, the chunk's tokens and
per-block extra keys. A partial tail (a boundary inside a chunk) is described at hash-block
size from the chunk start to the boundary. Anything that does not check out (no provenance,
a cache kind whose blocks do not all stay valid, a request that rewrites tokens, a position
past the tokens or hashes known, a hash that differs from the key) gives ``None``: the caller
publishes a placeholder rather than a payload that could be wrong.

A :class:`ChunkRecord` is the same description detached from its request, with the request's
LoRA: what a tier keeps beside a block, so that a restart or another instance sharing the
storage can announce the block in full (:func:`record_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvhex.domain.extra_keys import chunk_extra_keys
from kvhex.domain.geometry import KvGroup
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.provenance import Provenance
from kvhex.domain.request import ReqContext

__all__ = ["ChunkRecord", "Payload", "chunk_parent", "locate", "record_of", "record_parent"]


class Payload(NamedTuple):
    """The request-derived part of a full ``BlockStored``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None] | None
    group: KvGroup


class ChunkRecord(NamedTuple):
    """A stored chunk described in full without its request: everything its ``BlockStored``
    says but where and by whom it is held (kept beside the block by tiers that persist it)."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None] | None
    group_idx: int
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None
    lora_id: int | None
    lora_name: str | None


def _as_list(values: Sequence[int]) -> list[int]:
    return values if isinstance(values, list) else list(values)


def _span(ctx: ReqContext | None, key: OffloadKey) -> tuple[int, int, KvGroup, Provenance] | None:
    """``(start, end, group, provenance)`` of ``key``'s chunk (or partial tail) in ``ctx``'s
    tokens, once everything checks out; ``None`` otherwise (see the module docstring)."""
    if ctx is None:
        return None
    prov = ctx.provenance
    if prov is None or prov.mutates_tokens:
        return None
    group = prov.geometry.group(int.from_bytes(key[-GROUP_IDX_BYTES:], "big"))
    if group is None or not group.full_payload:
        return None
    end = ctx.position(key)
    tph = prov.geometry.tokens_per_hash
    hashes = prov.block_hashes
    if (
        end is None
        or end <= 0
        or end % tph
        or end > len(prov.token_ids)
        or end // tph > len(hashes)
        or hashes[end // tph - 1] != key[:-GROUP_IDX_BYTES]  # no longer this key's hashes
    ):
        return None
    tpc = group.tokens_per_chunk
    start = end - tpc if end % tpc == 0 else end - end % tpc
    return start, end, group, prov


def chunk_parent(ctx: ReqContext | None, key: OffloadKey) -> OffloadKey | bool | None:
    """The key of the chunk before ``key``'s in ``ctx``'s request (same group), ``None`` for
    the request's first chunk, or ``False`` when ``key`` cannot be described (a placeholder:
    no parent is known). Cheaper than :func:`locate`: no payload is built."""
    span = _span(ctx, key)
    if span is None:
        return False
    start, _, _, prov = span
    if not start:
        return None
    tph = prov.geometry.tokens_per_hash
    return OffloadKey(prov.block_hashes[start // tph - 1] + key[-GROUP_IDX_BYTES:])


def record_parent(record: ChunkRecord) -> OffloadKey | None:
    """The key of the chunk before ``record``'s (``None`` for a request's first chunk)."""
    parent = record.parent_block_hash
    if parent is None:
        return None
    return OffloadKey(parent + record.group_idx.to_bytes(GROUP_IDX_BYTES, "big"))


def locate(ctx: ReqContext | None, key: OffloadKey) -> Payload | None:
    """The payload of ``key`` as stored by the request ``ctx``, or ``None`` (placeholder)."""
    span = _span(ctx, key)
    if span is None:
        return None
    start, end, group, prov = span
    tph = prov.geometry.tokens_per_hash
    hashes = prov.block_hashes
    step = group.tokens_per_block if end - start == group.tokens_per_chunk else tph
    per_block = step // tph
    first = start // tph
    if per_block == 1:
        block_hashes = list(hashes[first : end // tph])
    else:
        block_hashes = list(hashes[first + per_block - 1 : end // tph : per_block])
    return Payload(
        block_hashes=block_hashes,
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=_as_list(prov.token_ids[start:end]),
        block_size=step,
        extra_keys=chunk_extra_keys(prov, start, end, step),
        group=group,
    )


def record_of(ctx: ReqContext | None, key: OffloadKey) -> ChunkRecord | None:
    """``key``'s chunk as stored by ``ctx``'s request, detached from the request (tokens and
    hashes copied), or ``None`` where only a placeholder could be announced."""
    payload = locate(ctx, key)
    if payload is None or ctx is None or ctx.provenance is None:
        return None
    prov = ctx.provenance
    group = payload.group
    return ChunkRecord(
        payload.block_hashes,
        payload.parent_block_hash,
        list(payload.token_ids),
        payload.block_size,
        payload.extra_keys,
        group.group_idx,
        group.kind_name,
        group.sliding_window,
        prov.lora_id,
        prov.lora_name,
    )
