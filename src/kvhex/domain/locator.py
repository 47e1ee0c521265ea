"""Resolving a stored key, lazily and at translation time, to the blocks it holds.

The context's recorded end position (or the key's hash found among the request's live block
hashes) tells where the chunk ends (:func:`spans`). A full chunk, or a chain of them, is
described at the group's block size (:func:`describe`): the tail hash of each cache block,
the hash before the first chunk as parent, the tokens and per-block extra keys. A partial
tail (a boundary inside a chunk) is described at hash-block size from the chunk start to the
boundary. Anything that does not check out (no provenance,
a cache kind whose blocks do not all stay valid, a request that rewrites tokens, a position
past the tokens or hashes known, a hash that differs from the key) gives ``None``: the caller
publishes a placeholder rather than a payload that could be wrong.

A :class:`ChunkRecord` is the same description detached from its request, with the request's
LoRA: what a tier keeps beside a block, so that a restart or another instance sharing the
storage can announce the block in full (:func:`record_of`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from kvhex.domain.extra_keys import chunk_extra_keys
from kvhex.domain.geometry import KvGroup
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.provenance import Provenance
from kvhex.domain.request import ReqContext


class ChunkRecord(NamedTuple):
    """Stored chunks described in full: everything their ``BlockStored`` says but where and by
    whom they are held. One chunk's (kept beside its block by tiers that persist it, to
    announce it without its request), or a chain of chunks' (what the translator announces
    as one event)."""

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


Span = tuple[int, int, KvGroup]
"""Where a key's chunk (or partial tail) lies in its request: tokens ``[start, end)``, and
its KV group."""


def _as_list(values: Sequence[int]) -> list[int]:
    return values if isinstance(values, list) else list(values)


def spans(ctx: ReqContext | None, keys: Sequence[OffloadKey]) -> list[Span | None]:
    """Where each of ``keys`` lies in ``ctx``'s request, or ``None`` where it cannot be
    described (see the module docstring). One call per job: the per-key work is a position
    lookup and a few comparisons."""
    prov = ctx.provenance if ctx is not None else None
    if ctx is None or prov is None or prov.mutates_tokens:
        return [None] * len(keys)
    geometry = prov.geometry
    tph = geometry.tokens_per_hash
    hashes = prov.block_hashes
    n_hashes, n_tokens = len(hashes), len(prov.token_ids)
    recorded = ctx.recorded_positions
    index: Mapping[bytes, int] | None = None
    chunks: Mapping[bytes, int] = {}
    out: list[Span | None] = []
    suffix = b""
    group: KvGroup | None = None
    tpc = 0
    for key in keys:
        if key[-GROUP_IDX_BYTES:] != suffix:
            suffix = key[-GROUP_IDX_BYTES:]
            group = geometry.group(int.from_bytes(suffix, "big"))
            tpc = group.tokens_per_chunk if group is not None and group.full_payload else 0
            if tpc:
                chunks = prov.chunk_index(tpc // tph)
        if not tpc or group is None:
            out.append(None)
            continue
        end = recorded.get(key)
        if end is None:  # where its hash is among the request's: a chunk's end, or any
            found = chunks.get(key[:-GROUP_IDX_BYTES])
            if found is None:
                if index is None:
                    index = prov.hash_index()
                found = index.get(key[:-GROUP_IDX_BYTES])
                if found is None:
                    out.append(None)
                    continue
            end = (found + 1) * tph
        elif end <= 0 or end % tph or end // tph > n_hashes:
            out.append(None)
            continue
        elif hashes[end // tph - 1] != key[:-GROUP_IDX_BYTES]:
            out.append(None)  # a recorded position no longer this key's
            continue
        if end > n_tokens:
            out.append(None)
            continue
        out.append((end - tpc if end % tpc == 0 else end - end % tpc, end, group))
    return out


def describe(prov: Provenance, start: int, end: int, group: KvGroup) -> ChunkRecord:
    """Tokens ``[start, end)`` of ``prov``'s request in ``group``: whole chunks (a chain of
    them, described at the group's block size) or one partial tail (at hash-block size)."""
    tph = prov.geometry.tokens_per_hash
    hashes = prov.block_hashes
    whole = not (end - start) % group.tokens_per_chunk and not start % group.tokens_per_chunk
    step = group.tokens_per_block if whole else tph
    per_block = step // tph
    first = start // tph
    if per_block == 1:
        block_hashes = list(hashes[first : end // tph])
    else:
        block_hashes = list(hashes[first + per_block - 1 : end // tph : per_block])
    return ChunkRecord(
        block_hashes,
        hashes[first - 1] if first else None,
        _as_list(prov.token_ids[start:end]),
        step,
        chunk_extra_keys(prov, start, end, step),
        group.group_idx,
        group.kind_name,
        group.sliding_window,
        prov.lora_id,
        prov.lora_name,
    )


def record_of(ctx: ReqContext | None, key: OffloadKey) -> ChunkRecord | None:
    """``key``'s chunk as stored by ``ctx``'s request, detached from the request (tokens and
    hashes copied), or ``None`` where only a placeholder could be announced."""
    (span,) = spans(ctx, (key,))
    if span is None or ctx is None or ctx.provenance is None:
        return None
    return describe(ctx.provenance, *span)


def span_parent(ctx: ReqContext, key: OffloadKey, span: Span) -> OffloadKey | None:
    """The key of the chunk before ``key``'s (at ``span`` in ``ctx``'s request, same group),
    ``None`` for the request's first chunk."""
    start = span[0]
    if not start:
        return None
    prov = ctx.provenance
    assert prov is not None  # a span exists only for a context with provenance
    return OffloadKey(
        prov.block_hashes[start // prov.geometry.tokens_per_hash - 1] + key[-GROUP_IDX_BYTES:]
    )


def record_parent(record: ChunkRecord) -> OffloadKey | None:
    """The key of the chunk before ``record``'s (``None`` for a request's first chunk)."""
    parent = record.parent_block_hash
    if parent is None:
        return None
    return OffloadKey(parent + record.group_idx.to_bytes(GROUP_IDX_BYTES, "big"))
