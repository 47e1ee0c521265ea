"""A KV-event trace of vLLM's whole scheduler with an offloading connector, and no model.

vLLM's real ``Scheduler`` (its ``KVCacheManager`` with prefix caching, whose GPU block pool
announces ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, and the connector vLLM's
factory builds from ``kv_transfer_config`` as a server configures it: docs/vllm.md) steps
through a chat workload: users sharing a system prompt, each turn's prompt the user's history
plus a new message. After each ``schedule()`` the harness plays the model runner and the
worker half of the connector: one sampled token per request past its prefill, and a
``KVConnectorOutput`` reporting each job of the step's ``OffloadingConnectorMetadata`` done
1-3 steps later (seeded), flushed jobs (``jobs_to_flush``) and synchronous loads in their own
step, as ``OffloadingConnectorWorker`` reports them (``OffloadingWorkerMetadata``, the same
shape in vLLM 0.32 and 0.33). The scheduler's ``kv_event_publisher`` is replaced by a
recorder: every batch it publishes (the GPU pool's events first, then the connector's) is
kept with its step, and so is every transfer job with the offload keys vLLM gave it.

``tests.vllm.trace_report`` replays the batches as a router does and tells why each store
announced before its parent was; it is also the command line:

    .venv-vllm/bin/python -m tests.vllm.trace_report [--preset faithful|slow-tier|probed|...]
        [--seed N] [--tier fs|memory|none] [--stock] [--jsonl PATH] [-v]

Deterministic with kvhex's in-memory tier (jobs done on a later poll) and load-or-recompute
decisions off (``auto`` decides on wall-clock timings); the ``fs`` tier's IO threads are not.
Synchronous scheduling (``async_scheduling=False``): a server's default ``AsyncScheduler``
overlaps a step's scheduling with the previous step's output, in the same event order per
batch. Transfers move no bytes.
"""

from __future__ import annotations

import bisect
import json
import random
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import attrs
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvhex.domain.primary import PRIMARY_IDENTITY
from kvhex.vllm import KvhexOffloadingManager, register

BLOCK = 16
LAYER = "model.layers.0.self_attn.attn"
PAGE = 2 * BLOCK * 4 * 16 * 2  # K and V, 16 tokens, 4 heads of 16, float16: 4096 bytes
VOCAB = 1000
MAX_MODEL_LEN = 1024
KVHEX = "KvhexOffloadingConnector"
STOCK = "OffloadingConnector"

_HASH = get_hash_fn_by_name("sha256")
init_none_hash(_HASH)
_HASHER = get_request_block_hasher(BLOCK, _HASH)
_MASK = (1 << 64) - 1


def ext(key: bytes) -> int:
    """The hash vLLM publishes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, its default) for an
    offload key (a block hash and 4 bytes of KV group)."""
    return int.from_bytes(key[:-4], "big") & _MASK


@attrs.frozen
class TraceConfig:
    """One trace: the workload, the cache sizes, and how late the worker reports jobs."""

    seed: int = 0
    users: int = 24
    turns: int = 6
    system_tokens: int = 40  # shared by every user
    message_tokens: tuple[int, int] = (16, 96)
    output_tokens: tuple[int, int] = (8, 32)
    think_steps: tuple[int, int] = (0, 2)
    gpu_blocks: int = 80  # the GPU evicts (BlockRemoved) and preempts
    max_seqs: int = 8
    max_batched_tokens: int = 192  # prefills of several steps
    host_chunks: int = 96  # host memory evicts
    tier: str | None = "memory"  # behind host memory: "memory" (kvhex's, in host memory),
    # "fs" (files, on IO threads: not deterministic), None
    tier_chunks: int = 200  # the tier evicts
    tier_polls: int = 2  # the memory tier's jobs finish on the N-th poll (two per step)
    tier_indexed: bool = True  # its lookups answered from its index, as the file tier's
    # (False: by probes, as object stores' and Valkey's)
    delays: tuple[int, int] = (1, 3)  # steps from a job's step to the one reporting it done
    load_mode: str = "off"  # kvhex's load-or-recompute: every hit loads, as vLLM's does
    connector: str = KVHEX
    spec: str = "KvhexOffloadingSpec"  # or vLLM's "CPUOffloadingSpec"
    reset_at: int | None = None  # the step that calls scheduler.reset_prefix_cache()
    reset_connector: bool = False  # ... with reset_connector (the API's reset_external)
    max_steps: int = 5000

    def stock(self) -> TraceConfig:
        """The same trace with vLLM's own connector and CPU spec (host memory alone)."""
        return attrs.evolve(self, connector=STOCK, spec="CPUOffloadingSpec", tier=None)


