"""What the benchmarks build for vLLM: an offloading config without an engine (vLLM 0.33),
and a random-weight model for a real engine (vLLM's CPU build)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 1024
"""The benchmark models' vocabulary."""


def make_model(path: Path, layers: int, hidden: int, max_len: int, dtype: str) -> Path:
    """A random-weight Llama in ``dtype`` (heads of 64, as many KV heads as heads, ``VOCAB``
    tokens, seed 0), saved at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=VOCAB,
        max_position_embeddings=max_len,
        torch_dtype=dtype,
    )
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    return path


def offloading_config(
    *,
    block_bytes: int,
    cpu_bytes: int,
    engine_id: str,
    events: bool = False,
    tokens_per_block: int = 16,
    max_model_len: int | None = None,
) -> Any:
    """vLLM 0.33's normalized offloading config, as its connector would hand a spec: one
    full-attention group of ``tokens_per_block``-token blocks (one block a chunk), one worker
    of ``block_bytes`` a block, ``cpu_bytes`` of host memory, KV events on or off."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    model: dict[str, Any] = {"name": "kvhex/bench", "dtype": "float16"}
    if max_model_len is not None:
        model["max_model_len"] = max_model_len
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block,
                layer_names=("layer.0",),
                group_id=0,
                sliding_window_size_in_chunks=None,
            ),
        ),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": cpu_bytes},
        engine_id=engine_id,
        model=OffloadingModelConfig(**model),
        cache=OffloadingCacheConfig(tokens_per_block, 1),
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
