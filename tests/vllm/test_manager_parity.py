"""kvhex's manager against vLLM 0.33's own ``CPUOffloadingManager``, call for call.

Both managers get the same calls (stores, completions, failures, loads, touches, lookups) and
must answer the same: lookup results, which keys are stored and into which host slots, which
keys LRU evicts, and the events with their order. Where kvhex deliberately differs, a test
below pins the difference and says why.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")

from vllm.v1.kv_offload.base import OffloadingEvent, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvhex.vllm import KvhexOffloadingManager, KvhexOffloadingSpec
from kvhex.vllm._compat import VLLM_VERSION
from tests.vllm.helpers import PAGE, key, offloading_config


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, KvhexOffloadingManager]]:
    """(vLLM's CPU manager, kvhex's manager) over the same number of host chunks."""
    chunks, threshold, tracker = getattr(request, "param", (6, 0, 64_000))
    extra = {
        "cpu_bytes_to_use": chunks * PAGE,
        "store_threshold": threshold,
        "max_tracker_size": tracker,
    }
    spec = KvhexOffloadingSpec(offloading_config(extra))
    ours = spec.get_manager()
    assert isinstance(ours, KvhexOffloadingManager)
    theirs = CPUOffloadingManager(
        num_chunks=chunks,
        cache_policy="lru",
        enable_events=True,
        store_threshold=threshold,
        max_tracker_size=tracker,
    )
    yield theirs, ours
    ours.shutdown()


def _events(events: Any) -> list[tuple[list[bytes], str, bool]]:
    return [(list(e.keys), e.medium.value, e.removed) for e in events]


def _vllm_events(events: Any) -> list[tuple[list[bytes], str, bool]]:
    # vLLM 0.33 announces a failed store as a "metadata only" removal that its tracker
    # consumes silently (never published); kvhex announces nothing for a failed store
    return _events(
        e
        for e in events
        if not (isinstance(e, OffloadingEvent) and getattr(e, "metadata_only", False))
    )


def _store(m: Any, keys: list[bytes], ctx: ReqContext) -> Any:
    out = m.prepare_store(keys, ctx)
    if out is None:
        return None
    return (list(out.keys_to_store), out.store_spec.block_ids.tolist(), list(out.evicted_keys))


def test_eviction_is_announced_before_the_store_that_reuses_the_slot(pair: Any) -> None:
    theirs, ours = pair
    for m in (theirs, ours):
        ctx = ReqContext("r")
        m.on_new_request(ctx)
        assert _store(m, [key(i) for i in range(6)], ctx) is not None
        m.complete_store([key(i) for i in range(6)], ctx)
        list(m.take_events())
        assert _store(m, [key(10), key(11)], ctx) == ([key(10), key(11)], [1, 0], [key(0), key(1)])
        m.complete_store([key(10), key(11)], ctx)
    assert _events(ours.take_events()) == _vllm_events(theirs.take_events())


def test_offered_keys_already_stored_are_never_evicted_for_the_others(pair: Any) -> None:
    theirs, ours = pair
    results = []
    for m in (theirs, ours):
        ctx = ReqContext("r")
        m.on_new_request(ctx)
        _store(m, [key(i) for i in range(6)], ctx)
        m.complete_store([key(i) for i in range(6)], ctx)
        m.touch([key(0)], ctx)
        results.append(_store(m, [key(1), key(20), key(21)], ctx))
        results.append(m.lookup(key(1), ctx))
    assert results[0] == results[2]
    assert results[0] == ([key(20), key(21)], [3, 2], [key(2), key(3)])
    assert results[1] == results[3]


@pytest.mark.parametrize(
    "pair",
    [(6, 0, 64_000), (4, 0, 64_000), (6, 2, 4), (3, 2, 64_000)],
    indirect=True,
    ids=["lru-6", "lru-4", "threshold-2-tracker-4", "threshold-2-small"],
)
@pytest.mark.parametrize("seed", range(12))
def test_random_call_sequences_give_equal_answers_slots_evictions_and_events(
    pair: Any, seed: int
) -> None:
    """Seeded random sequences over 14 keys: every answer, slot, eviction and event equal."""
    theirs, ours = pair
    rng = random.Random(seed)
    contexts = [(ReqContext(f"r{i}"), ReqContext(f"r{i}")) for i in range(4)]
    for vctx, kctx in contexts:
        theirs.on_new_request(vctx)
        ours.on_new_request(kctx)
    pending: list[list[bytes]] = []
    loaded: list[list[bytes]] = []
    for step in range(80):
        which = rng.randrange(len(contexts))
        vctx, kctx = contexts[which]
        op = rng.random()
        if op < 0.35:
            keys = rng.sample([key(i) for i in range(14)], rng.randint(1, 4))
            got = (_store(theirs, keys, vctx), _store(ours, keys, kctx))
            assert got[0] == got[1], f"step {step}: prepare_store({keys})"
            if got[0] is not None and got[0][0]:
                pending.append(got[0][0])
        elif op < 0.6 and pending:
            keys = pending.pop(rng.randrange(len(pending)))
            success = rng.random() < 0.8
            theirs.complete_store(keys, vctx, success)
            ours.complete_store(keys, kctx, success)
        elif op < 0.72:
            hits = [key(i) for i in range(14) if theirs.lookup(key(i), vctx).name == "HIT"]
            if hits:
                keys = rng.sample(hits, rng.randint(1, len(hits)))
                a = theirs.prepare_load(keys, vctx).block_ids.tolist()
                b = ours.prepare_load(keys, kctx).block_ids.tolist()
                assert a == b, f"step {step}: prepare_load"
                loaded.append(keys)
        elif op < 0.82 and loaded:
            keys = loaded.pop(rng.randrange(len(loaded)))
            theirs.complete_load(keys, vctx)
            ours.complete_load(keys, kctx)
        else:
            keys = rng.sample([key(i) for i in range(14)], rng.randint(1, 5))
            theirs.touch(keys, vctx)
            ours.touch(keys, kctx)
        for i in range(14):
            assert theirs.lookup(key(i), vctx) == ours.lookup(key(i), kctx), f"step {step}"
        if rng.random() < 0.3:
            assert _events(ours.take_events()) == _vllm_events(theirs.take_events())
    assert _events(ours.take_events()) == _vllm_events(theirs.take_events())


def test_deliberate_difference_a_failed_store_announces_nothing(pair: Any) -> None:
    """vLLM 0.33 appends a metadata-only removal for a failed store (its tracker drops the
    payload it snapshotted at lookup time); vLLM 0.32 announces nothing, like kvhex. kvhex
    keeps no snapshot: the context rides the job, so there is nothing to drop and nothing is
    announced."""
    theirs, ours = pair
    for m in (theirs, ours):
        ctx = ReqContext("r")
        m.on_new_request(ctx)
        _store(m, [key(1)], ctx)
        m.complete_store([key(1)], ctx, success=False)
    vllm_events = list(theirs.take_events())
    expected = [] if VLLM_VERSION == (0, 32) else [True]
    assert [e.metadata_only for e in vllm_events] == expected
    assert list(ours.take_events()) == []


def test_deliberate_difference_lru_ignores_request_positions_and_finish(pair: Any) -> None:
    """vLLM 0.33's LRU ranks a request's chunks by their token positions (a request's tail is
    evicted before its head) and refreshes them when the request finishes. kvhex's LRU orders
    by store and touch only: its eviction-policy port receives no positions (a policy that
    wants them is a kvhex.policies entry point away). Same calls, different victim:"""
    theirs, ours = pair
    victims = []
    for m in (theirs, ours):
        first, second = ReqContext("a"), ReqContext("b")
        for ctx in (first, second):
            m.on_new_request(ctx)
        for i in range(3):
            first.set_offload_key_position(key(i), 16 * (i + 1))
        _store(m, [key(0), key(1), key(2)], first)
        m.complete_store([key(0), key(1), key(2)], first)
        _store(m, [key(3), key(4), key(5)], second)
        m.complete_store([key(3), key(4), key(5)], second)
        m.on_request_finished(first)
        victims.append(_store(m, [key(9)], second))
    assert victims[0] is not None
    assert victims[1] is not None
    assert victims[0][2] == [key(3)]  # vLLM: request a's finish made its chunks recent
    assert victims[1][2] == [key(0)]  # kvhex: the oldest store goes first


def test_vllm_objects_are_built_by_position_only_in_the_field_order_vllm_declares() -> None:
    """``take_events`` and ``prepare_store`` build vLLM's dataclasses by position (keywords
    cost up to 80% more per object) only where vLLM declares these fields first and in this
    order; elsewhere by keyword. Both give vLLM's object, field for field."""
    import dataclasses

    from vllm.v1.kv_offload.base import Locality, Medium, PrepareStoreOutput

    from kvhex.vllm import _convert

    fields = ("keys", "medium", "removed", "locality", "ownership", "removal_expected")
    values = ([key(1), key(2)], Medium.STORAGE, True, Locality.LOCAL, "files", True)
    expected = OffloadingEvent(**dict(zip(fields, values, strict=True)))
    assert _convert._offloading_event(*values) == expected
    assert _convert.by_position(OffloadingEvent, fields) is OffloadingEvent
    swapped = ("medium", "keys", "removed", "locality", "ownership", "removal_expected")
    by_keyword = _convert.by_position(OffloadingEvent, swapped)
    assert by_keyword is not OffloadingEvent
    assert by_keyword(Medium.STORAGE, [key(1), key(2)], *values[2:]) == expected
    output = ("keys_to_store", "store_spec", "evicted_keys")
    assert _convert.by_position(PrepareStoreOutput, output) is PrepareStoreOutput
    declared = tuple(f.name for f in dataclasses.fields(PrepareStoreOutput))
    assert declared[:3] == output