PRESETS = {
    # a file-tier-like tier (indexed lookups): no orphan left in this trace
    "faithful": TraceConfig(),
    # a tier answering lookups by probes (object stores, Valkey): promotion orphans
    "probed": TraceConfig(tier_indexed=False),
    # the GPU's prefix cache reset mid-trace: re-announcement orphans
    "reset": TraceConfig(seed=1, reset_at=300),
    # tier jobs in flight for 8 steps: the GPU, host memory and the tier evict parents
    # meanwhile (cascade and promotion orphans)
    "slow-tier": TraceConfig(
        seed=2,
        users=16,
        turns=8,
        message_tokens=(16, 64),
        think_steps=(0, 6),
        gpu_blocks=128,
        max_seqs=6,
        host_chunks=128,
        tier_chunks=160,
        tier_polls=16,
    ),
    # cascades still in flight when the last request finishes (a slow tier)
    "drain": TraceConfig(users=4, turns=2, output_tokens=(4, 4), tier_polls=60),
}


def extra_config(cfg: TraceConfig, root: Path) -> dict[str, Any]:
    """``kv_connector_extra_config`` as docs/vllm.md writes it for a server."""
    extra: dict[str, Any] = {
        "spec_name": cfg.spec,
        "cpu_bytes_to_use": cfg.host_chunks * PAGE,
        "self_describing_kv_events": True,
    }
    if cfg.spec != "KvhexOffloadingSpec":
        return extra
    extra["eviction_policy"] = "lru"
    extra["kvhex"] = {"loading": {"mode": cfg.load_mode}}
    if cfg.tier == "fs":  # (a 4 KiB header per block)
        entry: dict[str, Any] = {
            "type": "fs",
            "root_dir": str(root / "kv"),
            "kvhex": {"capacity_bytes": cfg.tier_chunks * (PAGE + 4096)},
        }
    elif cfg.tier == "memory":
        entry = {
            "type": "KvhexSecondaryTier",
            "tier": "memory",
            "capacity_bytes": cfg.tier_chunks * PAGE,
            "complete_after_polls": cfg.tier_polls,
            "indexed": cfg.tier_indexed,
        }
    else:
        return extra
    extra["secondary_tiers"] = [{**entry, "enable_kv_events": True}]
    return extra


def vllm_config(cfg: TraceConfig, root: Path) -> VllmConfig:
    """An offline ``VllmConfig``: a tiny Llama's ``config.json``, device "cpu", the
    connector, KV events on (the publisher is replaced)."""
    model_dir = root / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "torch_dtype": "float16",
    }
    (model_dir / "config.json").write_text(json.dumps(hf))
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="float16",
            max_model_len=MAX_MODEL_LEN,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            max_num_batched_tokens=cfg.max_batched_tokens,
            max_num_seqs=cfg.max_seqs,
            async_scheduling=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=cfg.connector,
            kv_role="kv_both",
            kv_connector_extra_config=extra_config(cfg, root),
        ),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
    )
    config.cache_config.num_gpu_blocks = cfg.gpu_blocks  # (the engine sets it from profiling)
    return config


