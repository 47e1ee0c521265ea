"""What the benchmarks build for vLLM: an offloading config without an engine (vLLM 0.33),
and a random-weight model for a real engine (vLLM's CPU build)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
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


def make_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ``VOCAB`` words ``t0`` .. ``t1023`` (id ``n`` is ``tN``),
    saved beside the model at ``path``: a server then answers text (``" t12 t7"``) whose
    token ids a client reads back without asking for them (``return_token_ids``, which
    vllm-router 0.1.17's ``kv_aware`` does not credit)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(path)


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


# -- a vLLM server process (bench/serve.py) --------------------------------------------------
def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def server_process(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    log_path: Path,
    port: int,
    start_s: float,
) -> Iterator[str]:
    """``command`` (a vLLM server on ``port``) in a process group of its own, its output in
    ``log_path``; yields its URL once healthy and stops the group on the way out."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log_path, start_s)
            yield url
        finally:
            stop(proc)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log_path: Path, start_s: float) -> None:
    """Until ``url/health`` answers; fails with the log's tail if the server exits, or after
    ``start_s``."""
    deadline = time.monotonic() + start_s
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not up in {start_s:.0f} s") from None
            time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group (vLLM shuts its engine down), SIGKILL to what is
    left of the group after 30 s, or at once after the server exited."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def scrape(url: str) -> dict[tuple[str, str], float]:
    """``/metrics`` as ``{(sample name, the label that tells series apart): value}``, summed
    over vLLM's ``model_name`` and ``engine`` labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = (sample.name, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))
            out[key] = out.get(key, 0.0) + sample.value
    return out
