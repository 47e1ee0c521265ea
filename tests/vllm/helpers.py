"""Building vLLM 0.33's offloading configuration and specs on CPU, for the vLLM tests.

Imported only by test modules that already skipped themselves when vLLM is missing.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

PAGE = 4096
"""Bytes one worker holds per block (page aligned: one host slot is exactly this)."""


def offloading_config(
    extra: dict[str, Any],
    *,
    events: bool = True,
    tokens_per_block: int = 16,
    tokens_per_hash: int = 16,
    blocks_per_chunk: int = 1,
    kv_bytes_per_block: int = PAGE,
) -> OffloadingConfig:
    """vLLM's normalized offloading config for one full-attention group and one worker."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block,
                layer_names=("layer.0",),
                group_id=0,
                **_only_in_0_33(OffloadingGroupConfig, sliding_window_size_in_chunks=None),
            ),
        ),
        worker_kv_bytes_per_block=kv_bytes_per_block,
        enable_kv_cache_events=events,
        extra_config=extra,
        engine_id=f"kvhex-test-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(
            name="kvhex/tiny",
            dtype="float16",
            **_only_in_0_33(OffloadingModelConfig, max_model_len=4096),
        ),
        cache=OffloadingCacheConfig(tokens_per_hash, blocks_per_chunk),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def _only_in_0_33(cls: type, **fields: Any) -> dict[str, Any]:
    """The fields vLLM 0.33 added to ``cls`` (vLLM 0.32's dataclass lacks them)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in fields.items() if k in names}


def key(i: int, group: int = 0) -> bytes:
    """An offload key: a 32-byte hash and the group index, packed like vLLM."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(32, "big"), group)
