"""What a KV-aware router makes of a ``sched_trace`` run, and why its orphans are orphans.

``replay`` feeds a trace's batches, encoded as vLLM's ZMQ publisher encodes them and decoded by
kvhex's wire module, into ``kvhex events``' consumer ledger (``StreamLedger``) and notes each
full store whose parent no residency held (an orphan: a radix-tree router drops it);
``replay(gpu=False)`` drops the GPU pool's events first (what a trace of the connector alone
shows). ``diagnose`` tells, for each orphan, where its parent was then: the GPU's, host
memory's and the tier's public history of it, the transfer and tier jobs that moved it and its
child, and a class of cause. ``report`` prints a trace's counts, causes and notes:

    .venv-vllm/bin/python -m tests.vllm.trace_report [--preset faithful|slow-tier|probed|...]
        [--seed N] [--tier fs|memory|none] [--stock] [--jsonl PATH] [-v]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import attrs
import msgspec

from kvhex.adapters.events import wire
from kvhex.cli._ledger import StreamLedger, residency_label
from tests.vllm.sched_trace import PRESETS, Job, TierJobDone, Trace, run_trace

_ENCODER = msgspec.msgpack.Encoder()  # as vLLM's ZmqEventPublisher encodes a batch


# -- what a consumer makes of it -------------------------------------------------------------
@attrs.frozen
class Orphan:
    """A full ``BlockStored`` whose parent no residency held when it arrived (``at``: the
    event's index in the whole stream)."""

    step: int
    at: int
    medium: str
    hashes: tuple[int, ...]
    parent: int


@attrs.define
class Replay:
    """The consumer's ledger of a trace, its orphans, and every hash's public history."""

    ledger: StreamLedger
    orphans: list[Orphan]
    stored: Counter[str]  # blocks announced stored, per medium
    history: dict[int, list[tuple[int, int, str]]]  # hash -> (step, at, "GPU+" / "CPU-")
    clears: list[tuple[int, int]]  # (step, at) of each AllBlocksCleared
    lost: list[dict[str, set[int]]]  # per clear, what offload residencies announced then
    router: dict[str, set[int]]  # per offload residency, what a consumer holds at the end
    unforgotten: dict[str, set[int]]  # ... had AllBlocksCleared forgotten no offload block
    # (kvhex announces a block once per residency, so sets are exact)
    parents: dict[int, int | None]  # each full block's parent, as last announced

    def unrooted(self, index: int) -> set[int]:
        """Of the offload blocks held when clear ``index`` came, those whose chain of parents
        leaves what the offload residencies held before it reaches a first block: a router
        can never use them (no parent), and kvhex leaves them out of its announcement."""
        held = set().union(*self.lost[index].values())
        rooted: dict[int, bool] = {}

        def reaches_root(block: int) -> bool:
            chain = []
            while block not in rooted:
                parent = self.parents.get(block)
                if parent is None or parent not in held:
                    rooted[block] = parent is None
                    break
                chain.append(block)
                block = parent
            for b in chain:
                rooted[b] = rooted[block]
            return rooted[block]

        return {b for b in held if not reaches_root(b)}

    def orphan_blocks(self) -> Counter[str]:
        """Blocks in orphan stores (a chain's blocks all hang under its missing parent)."""
        out: Counter[str] = Counter()
        for orphan in self.orphans:
            out[orphan.medium] += len(orphan.hashes)
        return out

    def reannounced(self, index: int) -> dict[str, tuple[int, int]]:
        """Per offload residency, of the blocks it announced when clear ``index`` made
        consumers forget them: how many, and how many it announced again in that batch."""
        step, at = self.clears[index]
        out = {}
        for label, held in self.lost[index].items():
            medium = label.split("(")[0] + "+"
            again = sum(
                any(s == step and w > at and what == medium for s, w, what in self.history[h])
                for h in held
            )
            out[label] = (len(held), again)
        return out

    def forgotten(self) -> dict[str, set[int]]:
        """Per offload residency, blocks announced and never taken back that a consumer
        forgot at an ``AllBlocksCleared`` and was never told of again."""
        return {m: held - self.router.get(m, set()) for m, held in self.unforgotten.items()}


def replay(trace: Trace, *, gpu: bool = True) -> Replay:
    """Feed the trace's batches, as bytes on vLLM's wire, to ``kvhex events``' ledger
    (without the GPU pool's events unless ``gpu``: what a connector-only trace shows)."""
    ledger = StreamLedger(expected_first=0)
    orphans: list[Orphan] = []
    stored: Counter[str] = Counter()
    history: dict[int, list[tuple[int, int, str]]] = defaultdict(list)
    clears: list[tuple[int, int]] = []
    lost: list[dict[str, set[int]]] = []
    router: dict[str, set[int]] = defaultdict(set)
    unforgotten: dict[str, set[int]] = defaultdict(set)
    parents: dict[int, int | None] = {}
    at = 0
    for seq, (step, batch) in enumerate(trace.batches):
        ledger.batch(seq)
        for event in wire.decode_batch(_ENCODER.encode(batch)).events:
            if not gpu and getattr(event, "medium", "GPU") == "GPU":
                continue  # (AllBlocksCleared names no medium: the GPU pool's)
            at += 1
            before = sum(ledger.orphan_stores.values())
            ledger.event(event)
            if isinstance(event, wire.AllBlocksCleared):
                clears.append((step, at))
                lost.append({m: set(held) for m, held in unforgotten.items() if held})
                router.clear()
                continue
            hashes = tuple(int(h) for h in event.block_hashes)
            stores = isinstance(event, wire.BlockStored)
            for h in hashes:
                history[h].append((step, at, f"{event.medium}{'+' if stores else '-'}"))
            label = residency_label(event.medium, event.locality, event.ownership)
            if event.medium != "GPU":
                for view in (router, unforgotten):
                    (view[label].update if stores else view[label].difference_update)(hashes)
            if isinstance(event, wire.BlockStored):
                stored[label] += len(hashes)
                if event.token_ids:  # full: each block's parent is the one before it
                    first = event.parent_block_hash
                    ups = [None if first is None else int(first), *hashes[:-1]]
                    parents.update(zip(hashes, ups, strict=True))
                if sum(ledger.orphan_stores.values()) > before:
                    parent = int(event.parent_block_hash)  # type: ignore[arg-type]
                    orphans.append(Orphan(step, at, label, hashes, parent))
    return Replay(
        ledger,
        orphans,
        stored,
        dict(history),
        clears,
        lost,
        dict(router),
        dict(unforgotten),
        parents,
    )


# -- why ------------------------------------------------------------------------------------
def residency_at(replay: Replay, block: int, medium: str, at: int) -> str:
    """Where ``block`` stood in ``medium`` just before stream event ``at``: ``held +S``,
    ``gone +S -R``, ``cleared +S xC`` (forgotten at an ``AllBlocksCleared`` in step C and
    not announced again), or ``never``."""
    stored: tuple[int, int] | None = None
    removed = None
    for step, when, what in replay.history.get(block, ()):
        if when >= at:
            break
        if what == medium + "+":
            stored, removed = (step, when), None
        elif what == medium + "-" and stored is not None:
            removed = step
    if stored is None:
        return "never"
    if removed is not None:
        return f"gone +{stored[0]} -{removed}"
    cleared = [step for step, when in replay.clears if stored[1] < when < at]
    return f"cleared +{stored[0]} x{cleared[0]}" if cleared else f"held +{stored[0]}"


@attrs.frozen
class Diagnosis:
    """One orphan, the class of its cause, and the history that tells it."""

    orphan: Orphan
    cause: str
    lines: tuple[str, ...]


def diagnose(trace: Trace, replay: Replay) -> list[Diagnosis]:
    """Each orphan with its parent's history and the class of its cause."""
    return [_diagnose(trace, replay, o) for o in replay.orphans]


def _job_text(job: Job) -> str:
    kind = "host store" if job.store else "load"
    done = "not yet" if job.done is None else str(job.done)
    flush = " (flushed)" if job.flushed else ""
    return f"vLLM {kind} job {job.job_id} of {job.req_id}: issued {job.issued}, done {done}{flush}"


def _tier_text(job: TierJobDone, block: int) -> str:
    what = {"put": "put (cascade)", "get": "get (promotion)"}.get(job.kind, job.kind)
    moved = "moved it" if block in job.ok else "FAILED for it"
    return (
        f"tier {what} of {job.req_id}, {len(job.hashes)} keys: submitted {job.submitted}, "
        f"done {job.step}, {moved}"
    )


def _diagnose(trace: Trace, replay: Replay, orphan: Orphan) -> Diagnosis:
    parent, child, step, at = orphan.parent, orphan.hashes[0], orphan.step, orphan.at
    where = {m: residency_at(replay, parent, m, at) for m in ("GPU", "CPU", "STORAGE")}
    jobs = sorted(trace.jobs.values(), key=lambda j: j.issued)
    p_jobs = [j for j in jobs if parent in j.hashes and j.issued <= step]
    c_jobs = [j for j in jobs if child in j.hashes and j.issued <= step]
    p_tier = [t for t in trace.tier_jobs if parent in t.hashes and t.submitted <= step]
    c_tier = [t for t in trace.tier_jobs if child in t.hashes and t.step <= step]
    # what brought the child into its medium: the last job that moved it there by now
    via: Job | TierJobDone | None
    if orphan.medium == "CPU":
        stores = [j for j in c_jobs if j.store and j.done is not None and j.done <= step]
        gets = [t for t in c_tier if t.kind == "get" and child in t.ok]
        moved: list[Job | TierJobDone] = [*stores, *gets]
        via = max(moved, key=_done_step, default=None)
    else:
        via = next((t for t in reversed(c_tier) if t.kind == "put" and child in t.ok), None)
    lines = [
        f"step {step}: {orphan.medium} store of {len(orphan.hashes)} block(s) from "
        f"{child:#x}, parent {parent:#x}",
        "  parent just before: " + ", ".join(f"{m} {s}" for m, s in where.items()),
        *(f"  parent: {_job_text(j)}" for j in p_jobs),
        *(f"  parent: {_tier_text(t, parent)}" for t in p_tier),
        *(f"  child: {_job_text(j)}" for j in c_jobs),
        *(f"  child: {_tier_text(t, child)}" for t in c_tier),
    ]
    if via is not None and (req := via.req_id) is not None:
        finished = trace.finished.get(req, "not yet")
        lines.append(f"  request {req}: arrived {trace.arrived.get(req)}, finished {finished}")
    medium = orphan.medium.split("(")[0]
    again = any(what == medium + "+" and s < step for s, _, what in replay.history.get(child, ()))
    if again and any(c_step == step and c_at < at for c_step, c_at in replay.clears):
        # held before the clear, announced again after it: was its parent too, later?
        later = any(s == step and w > at for s, w, _ in replay.history.get(parent, ()))
        cause = _after_clear(where, later)
    else:
        cause = _parent_cause(step, where, via, parent=parent, p_jobs=p_jobs, p_tier=p_tier)
        cause = f"{_via(via)}: {cause}"
    return Diagnosis(orphan, cause, tuple(lines))


def _done_step(job: Job | TierJobDone) -> int:
    return (job.done or 0) if isinstance(job, Job) else job.step


def _after_clear(where: dict[str, str], parent_later: bool) -> str:
    if parent_later:
        return "re-announced after AllBlocksCleared before its parent (announced later)"
    held = any(where[m].startswith(("held", "cleared")) for m in ("CPU", "STORAGE"))
    lost = "dropped it in" if held else "had dropped it before"
    return (
        "re-announced after AllBlocksCleared, parent held nowhere (the GPU cleared it, "
        f"kvhex's tiers {lost} the step of the clear)"
    )


def _via(via: Job | TierJobDone | None) -> str:
    if isinstance(via, Job):
        return "host store"
    if via is None:
        return "unknown job"
    return "promotion" if via.kind == "get" else "cascade"


def _parent_cause(
    step: int,
    where: dict[str, str],
    via: Job | TierJobDone | None,
    *,
    parent: int,
    p_jobs: list[Job],
    p_tier: list[TierJobDone],
) -> str:
    """Where the parent was when its child went out, the first that applies."""
    gpu = where["GPU"]
    gpu_text = "GPU never had it" if gpu == "never" else f"GPU: {gpu.split()[0]}"
    gone = [m for m in ("CPU", "STORAGE") if where[m].startswith("gone")]
    failed_get = (
        isinstance(via, TierJobDone)
        and via.kind == "get"
        and parent in via.hashes
        and parent not in via.ok
    )
    causes = [
        (
            any(where[m].startswith("cleared") for m in ("CPU", "STORAGE")),
            "parent held by kvhex, forgotten at AllBlocksCleared",
        ),
        (failed_get, "the same get failed for the parent"),
        (
            any(j.store and (j.done is None or j.done > step) for j in p_jobs),
            "parent's host store still in flight",
        ),
        (
            any(t.kind == "put" and t.step > step for t in p_tier),
            "parent's cascade still in flight",
        ),
        (not gone, "parent never offloaded"),
        (not gpu.startswith("gone"), f"parent evicted from {' and '.join(gone)}"),
    ]
    for applies, text in causes:
        if applies:
            return f"{text} ({gpu_text})"
    began = via.issued if isinstance(via, Job) else via.submitted if via is not None else step
    last = max(int(state.rsplit("-", 1)[1]) for state in [gpu, *(where[m] for m in gone)])
    when = "while the job was in flight" if last >= began else "before the job began"
    return f"parent evicted from {' and '.join(gone)} and the GPU, the last {when}"


# -- the report ------------------------------------------------------------------------------
def report(trace: Trace, *, verbose: bool = False) -> list[str]:
    """A trace's orphan counts (with and without the GPU's events), their causes, and the
    quiesce and reset notes."""
    full, alone = replay(trace), replay(trace, gpu=False)
    cfg = trace.cfg
    out = [
        f"{cfg.connector} + {cfg.spec} (tier {cfg.tier}, seed {cfg.seed}): {trace.steps} steps, "
        f"{len(trace.arrived)} requests, {len(trace.batches)} batches",
        f"  blocks stored: {dict(full.stored)}",
        f"  orphan stores (events/blocks): {dict(full.ledger.orphan_stores)} / "
        f"{dict(full.orphan_blocks())}",
        f"  without the GPU's events: {dict(alone.ledger.orphan_stores)} / "
        f"{dict(alone.orphan_blocks())}",
        f"  ledger: {full.ledger.failures() or 'consistent'}",
    ]
    if full.clears:
        forgotten = {m: len(b) for m, b in full.forgotten().items()}
        for index, (step, _) in enumerate(full.clears):
            again = full.reannounced(index)
            out.append(f"  AllBlocksCleared at step {step}: (held, announced again) {again}")
        out.append(f"  forgotten by consumers and still held at the end: {forgotten}")
        out.append(f"  reset: {trace.notes.get('reset')}")
    causes = Counter(d.cause for d in diagnose(trace, full))
    out += [f"  {n:4d} x {cause}" for cause, n in causes.most_common()]
    if verbose:
        for d in diagnose(trace, full):
            out += [d.cause, *d.lines]
    return out + _quiesce_lines(trace)


def _quiesce_lines(trace: Trace) -> list[str]:
    log = trace.notes["quiesce"]
    first, last = log[0], log[-1]
    stepping = [s for s in log if s["has_requests"]]
    pushing = [s for s in stepping if s["has_pending_push_work"]]
    tier_jobs = max((s.get("kvhex_tier_jobs_in_flight", 0) for s in log), default=0)
    last_batch = trace.batches[-1][0] if trace.batches else None
    return [
        f"  after the last request finished (step {first['step']}): {len(stepping)} more "
        f"step(s), {len(pushing)} kept by has_pending_push_work() (kvhex tier jobs in flight "
        f"up to {tier_jobs}); last batch published in step {last_batch}",
        f"  when the engine stopped (step {last['step']}): {last}; kvhex keys waiting for a "
        f"parent: {trace.notes.get('kvhex_keys_waiting_for_a_parent')}",
    ]


def write_jsonl(trace: Trace, path: Path) -> None:
    """The published stream as ``kvhex events FILE`` reads it (one batch a line)."""
    with path.open("w", encoding="utf-8") as out:
        for seq, (_, batch) in enumerate(trace.batches):
            events = [{"type": type(e).__name__, **msgspec.structs.asdict(e)} for e in batch.events]
            line = {"seq": seq, "ts": batch.ts, "data_parallel_rank": 0, "events": events}
            out.write(json.dumps(line) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="faithful")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--tier", choices=["fs", "memory", "none"])
    parser.add_argument("--reset-at", type=int)
    parser.add_argument("--reset-connector", action="store_true")
    parser.add_argument("--stock", action="store_true", help="vLLM's connector and CPU spec")
    parser.add_argument("--jsonl", type=Path, help="write the stream for `kvhex events FILE`")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    cfg = PRESETS[args.preset]
    if args.seed is not None:
        cfg = attrs.evolve(cfg, seed=args.seed)
    if args.tier is not None:
        cfg = attrs.evolve(cfg, tier=None if args.tier == "none" else args.tier)
    if args.reset_at is not None:
        cfg = attrs.evolve(cfg, reset_at=args.reset_at, reset_connector=args.reset_connector)
    trace = run_trace(cfg.stock() if args.stock else cfg)
    print("\n".join(report(trace, verbose=args.verbose)))
    if args.jsonl is not None:
        write_jsonl(trace, args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
