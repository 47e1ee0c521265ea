"""Building requests the way an engine does: tokens hashed in blocks of ``tokens_per_hash``,
each hash chained to its parent and covering the block's extra keys. Shared by the event
tests and the state machines; ``recompute`` lets a test check a published BlockStored."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

from kvhex.domain import OffloadKey, ReqContext, make_offload_key
from kvhex.domain.extra_keys import block_extra_keys
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.provenance import MmFeature, Provenance

NONE_HASH = b"\0" * 32


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> bytes:
    """The test's hash function (stands for vLLM's sha256 over the same triple)."""
    return hashlib.sha256(pickle.dumps((parent or NONE_HASH, tuple(tokens), extra))).digest()


def make_request(
    req_id: str,
    tokens: list[int],
    geometry: KvGeometry,
    **prov: Any,
) -> ReqContext:
    """A context whose provenance references ``tokens`` and hashes computed from them."""
    hashes: list[bytes] = []
    provenance = Provenance(geometry=geometry, token_ids=tokens, block_hashes=hashes, **prov)
    extend_hashes(provenance)
    return ReqContext(req_id, provenance=provenance)


def extend_hashes(prov: Provenance) -> None:
    """Hash every newly complete hash block (as an engine does when tokens are appended)."""
    tph = prov.geometry.tokens_per_hash
    hashes = prov.block_hashes
    assert isinstance(hashes, list)
    tokens = prov.token_ids
    for i in range(len(hashes), len(tokens) // tph):
        parent = hashes[i - 1] if i else None
        start = i * tph
        hashes.append(
            block_hash(
                parent, tokens[start : start + tph], block_extra_keys(prov, start, start + tph)
            )
        )


def chunk_key(ctx: ReqContext, chunk: int, group: KvGroup) -> OffloadKey:
    prov = ctx.provenance
    assert prov is not None
    hpc = group.tokens_per_chunk // prov.geometry.tokens_per_hash
    return make_offload_key(prov.block_hashes[(chunk + 1) * hpc - 1], group.group_idx)


def boundary_key(ctx: ReqContext, boundary: int, group: KvGroup) -> OffloadKey:
    prov = ctx.provenance
    assert prov is not None
    return make_offload_key(
        prov.block_hashes[boundary // prov.geometry.tokens_per_hash - 1], group.group_idx
    )


def recompute(
    parent: bytes | None,
    token_ids: list[int],
    block_size: int,
    extra_keys: list[Any] | None,
    n_blocks: int,
) -> list[bytes]:
    """The hashes a consumer derives from a full BlockStored (block_size == tokens_per_hash)."""
    out = []
    for i in range(n_blocks):
        extra = extra_keys[i] if extra_keys else None
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


__all__ = ["MmFeature", "boundary_key", "chunk_key", "extend_hashes", "make_request", "recompute"]
