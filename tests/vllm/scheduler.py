"""Driving vLLM 0.33's scheduler-side offloading connector on CPU with synthetic requests.

A ``VllmConfig`` built offline (a folder holding only a tiny Llama ``config.json``, device
"cpu", a null event publisher), one full-attention KV group, and the scheduler's call order:
``on_new_request``, ``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output`` (a worker reporting finished jobs by
id), ``request_finished``, ``take_events``. No worker or GPU: transfers "finish" when the test
reports them, so host bytes are whatever the test writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

BLOCK = 16
LAYER = "model.layers.0.self_attn.attn"
NUM_BLOCKS = 64
PAGE = 2 * BLOCK * 4 * 16 * 2  # K and V, 16 tokens, 4 heads of 16, float16: 4096 bytes

_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)
_HASHER = get_request_block_hasher(BLOCK, _HASH)


def vllm_config(model_dir: Path, extra: dict[str, Any], connector: str) -> VllmConfig:
    """An offline ``VllmConfig`` with the offloading connector ``connector``."""
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 1,
                "vocab_size": 1000,
                "max_position_embeddings": 2048,
                "torch_dtype": "float16",
            }
        )
    )
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )


def kv_cache_config() -> KVCacheConfig:
    """One full-attention group of one layer, ``NUM_BLOCKS`` blocks of ``PAGE`` bytes."""
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=NUM_BLOCKS * PAGE,
                layers=[LAYER],
                layer_stride=NUM_BLOCKS * PAGE,
                block_stride=PAGE,
            )
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [LAYER],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float16
                ),
            )
        ],
    )


def scheduler_connector(model_dir: Path, extra: dict[str, Any], connector: str) -> Any:
    """The connector vLLM's factory builds for the scheduler role."""
    config = vllm_config(model_dir, extra, connector)
    return KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def request(req_id: str, tokens: list[int], **kwargs: Any) -> Request:
    """A request with vLLM's block hasher (its ``block_hashes`` fill in as tokens come)."""
    return Request(
        req_id,
        tokens,
        SamplingParams(max_tokens=8),
        None,
        block_hasher=_HASHER,
        **kwargs,
    )


class Driver:
    """Plays vLLM's scheduler against one connector, step by step."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        self.next_block = 1
        self.events: list[Any] = []

    def step(
        self,
        new: list[NewRequestData] = (),  # type: ignore[assignment]
        scheduled: dict[str, int] | None = None,
        finished: set[str] | None = None,
    ) -> OffloadingConnectorMetadata:
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = list(new)
        output.scheduled_cached_reqs = CachedRequestData.make_empty()
        output.num_scheduled_tokens = dict(scheduled or {})
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        output.finished_req_ids = set(finished or ())
        meta = self.connector.build_connector_meta(output)
        self.events.extend(self.connector.take_events())
        return meta

    def complete(self, job_ids: list[int]) -> None:
        """The (single) worker reports these jobs finished."""
        meta = OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))
        self.connector.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
        self.events.extend(self.connector.take_events())

    def until(self, done: Any, limit_s: float = 10.0) -> None:
        """Step (as an idle engine would) until ``done()`` holds; fail after ``limit_s``."""
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, "the tier did not finish in time"
            self.step()
            time.sleep(0.002)

    def matched(self, req: Request, limit_s: float = 10.0) -> int:
        """Ask for external hits until the connector stops deferring (steps meanwhile)."""
        deadline = time.monotonic() + limit_s
        while True:
            hits, _ = self.connector.get_num_new_matched_tokens(req, 0)
            if hits is not None:
                return int(hits)
            assert time.monotonic() < deadline, "lookups stayed deferred"
            self.step()
            time.sleep(0.002)

    def allocate(self, req: Request, num_blocks: int, external: int) -> list[int]:
        blocks = list(range(self.next_block, self.next_block + num_blocks))
        self.next_block += num_blocks
        kv_blocks = KVCacheBlocks(([KVCacheBlock(b) for b in blocks],))
        self.connector.update_state_after_alloc(req, kv_blocks, external)
        return blocks

    def prefill(self, req: Request, external: int = 0) -> OffloadingConnectorMetadata:
        """Allocate blocks for the whole prompt and schedule what is not loaded."""
        n = len(req.prompt_token_ids or ())
        blocks = self.allocate(req, (n + BLOCK - 1) // BLOCK, external)
        req.num_computed_tokens = external
        new = NewRequestData.from_request(req, (blocks,))
        meta = self.step(new=[new], scheduled={req.request_id: n - external})
        req.num_computed_tokens = n
        return meta

    def finish(self, req: Request) -> OffloadingConnectorMetadata:
        req.status = RequestStatus.FINISHED_STOPPED
        self.connector.request_finished_all_groups(req, ([],))
        return self.step(finished={req.request_id})