def kv_cache_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group of one layer, ``num_blocks`` blocks of ``PAGE`` bytes."""
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float16)
    tensor = KVCacheTensor(
        size=num_blocks * PAGE, layers=[LAYER], layer_stride=num_blocks * PAGE, block_stride=PAGE
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
    )


class Recorder:
    """Stands in for the scheduler's ``kv_event_publisher``: keeps each batch and its step."""

    def __init__(self) -> None:
        self.step = 0
        self.batches: list[tuple[int, Any]] = []

    def publish(self, batch: Any) -> None:
        self.batches.append((self.step, batch))

    def shutdown(self) -> None:
        pass


# -- the workload, the worker, the model runner ----------------------------------------------
@attrs.define
class _User:
    index: int
    history: list[int]
    turn: int = 0
    ready_at: int = 0
    busy: Request | None = None


class ChatWorkload:
    """Users sharing a system prompt; a turn's prompt is the user's history (prompts and
    outputs so far) plus a new message; the next turn arrives a few steps after."""

    def __init__(self, cfg: TraceConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        system = [rng.randrange(1, VOCAB) for _ in range(cfg.system_tokens)]
        self.users = [_User(u, list(system)) for u in range(cfg.users)]
        self.requests: dict[str, Request] = {}

    @property
    def done(self) -> bool:
        return all(u.turn >= self.cfg.turns and u.busy is None for u in self.users)

    def arrivals(self, step: int) -> list[Request]:
        rng, cfg = self.rng, self.cfg
        out = []
        for user in self.users:
            if user.busy is not None or user.turn >= cfg.turns or user.ready_at > step:
                continue
            message = [rng.randrange(1, VOCAB) for _ in range(rng.randint(*cfg.message_tokens))]
            prompt = (user.history + message)[: MAX_MODEL_LEN - cfg.output_tokens[1] - 1]
            params = SamplingParams(max_tokens=rng.randint(*cfg.output_tokens), ignore_eos=True)
            req = Request(f"u{user.index}-t{user.turn}", prompt, params, None, block_hasher=_HASHER)
            user.busy, user.turn = req, user.turn + 1
            self.requests[req.request_id] = req
            out.append(req)
        return out

    def settle(self, step: int) -> list[str]:
        """The requests that finished (their users' histories grow, next turns wait)."""
        done = []
        for user in self.users:
            req = user.busy
            if req is not None and RequestStatus.is_finished(req.status):
                user.history = list(req.all_token_ids)
                user.busy = None
                user.ready_at = step + 1 + self.rng.randint(*self.cfg.think_steps)
                done.append(req.request_id)
        return done


@attrs.define
class Job:
    """A transfer job of vLLM's connector: its keys (as published hashes) and its steps."""

    job_id: int
    req_id: str
    store: bool
    hashes: tuple[int, ...]
    issued: int
    due: int
    done: int | None = None
    flushed: bool = False
    sync: bool = False


@attrs.frozen
class TierJobDone:
    """A put (cascade) or get (promotion) a kvhex tier finished."""

    submitted: int  # the step it was submitted in (from its latency)
    step: int
    kind: str
    hashes: tuple[int, ...]
    ok: frozenset[int]  # the keys it moved
    req_id: str | None


class FakeWorker:
    """The worker's ``OffloadingConnectorWorker`` as far as the scheduler sees it: each job
    of a step's metadata reported done ``delays`` steps later; flushed jobs and synchronous
    loads in their own step (the worker waits for them before the forward pass); a finished
    asynchronous load also as ``finished_recving``."""

    def __init__(self, scheduler: Scheduler, rng: random.Random, delays: tuple[int, int]):
        connector: Any = scheduler.connector  # vLLM's OffloadingConnector (or kvhex's)
        self.offloading = connector.connector_scheduler
        self.rng = rng
        self.delays = delays
        self.jobs: dict[int, Job] = {}
        self._pending: dict[int, Job] = {}

    def run(self, step: int, meta: Any) -> KVConnectorOutput:
        for job_id, job in [*meta.store_jobs.items(), *meta.load_jobs.items()]:
            status = self.offloading._jobs.get(job_id)  # the keys vLLM gave the job
            hashes = tuple(sorted(ext(k) for k in status.keys)) if status is not None else ()
            sync = bool(getattr(job, "sync", False))  # (0.33's synchronous loads)
            due = step if sync else step + self.rng.randint(*self.delays)
            record = Job(job_id, job.req_id, job_id in meta.store_jobs, hashes, step, due)
            record.sync = sync
            self.jobs[job_id] = self._pending[job_id] = record
        for job_id in meta.jobs_to_flush or ():
            if (pending := self._pending.get(job_id)) is not None:
                pending.due, pending.flushed = step, True
        done = [j for j in self._pending.values() if j.due <= step]
        if not done:
            return KVConnectorOutput()
        for job in done:
            job.done = step
            del self._pending[job.job_id]
        recving = {j.req_id for j in done if not j.store and not j.sync}
        return KVConnectorOutput(
            finished_recving=recving or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(
                completed_jobs={j.job_id: 1 for j in done}
            ),
        )

    @property
    def in_flight(self) -> int:
        return len(self._pending)


def model_output(
    output: Any, requests: dict[str, Request], rng: random.Random, kv: KVConnectorOutput
) -> ModelRunnerOutput:
    """One sampled token per scheduled request past its prefill (a partial prefill's sample
    is discarded, as the model runner does)."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        req = requests[req_id]
        past = req.num_computed_tokens >= req.num_tokens
        sampled.append([rng.randrange(1, VOCAB)] if past else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )


# -- the run ---------------------------------------------------------------------------------
@attrs.define
class Trace:
    """What one run published and did."""

    cfg: TraceConfig
    batches: list[tuple[int, Any]]  # (step, vLLM's KVEventBatch) as published
    jobs: dict[int, Job]
    tier_jobs: list[TierJobDone]
    arrived: dict[str, int]
    finished: dict[str, int]
    steps: int
    notes: dict[str, Any]


class Runner:
    """Steps the scheduler as vLLM's ``EngineCore.step`` does (not while ``has_requests()``
    is False), the workload adding requests as it goes."""

    def __init__(self, cfg: TraceConfig, root: Path) -> None:
        register()
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        config = vllm_config(cfg, root)
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config(cfg.gpu_blocks),
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
        )
        self.recorder = Recorder()
        self.scheduler.kv_event_publisher = cast("Any", self.recorder)  # (duck-typed)
        self.workload = ChatWorkload(cfg, random.Random(rng.random()))
        self.worker = FakeWorker(self.scheduler, random.Random(rng.random()), cfg.delays)
        self.tokens = random.Random(rng.random())
        self.step_no = 0
        self.step_began: list[float] = []  # per step, when it began (tier jobs' steps)
        self.tier_jobs: list[TierJobDone] = []
        self.arrived: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.notes: dict[str, Any] = {}
        if self.kvhex is not None:  # (replaces the observer of vLLM's tier metrics)
            self.kvhex.engine.observe_jobs(self._on_tier_job)

    @property
    def kvhex(self) -> KvhexOffloadingManager | None:
        manager = self.worker.offloading.manager
        return manager if isinstance(manager, KvhexOffloadingManager) else None

    def _on_tier_job(self, index: int, job: Any, result: Any, latency: float) -> None:
        hashes = tuple(ext(k) for k in job.keys)
        ok = hashes if result.success else (ext(k) for k in result.ok_keys or ())
        submitted = bisect.bisect_right(self.step_began, time.perf_counter() - latency) - 1
        req_id = job.ctx.req_id if job.ctx is not None else None
        done = TierJobDone(
            max(submitted, 0), self.step_no, job.kind.value, hashes, frozenset(ok), req_id
        )
        self.tier_jobs.append(done)

    def step(self) -> bool:
        """One engine step; False when the engine would not step (nothing to do)."""
        self.step_began.append(time.perf_counter())
        resetting = self.cfg.reset_at is not None and "reset" not in self.notes
        if resetting and self.step_no >= self.cfg.reset_at:  # type: ignore[operator]
            # (a failed reset still resets the connector: asked once the GPU is idle)
            resetting = self.scheduler.has_unfinished_requests() or not self.reset()
        if not resetting or self.step_no < self.cfg.reset_at:  # type: ignore[operator]
            for req in self.workload.arrivals(self.step_no):
                self.arrived[req.request_id] = self.step_no
                self.scheduler.add_request(req)
        stepping = bool(self.scheduler.has_requests())
        if stepping:
            self.recorder.step = self.step_no
            output = self.scheduler.schedule()
            kv = self.worker.run(self.step_no, output.kv_connector_metadata)
            runner = model_output(output, self.workload.requests, self.tokens, kv)
            self.scheduler.update_from_output(output, runner)
            for req_id in self.workload.settle(self.step_no):
                self.finished[req_id] = self.step_no
        self.step_no += 1
        return stepping

    def reset(self) -> bool:
        """``reset_prefix_cache()`` as the server's API calls it by default, once no request
        is left (until then none is admitted; it fails while a request holds GPU blocks, and
        resets the connector anyway); kvhex's tiers are reset only with ``reset_connector``.
        The GPU pool's ``AllBlocksCleared`` goes out in the next batch.
        (``reset_running_requests=True`` trips an assertion of vLLM 0.32's connector when a
        preempted request is looked up again in the same step: a load job among the jobs it
        flushes; 0.33 fixed it.)"""
        kvhex = self.kvhex
        host = len(kvhex.engine.host_keys()) if kvhex is not None else None
        if not self.scheduler.reset_prefix_cache(reset_connector=self.cfg.reset_connector):
            return False
        self.notes["reset"] = {
            "step": self.step_no,
            "asked_at": self.cfg.reset_at,
            "host_chunks_then": host,
            "vllm_jobs_in_flight": self.worker.in_flight,
        }
        return True

    def run(self) -> Trace:
        while not self.workload.done:
            assert self.step_no < self.cfg.max_steps, "the workload did not finish"
            self.step()
        self.quiesce()
        return Trace(
            self.cfg,
            self.recorder.batches,
            self.worker.jobs,
            self.tier_jobs,
            self.arrived,
            self.finished,
            self.step_no,
            self.notes,
        )

    def quiesce(self) -> None:
        """After the last request finished: step while the engine would, noting each step's
        ``has_requests()``, ``has_pending_push_work()``, vLLM's jobs and kvhex's work; then
        what kvhex still holds back when the engine stops stepping."""
        sched, connector, kvhex = self.scheduler, self.scheduler.connector, self.kvhex
        assert connector is not None
        log = []
        while True:
            state = {
                "step": self.step_no,
                "has_requests": sched.has_requests(),
                "has_pending_push_work": connector.has_pending_push_work(),
                "worker_jobs_in_flight": self.worker.in_flight,
            }
            if kvhex is not None:
                stats = kvhex.engine.stats()
                state["kvhex_pending_work"] = kvhex.engine.has_pending_work()
                state["kvhex_tier_jobs_in_flight"] = sum(t.in_flight for t in stats.tiers)
            log.append(state)
            if not state["has_requests"] or len(log) > 200:
                break
            self.step()
        self.notes["quiesce"] = log
        if kvhex is not None:
            engine = kvhex.engine
            tiers = [PRIMARY_IDENTITY, *(t.identity for t in kvhex.tier_stores)]
            self.notes["kvhex_keys_waiting_for_a_parent"] = sum(
                len(engine.announcer.waiting(t)) for t in tiers
            )
            self.notes["kvhex_host_keys"] = sorted(ext(k) for k in engine.host_keys())


@contextmanager
def tracing(cfg: TraceConfig) -> Iterator[Runner]:
    """A runner over a fresh temporary directory, shut down however the caller ends."""
    with tempfile.TemporaryDirectory(prefix="kvhex-trace-") as tmp:
        runner = Runner(cfg, Path(tmp))
        try:
            yield runner
        finally:
            runner.scheduler.shutdown()


def run_trace(cfg: TraceConfig) -> Trace:
    """One whole run (vLLM's import-time and config warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tracing(cfg) as runner:
            return runner.run()
