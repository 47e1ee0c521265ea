"""``LoadDecider``: per request, load the matched prefix or recompute it (``domain.cost``).

The scheduler asks for a request's chunks one by one, in prefix order, and asks again every
step while any answer defers. With a mode other than ``OFF``, a chunk a secondary tier holds
is not promoted at its first lookup: the lookup answers ``RETRY`` and the chunk joins the
request's *scan* for this step (the chunks from the first such hit on, host ones included,
until the scan meets a miss). At step end every complete scan (no tier still probing) gets a
plan: the chunks before its cut are promoted (in the same step end, so nothing waits longer
than it did), the ones from the cut on answer ``MISS`` to that request from then on, so the
engine recomputes them.

Estimates: each tier's ``TierCost`` (its driver fits every finished get), the engine's
``PrefillRate`` (measured by the host engine's adapter, or configured). A tier judged too
slow would never be measured again, so every ``explore_every``-th plan that recomputes a
tier's chunks loads them instead (counted as ``explored``).

The decider keeps the scans and the decisions; its owner (``TieringManager``) reports each
lookup (``note_host``, ``note_tier``, ``close_scan``) and starts the promotions ``plan``
returns. Threading: the scheduler thread only; nothing blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from kvhex.domain.cost import (
    LoadMode,
    LoadPlan,
    LoadWaits,
    PrefillRate,
    TierEstimate,
    plan_fixed,
    plan_load,
)
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import LookupResult
from kvhex.service.stats import LoadStats

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


@attrs.define(eq=False)
class Scan:
    """One request's lookups this step, from its first secondary-tier hit on."""

    keys: list[OffloadKey] = attrs.field(factory=list)
    tiers: list[int | None] = attrs.field(factory=list)
    """The tier holding each key (``None``: host memory)."""
    complete: bool = True
    """False when a tier was still probing a key: no plan this step."""
    closed: bool = False
    """A miss ended the prefix: later lookups this step are another pass."""
    _seen: set[OffloadKey] = attrs.field(factory=set)

    def add(self, key: OffloadKey, tier: int | None) -> None:
        """The next key of the prefix (a key seen already starts another pass: ignored)."""
        if not self.closed and key not in self._seen:
            self._seen.add(key)
            self.keys.append(key)
            self.tiers.append(tier)


