"""Parent-first KV events on the stream of vLLM's whole scheduler (``sched_trace``).

vLLM's real ``Scheduler`` (0.33 or 0.32: the GPU prefix cache and its events, kvhex's
connector and spec as a server configures them) runs a seeded multi-turn chat workload with no
model; the worker's jobs finish 1-3 steps after their step. Every published batch goes
through ``kvhex events``' ledger: a full ``BlockStored`` whose parent no residency holds is an
orphan, which a radix-tree router (Dynamo's, vllm-router) drops. The target is none.

Each trace is deterministic (kvhex's in-memory tier, load-or-recompute off); a run of the
whole module takes about 10 s. ``python -m tests.vllm.trace_report --preset NAME -v`` prints a
trace's orphans with their parents' histories.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.32 or 0.33 (.venv-vllm, .venv-vllm32)")

from tests.vllm.sched_trace import PRESETS, Trace, run_trace
from tests.vllm.trace_report import replay, report


@functools.cache
def trace(name: str, stock: bool = False) -> Trace:
    cfg = PRESETS[name]
    return run_trace(cfg.stock() if stock else cfg)


def test_the_faithful_trace_has_no_orphan(capsys: pytest.CaptureFixture[str]) -> None:
    """A file-like tier (lookups answered from its index), short tier jobs, no reset: every
    kvhex store reaches the router under a parent it holds (a guard: it holds today)."""
    full = replay(trace("faithful"))
    with capsys.disabled():
        print("\n" + "\n".join(report(trace("faithful"))))
    assert full.stored["CPU"] > 1000
    assert full.stored["STORAGE(LOCAL,-)"] > 1000
    assert full.ledger.consistent, full.ledger.failures()


@pytest.mark.parametrize("name", ["slow-tier", "probed", "reset"])
def test_kvhex_announces_no_store_before_its_parent(name: str) -> None:
    run = trace(name)
    full = replay(run)
    assert not full.orphans, "\n".join(report(run, verbose=True))


def test_vllms_own_connector_beside_kvhex(capsys: pytest.CaptureFixture[str]) -> None:
    """The same trace with vLLM's ``OffloadingConnector`` and ``CPUOffloadingSpec``. With
    the GPU pool's events in the stream (as the scheduler publishes them) both are parent
    first here; without them (a trace of the connector alone) vLLM's tracker announces
    about 40% of its blocks before their parents and kvhex a few percent: the device's
    events are what announces the parents then."""
    kvhex, stock = trace("faithful"), trace("faithful", stock=True)
    with capsys.disabled():
        print("\n" + "\n".join(report(stock)))
    stock_full, stock_alone = replay(stock), replay(stock, gpu=False)
    kvhex_alone = replay(kvhex, gpu=False)
    assert stock_full.stored["CPU"] > 1000
    assert not stock_full.orphans
    share = sum(stock_alone.orphan_blocks().values()) / stock_alone.stored["CPU"]
    kvhex_share = sum(kvhex_alone.orphan_blocks().values()) / sum(kvhex_alone.stored.values())
    assert share > 0.2
    assert kvhex_share < share / 4


def test_the_engine_steps_until_kvhex_published_its_cascades() -> None:
    """The last request finishes with its cascades in flight: ``has_requests()`` stays True
    through kvhex's ``has_pending_push_work()`` until they finish and are announced; nothing
    is left waiting for a parent when the engine stops."""
    run = trace("drain")
    log = run.notes["quiesce"]
    assert log[0]["kvhex_tier_jobs_in_flight"] > 0
    assert all(s["has_requests"] and s["has_pending_push_work"] for s in log[:-1])
    assert log[-1] == {**log[-1], "has_requests": False, "kvhex_pending_work": False}
    assert run.batches[-1][0] == log[-1]["step"] - 1
    assert {e.medium for e in run.batches[-1][1].events} == {"STORAGE"}
    assert run.notes["kvhex_keys_waiting_for_a_parent"] == 0
    assert replay(run).ledger.consistent


def test_after_the_gpus_reset_kvhex_announces_what_it_holds_again() -> None:
    """``reset_prefix_cache()``: the GPU pool's ``AllBlocksCleared`` makes routers forget
    every medium of the publisher; kvhex announces what it still holds again in that batch,
    so no later removal names a block routers forgot and none stays unknown to them.
    (vLLM's own connector does neither: see the stock trace of the same reset.)"""
    full = replay(trace("reset"))
    assert len(full.clears) == 1
    held, again = full.reannounced(0)["STORAGE(LOCAL,-)"]
    # all but the blocks no router could use: those whose parent only the GPU held
    unrooted = full.unrooted(0)
    assert again == held - len(unrooted) > 100
    assert len(unrooted) < held / 20
    assert not full.ledger.unknown_removals
    assert set().union(*full.forgotten().values()) <= unrooted
    assert replay(trace("reset", stock=True)).ledger.unknown_removals
