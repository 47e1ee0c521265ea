"""The load-or-recompute cost model: fitted tier costs, prefill rate, and the plan's
properties (never a losing load by its own estimate; monotone in latency and prefill speed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhex.domain.cost import (
    LoadPlan,
    LoadWaits,
    PrefillRate,
    TierCost,
    TierEstimate,
    plan_fixed,
    plan_load,
)

CHUNK = 1 << 20
TOKENS = 16.0


def _plan(prefix: list[int | None], estimates: list[TierEstimate | None], rate: float) -> LoadPlan:
    return plan_load(
        prefix, estimates, bytes_per_chunk=CHUNK, tokens_per_chunk=TOKENS, tokens_per_s=rate
    )


def test_a_fit_separates_a_tiers_fixed_cost_from_its_throughput() -> None:
    cost = TierCost()
    assert cost.estimate() is None
    for nbytes in (CHUNK, 4 * CHUNK, 2 * CHUNK, 8 * CHUNK) * 3:
        cost.observe(nbytes, 0.050 + nbytes / 1e9)  # 50 ms a job, 1 GB/s
    estimate = cost.estimate(queued_bytes=2 * CHUNK)
    assert estimate is not None
    assert estimate.latency_s == pytest.approx(0.050, rel=1e-6)
    assert estimate.seconds_per_byte == pytest.approx(1e-9, rel=1e-6)
    assert estimate.queue_s == pytest.approx(2 * CHUNK * 1e-9, rel=1e-6)
    assert estimate.seconds(CHUNK) == pytest.approx(0.050 + 3 * CHUNK * 1e-9, rel=1e-6)


def test_one_job_size_puts_every_second_on_the_bytes() -> None:
    cost = TierCost()
    cost.observe(CHUNK, 0.01)
    cost.observe(CHUNK, 0.03)
    estimate = cost.estimate()
    assert estimate is not None
    assert estimate.latency_s == 0
    assert estimate.seconds(CHUNK) == pytest.approx(0.02, rel=0.05)  # weighted toward recent


def test_recent_jobs_weigh_more_than_old_ones() -> None:
    cost = TierCost(decay=0.5)
    for _ in range(20):
        cost.observe(CHUNK, 0.001)
    for _ in range(20):
        cost.observe(CHUNK, 0.100)  # the tier slowed down
    estimate = cost.estimate()
    assert estimate is not None
    assert estimate.seconds(CHUNK) == pytest.approx(0.100, rel=1e-3)


def test_nonsense_samples_are_ignored() -> None:
    cost = TierCost()
    for nbytes, seconds in ((0, 1.0), (CHUNK, -1.0), (CHUNK, float("nan")), (-5, 0.1)):
        cost.observe(nbytes, seconds)
    assert cost.samples == 0
    with pytest.raises(ValueError, match="decay"):
        TierCost(decay=1.5)


def test_prefill_rate_is_configured_or_measured() -> None:
    rate = PrefillRate()
    assert rate.tokens_per_s is None
    rate.observe(1000, 0.5)
    assert rate.tokens_per_s == 2000
    rate.observe(1000, 1.0)
    assert 1000 < (rate.tokens_per_s or 0) < 2000
    rate.observe(0, 1.0)  # a step that computed nothing says nothing
    assert rate.steps == 2
    assert PrefillRate(configured=500).tokens_per_s == 500
    with pytest.raises(ValueError, match="configured"):
        PrefillRate(configured=0)


def test_a_cold_step_moves_the_measured_prefill_by_one_rank_at_most() -> None:
    rate = PrefillRate()
    rate.observe(1000, 10.0)  # the engine's first step: 100 tokens/s
    for _ in range(2):
        rate.observe(1000, 0.1)
    assert rate.tokens_per_s == 10_000
    for _ in range(20):
        rate.observe(1000, 0.05)
    assert rate.tokens_per_s == 20_000  # only recent steps count


def test_load_waits_are_medians_and_a_promotions_planned_gets_are_taken_out() -> None:
    waits = LoadWaits()
    assert (waits.host_s, waits.promote_s) == (0.0, 0.0)
    for seconds in (0.004, 0.005, 0.300, 0.006):  # one stalled step among them
        waits.observe(seconds, promoted=False)
    assert waits.host_s == pytest.approx(0.0055)
    waits.observe(0.050, promoted=True, planned_get_s=0.040)
    waits.observe(0.010, promoted=True, planned_get_s=0.040)  # faster than planned: 0
    waits.observe(float("nan"), promoted=True)
    assert waits.promote_s == pytest.approx(0.005)


def test_a_loads_wait_makes_a_short_prefix_recomputed_and_a_long_one_loaded() -> None:
    fast = TierEstimate(latency_s=0.0, seconds_per_byte=1e-12)

    def plan(prefix: list[int | None], host: float, promote: float) -> LoadPlan:
        return plan_load(
            prefix,
            [fast],
            bytes_per_chunk=CHUNK,
            tokens_per_chunk=TOKENS,
            tokens_per_s=1000,  # a chunk recomputes in 16 ms
            host_wait_s=host,
            promote_wait_s=promote,
        )

    assert plan([None, None], host=0.0, promote=0.0).load_chunks == 2  # no wait: as before
    assert plan([None, None], host=0.050, promote=0.0).load_chunks == 0  # 50 ms > 32 ms
    assert plan([None] * 4, host=0.050, promote=0.0).load_chunks == 4  # 50 ms < 64 ms
    # a promotion's wait counts from the first secondary chunk on: the host run alone loads
    mixed = plan([None] * 4 + [0] * 2, host=0.010, promote=0.200)
    assert (mixed.load_chunks, mixed.load_s) == (4, 0.010)
    assert plan([None] * 4 + [0] * 20, host=0.010, promote=0.200).loads_all


def test_host_chunks_are_always_loaded_and_a_slow_tier_is_recomputed() -> None:
    slow = TierEstimate(latency_s=2.0, seconds_per_byte=1e-9)
    fast = TierEstimate(latency_s=0.001, seconds_per_byte=1e-10)
    # prefill: 1000 tokens/s, a chunk of 16 tokens recomputes in 16 ms
    plan = _plan([None, None, 0, 0], [slow], 1000)
    assert (plan.load_chunks, plan.prefix_chunks, plan.load_s) == (2, 4, 0)
    plan = _plan([None, None, 0, 0], [fast], 1000)
    assert plan.loads_all
    assert plan.load_s < plan.recompute_s


def test_unknown_costs_load_everything_so_they_get_measured() -> None:
    assert _plan([0, 1, 1], [TierEstimate(9.0, 1.0), None], 1000).loads_all
    assert plan_load(
        [0, 0],
        [TierEstimate(9.0, 1.0)],
        bytes_per_chunk=CHUNK,
        tokens_per_chunk=TOKENS,
        tokens_per_s=None,
    ).loads_all


def test_a_long_prefix_amortizes_a_tiers_latency() -> None:
    tier = [TierEstimate(latency_s=0.1, seconds_per_byte=1e-9)]
    assert _plan([0] * 2, tier, 1000).load_chunks == 0  # 32 ms to save, 100 ms to pay
    assert _plan([0] * 64, tier, 1000).loads_all  # 1 s to save


def test_fixed_threshold_loads_secondary_runs_of_at_least_n_tokens() -> None:
    assert plan_fixed([None, 0, 0], tokens_per_chunk=16, min_tokens=32) == 3
    assert plan_fixed([None, 0, 0], tokens_per_chunk=16, min_tokens=33) == 1
    assert plan_fixed([None, None], tokens_per_chunk=16, min_tokens=10**6) == 2


prefixes = st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=1, max_size=40)
estimates = st.builds(
    TierEstimate,
    latency_s=st.floats(0, 5),
    seconds_per_byte=st.floats(0, 1e-7),
    queue_s=st.floats(0, 1),
)
rates = st.floats(10, 1e6)


@settings(max_examples=300, deadline=None)
@given(
    prefixes, st.lists(estimates, min_size=3, max_size=3), rates, st.floats(0, 1), st.floats(0, 1)
)
def test_a_plan_never_loads_what_costs_more_than_it_saves(
    prefix: list[int | None], tiers: list[TierEstimate], rate: float, host: float, promote: float
) -> None:
    def plan() -> LoadPlan:
        return plan_load(
            prefix,
            list(tiers),
            bytes_per_chunk=CHUNK,
            tokens_per_chunk=TOKENS,
            tokens_per_s=rate,
            host_wait_s=host,
            promote_wait_s=promote,
        )

    made = plan()
    assert 0 <= made.load_chunks <= len(prefix)
    assert made.load_s <= made.recompute_s  # waits included
    assert made == plan()  # deterministic


@settings(max_examples=300, deadline=None)
@given(
    prefixes,
    st.lists(estimates, min_size=3, max_size=3),
    rates,
    st.integers(0, 2),
    st.tuples(st.floats(0, 5), st.floats(0, 1e-7), st.floats(0, 1)),
)
def test_a_slower_tier_never_makes_the_plan_load_more(
    prefix: list[int | None],
    tiers: list[TierEstimate],
    rate: float,
    which: int,
    more: tuple[float, float, float],
) -> None:
    latency, per_byte, queue = more
    slower = list(tiers)
    was = tiers[which]
    slower[which] = TierEstimate(
        was.latency_s + latency, was.seconds_per_byte + per_byte, was.queue_s + queue
    )
    assert _plan(prefix, slower, rate).load_chunks <= _plan(prefix, list(tiers), rate).load_chunks


@settings(max_examples=300, deadline=None)
@given(prefixes, st.lists(estimates, min_size=3, max_size=3), rates, st.floats(1, 100))
def test_a_faster_prefill_never_makes_the_plan_load_more(
    prefix: list[int | None], tiers: list[TierEstimate], rate: float, factor: float
) -> None:
    faster = _plan(prefix, list(tiers), rate * factor).load_chunks
    assert faster <= _plan(prefix, list(tiers), rate).load_chunks