class LoadDecider:
    """Collects scans during a step and plans them at its end."""

    def __init__(
        self,
        mode: LoadMode,
        *,
        min_tokens: int = 0,
        prefill: PrefillRate | None = None,
        tokens_per_key: float | None = None,
        explore_every: int = 64,
    ) -> None:
        """Args:
        mode: ``OFF`` (promote every hit at once), ``AUTO`` or ``FIXED``.
        min_tokens: ``FIXED``: the tokens a request's secondary-tier chunks must hold to be
            loaded.
        prefill: the engine's prefill speed (measured unless configured).
        tokens_per_key: tokens one offload key saves from recomputing (the chunk's tokens
            divided by the KV groups sharing them); unknown (``None``): plans load all.
        explore_every: ``AUTO``: every n-th plan that recomputes a tier's chunks loads them.
        """
        if explore_every < 1:
            raise ValueError(f"explore_every must be at least 1, got {explore_every}")
        self.mode = mode
        self.min_tokens = min_tokens
        self.prefill = prefill or PrefillRate()
        self.tokens_per_key = tokens_per_key
        self.explore_every = explore_every
        self.stats = LoadStats()
        self.waits = LoadWaits()
        """What loads cost requests in engine steps (measured by the engine's adapter)."""
        self.busy = False
        """Other requests are in the engine (as the last ``plan_ahead`` was told): its steps
        run for them anyway, so a load's steps cost the engine nothing and recomputing
        costs every request in the batch its prefill; plans then count no wait."""
        self._scans: dict[ReqContext, Scan] = {}
        self._decided: dict[ReqContext, dict[OffloadKey, bool]] = {}
        self._planned_get_s: dict[ReqContext, float] = {}
        self._declined: dict[ReqContext, set[OffloadKey]] = {}
        self.host_declined: Mapping[ReqContext, set[OffloadKey]] = MappingProxyType(self._declined)
        """Per request, the host-memory keys its plan recomputes (read-only, live; empty
        while no plan declined a host chunk): the owner answers their lookups ``MISS``."""
        self._recomputes: dict[int, int] = {}
        self.open_scans: Mapping[ReqContext, Scan] = MappingProxyType(self._scans)
        """The scans open this step, read-only and live: empty while no request's lookup
        met a secondary-tier hit (the owner's host hits test it before ``note_host``)."""

    @property
    def active(self) -> bool:
        """Whether lookups go through scans (any mode but ``OFF``)."""
        return self.mode is not LoadMode.OFF

    def set_mode(self, mode: LoadMode) -> None:
        """Decide as ``mode`` says from now on; the scans open this step go (decisions
        already taken for active requests stand)."""
        self.mode = mode
        self._scans.clear()

    def set_geometry(self, geometry: KvGeometry | None) -> None:
        """Count the tokens a key saves from ``geometry`` (the model's KV groups: a chunk's
        tokens divided by the groups sharing them); ``None`` or no groups changes nothing."""
        if geometry is not None and geometry.groups:
            groups = geometry.groups
            chunk_tokens = sum(g.tokens_per_block * g.blocks_per_chunk for g in groups)
            self.tokens_per_key = chunk_tokens / len(groups) ** 2

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` tokens in ``seconds`` (one step)."""
        self.prefill.observe(tokens, seconds)

    # -- the step's scans (the owner reports each lookup) ---------------------------------
    def note_host(self, key: OffloadKey, ctx: ReqContext) -> None:
        """``ctx``'s lookup found ``key`` in host memory: part of its open scan, if any."""
        if (scan := self._scans.get(ctx)) is not None:
            scan.add(key, None)

    def note_tier(self, key: OffloadKey, ctx: ReqContext, tier: int) -> LookupResult:
        """Secondary tier ``tier`` holds ``key`` for ``ctx``: ``HIT`` when ``ctx`` decided to
        load it (promote it now), ``MISS`` when it decided to recompute it, else ``RETRY``:
        the key joined ``ctx``'s scan, to be planned at step end."""
        decided = self._decided.get(ctx)
        if decided is not None and key in decided:
            return _HIT if decided[key] else _MISS
        if (scan := self._scans.get(ctx)) is None:
            scan = self._scans[ctx] = Scan()
        scan.add(key, tier)
        return _RETRY

    def close_scan(self, ctx: ReqContext, *, probing: bool) -> None:
        """No tier holds the key ``ctx`` looked up: with a tier still ``probing`` it, the
        scan cannot be planned this step; otherwise the prefix ends there."""
        if (scan := self._scans.get(ctx)) is not None:
            if probing:
                scan.complete = False
            else:
                scan.closed = True

    def plan_scans(
        self, estimates: Sequence[TierEstimate | None], bytes_per_key: int
    ) -> list[tuple[ReqContext, OffloadKey, int]]:
        """Step end: plan every complete scan (the others wait for a later step), remember
        what it decided, and close every scan. Returns the promotions to start, as (request,
        key, tier), in scan order."""
        promotions = []
        for ctx, scan in self._scans.items():
            if not scan.complete:
                continue  # a tier is still probing part of it: the next step's scan
            for key, tier in self._decide(ctx, scan, estimates, bytes_per_key):
                promotions.append((ctx, key, tier))
        self._scans.clear()
        return promotions

    def has_decided(self, ctx: ReqContext) -> bool:
        """Whether a plan was made for ``ctx`` (its decisions stand until it finishes)."""
        return ctx in self._decided

    def decide_now(
        self,
        ctx: ReqContext,
        keys: Sequence[OffloadKey],
        tiers: Sequence[int | None],
        estimates: Sequence[TierEstimate | None],
        bytes_per_key: int,
    ) -> None:
        """Plan ``ctx``'s matched prefix before the scheduler looks it up: ``keys`` in
        lookup order, each held by host memory (``None``) or the secondary tier ``tiers``
        names, all known now. The lookups that follow answer as decided (a promotion or a
        miss at once), so the request waits no step for a plan. Nothing when ``ctx``
        decided already (its decisions stand), or when host memory holds every key and a
        load's step is not worth weighing (not ``AUTO``, a busy engine, no wait measured)."""
        if ctx in self._decided:
            return
        if all(t is None for t in tiers) and (
            self.mode is not LoadMode.AUTO or self.busy or not self.waits.host_s
        ):
            return  # a host prefix is loaded unless an idle engine's load step costs more
        scan = Scan(list(keys), list(tiers))
        self._decide(ctx, scan, estimates, bytes_per_key)
        self._scans.pop(ctx, None)

    def _decide(
        self,
        ctx: ReqContext,
        scan: Scan,
        estimates: Sequence[TierEstimate | None],
        bytes_per_key: int,
    ) -> list[tuple[OffloadKey, int]]:
        """Plan ``scan`` and remember it for ``ctx``; the keys to promote, with their tier."""
        cut = self.plan(scan, estimates, bytes_per_key)
        decided = self._decided.setdefault(ctx, {})
        loads = []
        for i, (key, tier) in enumerate(zip(scan.keys, scan.tiers, strict=True)):
            if tier is not None:
                decided[key] = i < cut
                if i < cut:
                    loads.append((key, tier))
            elif i >= cut:
                self._declined.setdefault(ctx, set()).add(key)
        if loads:
            waited = 0.0 if self.busy else self.waits.promote_s
            self._planned_get_s[ctx] = self.stats.last_load_s - waited
        return loads

    def observe_wait(self, ctx: ReqContext, seconds: float, *, promoted: bool) -> None:
        """``ctx`` waited ``seconds`` from its lookup until its load was done, its
        load from host memory alone or ``promoted`` from a secondary tier (the gets its plan
        expected are taken out)."""
        planned = self._planned_get_s.pop(ctx, 0.0)
        self.waits.observe(seconds, promoted=promoted, planned_get_s=max(0.0, planned))

    def plan(
        self,
        scan: Scan,
        estimates: Sequence[TierEstimate | None],
        bytes_per_key: int,
    ) -> int:
        """How many leading keys of ``scan`` to load (the rest are recomputed); counts it."""
        tokens = self.tokens_per_key
        if self.mode is LoadMode.FIXED:
            cut = plan_fixed(scan.tiers, tokens_per_chunk=tokens or 0.0, min_tokens=self.min_tokens)
            plan = LoadPlan(cut, 0.0, 0.0, len(scan.tiers))
        elif tokens is None:
            plan = LoadPlan(len(scan.tiers), 0.0, 0.0, len(scan.tiers))
        else:
            plan = plan_load(
                scan.tiers,
                estimates,
                bytes_per_chunk=bytes_per_key,
                tokens_per_chunk=tokens,
                tokens_per_s=self.prefill.tokens_per_s,
                host_wait_s=0.0 if self.busy else self.waits.host_s,
                promote_wait_s=0.0 if self.busy else self.waits.promote_s,
            )
        cut = plan.load_chunks
        left = {t for t in scan.tiers[cut:] if t is not None}
        if self.mode is LoadMode.AUTO and left and self._explore(left):
            cut = len(scan.tiers)
            self.stats.explored += 1
        self._count(scan.tiers, cut, plan)
        return cut

    def _explore(self, tiers: set[int]) -> bool:
        due = False
        for tier in tiers:
            count = self._recomputes.get(tier, 0) + 1
            self._recomputes[tier] = count
            due |= count % self.explore_every == 0
        return due

    def _count(self, tiers: Sequence[int | None], cut: int, plan: LoadPlan) -> None:
        stats = self.stats
        loaded = sum(1 for t in tiers[:cut] if t is not None)
        left = sum(1 for t in tiers[cut:] if t is not None)
        if not loaded and not left:  # a prefix in host memory alone: its chunks count
            loaded, left = cut, len(tiers) - cut
        stats.chunks_loaded += loaded
        stats.chunks_recomputed += left
        if not left:
            stats.loaded_all += 1
        elif loaded:
            stats.loaded_part += 1
        else:
            stats.recomputed += 1
        stats.last_load_s, stats.last_recompute_s = plan.load_s, plan.recompute_s

    def forget(self, ctx: ReqContext) -> None:
        """``ctx`` is done: drop its scan and decisions."""
        if not (self._scans or self._decided or self._declined or self._planned_get_s):
            return  # (per finished request: commonly nothing was decided for any)
        self._scans.pop(ctx, None)
        self._decided.pop(ctx, None)
        self._declined.pop(ctx, None)
        self._planned_get_s.pop(ctx, None)

    def clear(self) -> None:
        """A reset: every scan and decision goes (the chunks they named may be gone)."""
        self._scans.clear()
        self._decided.clear()
        self._declined.clear()
        self._planned_get_s.clear()

    def snapshot(self) -> LoadStats:
        """A copy of the counters (built field by field: vLLM asks every step, and
        ``attrs.evolve`` costs three times as much)."""
        s = self.stats
        return LoadStats(
            s.loaded_all,
            s.loaded_part,
            s.recomputed,
            s.explored,
            s.chunks_loaded,
            s.chunks_recomputed,
            s.last_load_s,
            s.last_recompute_s,
            self.waits.host_s,
            self.waits.promote_s,
        )
