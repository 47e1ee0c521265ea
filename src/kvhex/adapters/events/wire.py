"""The KV-event wire format: msgspec structs byte-compatible with vLLM 0.33's
``vllm.distributed.kv_events`` (what vLLM's ZMQ publisher sends and its consumers decode).

Events are tagged structs (the tag is the class name: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) encoded as msgpack maps with default-valued fields omitted; a batch is an
array ``[ts, events, data_parallel_rank]``. Field names, order and defaults match vLLM's, so
vLLM's own decoder reads kvhex's bytes and the other way round (checked against golden bytes
recorded from vLLM 0.33 and, where vLLM is installed, live).
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvhex.domain import events as domain

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs."""


class BlockStored(KVCacheEvent):
    """vLLM 0.33's ``BlockStored``, field for field."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """vLLM 0.33's ``BlockRemoved``."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """vLLM 0.33's ``AllBlocksCleared``."""


class KVEventBatch(EventBatch):
    """A batch whose events decode to the three event types."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def to_wire(event: domain.PublicEvent) -> KVCacheEvent:
    """The wire struct of one public event (the domain's fields are in wire order)."""
    if isinstance(event, domain.BlockStored):
        return BlockStored(*event)
    if isinstance(event, domain.BlockRemoved):
        return BlockRemoved(*event)
    return AllBlocksCleared()


def encode_batch(batch: domain.EventBatch) -> bytes:
    """msgpack bytes of a batch, as vLLM's publisher encodes its ``KVEventBatch``."""
    wire = KVEventBatch(
        ts=batch.ts,
        events=[to_wire(e) for e in batch.events],  # type: ignore[misc]
        data_parallel_rank=batch.data_parallel_rank,
    )
    return _ENCODER.encode(wire)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode bytes from kvhex's or vLLM's publisher.

    Raises:
        msgspec.DecodeError: the bytes are not a KV event batch.
    """
    return _DECODER.decode(payload)
