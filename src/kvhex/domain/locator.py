"""Resolving a stored key, lazily and at translation time, to the blocks it holds.

The context's recorded end position (or the key's hash found among the request's live block
hashes) tells where the chunk ends. A full chunk is described at the group's block size: the
tail hash of each cache block, the hash before the chunk as parent, the chunk's tokens and
per-block extra keys. A partial tail (a boundary inside a chunk) is described at hash-block
size from the chunk start to the boundary. Anything that does not check out (no provenance,
a cache kind whose blocks do not all stay valid, a request that rewrites tokens, a position
past the tokens or hashes known, a hash that differs from the key) gives ``None``: the caller
publishes a placeholder rather than a payload that could be wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from kvhex.domain.extra_keys import chunk_extra_keys
from kvhex.domain.geometry import KvGroup
from kvhex.domain.keys import GROUP_IDX_BYTES, OffloadKey
from kvhex.domain.request import ReqContext

__all__ = ["Payload", "locate"]


class Payload(NamedTuple):
    """The request-derived part of a full ``BlockStored``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None] | None
    group: KvGroup


def _as_list(values: Sequence[int]) -> list[int]:
    return values if isinstance(values, list) else list(values)


def locate(ctx: ReqContext | None, key: OffloadKey) -> Payload | None:
    """The payload of ``key`` as stored by the request ``ctx``, or ``None`` (placeholder)."""
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
    hashes, tokens = prov.block_hashes, prov.token_ids
    if end is None or end <= 0 or end % tph or end > len(tokens) or end // tph > len(hashes):
        return None
    if hashes[end // tph - 1] != key[:-GROUP_IDX_BYTES]:
        return None  # the request's hashes no longer name this key
    tpc = group.tokens_per_chunk
    if end % tpc == 0:
        start, step = end - tpc, group.tokens_per_block
    else:
        start, step = end - end % tpc, tph
    per_block = step // tph
    first = start // tph
    if per_block == 1:
        block_hashes = list(hashes[first : end // tph])
    else:
        block_hashes = list(hashes[first + per_block - 1 : end // tph : per_block])
    return Payload(
        block_hashes=block_hashes,
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=_as_list(tokens[start:end]),
        block_size=step,
        extra_keys=chunk_extra_keys(prov, start, end, step),
        group=group,
    )
