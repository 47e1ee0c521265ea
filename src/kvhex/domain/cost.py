"""Load or recompute: how much of a request's matched prefix to load, from measured costs.

A hit in a slow tier can take longer to load than the engine takes to recompute it (peers'
users report loads of seconds against recomputes of a fraction of that). kvhex measures what
it needs to tell the two apart and decides per request:

* :class:`TierCost`: a tier's get (promotion) jobs, ``seconds ≈ latency_s + bytes *
  seconds_per_byte``, fitted by least squares over recent jobs (exponential forgetting), so a
  tier's fixed cost per job and its throughput are told apart;
* :class:`PrefillRate`: the engine's prefill speed (tokens per second), measured from its
  steps or configured;
* :class:`LoadWaits`: what a load costs a request in engine steps beyond its gets (the step
  that copies to the device, the one that promotes), measured;
* :func:`plan_load`: given the matched prefix chunk by chunk (host memory or a secondary tier
  holds each), the number of leading chunks to load; the rest is recomputed.

Pure and deterministic: the same inputs give the same answer; clocks and measurements come
from the caller.

The plan. Loading the first ``L`` chunks is estimated to take ``sum over the tiers used of
(queue_s + latency_s + chunks * bytes_per_chunk * seconds_per_byte)``, plus the wait a load
costs in engine steps (host memory's copy runs at memory bandwidth, far faster than a
prefill, but the request computes only in the step after it: on a short prefix and a fast
prefill that step can cost more than recomputing); it saves recomputing
``L * tokens_per_chunk`` tokens. ``plan_load`` picks the ``L`` with the
largest saving (the smallest such ``L`` on ties), so it never loads what costs more than it
saves by its own estimate. Tiers are summed, not overlapped: conservative when two tiers
serve one prefix, and what makes the plan monotone: a slower tier, or a faster prefill,
never makes it load more.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

import attrs


class LoadMode(enum.Enum):
    """How a matched prefix held by secondary tiers is treated."""

    OFF = "off"
    """Load every matched chunk (what vLLM and every peer do)."""
    AUTO = "auto"
    """Load as much as the measured costs say is faster than recomputing."""
    FIXED = "fixed"
    """Load secondary-tier chunks only when they hold at least a fixed number of tokens."""


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a positive finite number, got {value!r}")


@attrs.frozen(slots=True)
class TierEstimate:
    """What loading from one tier is expected to cost now.

    Attributes:
        latency_s: fixed seconds per get job (request, seek, first byte).
        seconds_per_byte: the rest, per byte moved.
        queue_s: seconds of work already queued on the tier ahead of a new job.
    """

    latency_s: float
    seconds_per_byte: float
    queue_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        """Estimated seconds for one job moving ``nbytes`` (queue included)."""
        return self.queue_s + self.latency_s + nbytes * self.seconds_per_byte


@attrs.define(slots=True)
class TierCost:
    """A tier's get jobs fitted as ``seconds = latency_s + bytes * seconds_per_byte``:
    weighted least squares, each job's weight decaying by ``decay`` per later job."""

    decay: float = attrs.field(
        default=0.9, validator=[attrs.validators.gt(0), attrs.validators.lt(1)]
    )
    samples: int = attrs.field(default=0, init=False)
    _w: float = attrs.field(default=0.0, init=False)
    _x: float = attrs.field(default=0.0, init=False)
    _y: float = attrs.field(default=0.0, init=False)
    _xx: float = attrs.field(default=0.0, init=False)
    _xy: float = attrs.field(default=0.0, init=False)

    def observe(self, nbytes: int, seconds: float) -> None:
        """One finished job: ``nbytes`` moved in ``seconds`` (submission to result)."""
        if nbytes <= 0 or not (seconds >= 0 and math.isfinite(seconds)):
            return
        d = self.decay
        x = float(nbytes)
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + seconds
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * seconds
        self.samples += 1

    def estimate(self, queued_bytes: int = 0) -> TierEstimate | None:
        """The fitted costs (``None`` before any job was seen), with ``queued_bytes`` of
        jobs in flight ahead of a new one."""
        if self.samples == 0:
            return None
        w, x, y = self._w, self._x, self._y
        spread = w * self._xx - x * x
        slope = (w * self._xy - x * y) / spread if spread > 1e-9 * x * x else 0.0
        if slope <= 0.0:  # one job size so far (or noise): all of it per byte
            per_byte = y / x
            return TierEstimate(0.0, per_byte, queued_bytes * per_byte)
        intercept = max(0.0, (y - slope * x) / w)
        return TierEstimate(intercept, slope, queued_bytes * slope)


_RECENT = 9
"""Recent samples a median is taken over (``PrefillRate``, ``LoadWaits``): one outlier, such
as the engine's cold first step, moves it by at most one rank."""


def _median(samples: Sequence[float]) -> float:
    ordered = sorted(samples)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@attrs.define(slots=True)
class PrefillRate:
    """The engine's prefill speed in tokens per second: configured, or the median over its
    recent measured steps (a cold or interrupted step moves it by one rank at most)."""

    configured: float | None = attrs.field(default=None)
    _recent: list[float] = attrs.field(factory=list, init=False)
    steps: int = attrs.field(default=0, init=False)

    @configured.validator
    def _check(self, attribute: attrs.Attribute[float | None], value: float | None) -> None:
        if value is not None:
            _positive(self, attribute, value)  # type: ignore[arg-type]

    def observe(self, tokens: int, seconds: float) -> None:
        """A step computed ``tokens`` tokens in ``seconds``."""
        if tokens <= 0 or not (seconds > 0 and math.isfinite(seconds)):
            return
        self._recent.append(tokens / seconds)
        if len(self._recent) > _RECENT:
            del self._recent[0]
        self.steps += 1

    @property
    def tokens_per_s(self) -> float | None:
        """The configured rate if set, else the measured one (``None`` before any step)."""
        if self.configured is not None:
            return self.configured
        return _median(self._recent) if self._recent else None


@attrs.define(slots=True)
class LoadWaits:
    """How long a request waits for a load before it computes, beyond the tiers' gets: what
    a load costs the engine in steps (the step that copies to the device, the step that
    promotes), measured on the engine's own requests. Recomputing starts at once instead.

    ``host_s``: a prefix wholly in host memory; ``promote_s``: one that promotes from a
    secondary tier (the planned get time taken out). Medians of the recent waits; 0 before
    any was measured (loads then cost only their gets, as before)."""

    _host: list[float] = attrs.field(factory=list, init=False)
    _promote: list[float] = attrs.field(factory=list, init=False)

    def observe(self, seconds: float, *, promoted: bool, planned_get_s: float = 0.0) -> None:
        """A request waited ``seconds`` from its lookup until its load was done;
        ``promoted``: part of its prefix came from a secondary tier, whose gets were
        planned to take ``planned_get_s``."""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        recent = self._promote if promoted else self._host
        recent.append(max(0.0, seconds - planned_get_s) if promoted else seconds)
        if len(recent) > _RECENT:
            del recent[0]

    @property
    def host_s(self) -> float:
        """The wait of a load from host memory (0 before any was measured)."""
        return _median(self._host) if self._host else 0.0

    @property
    def promote_s(self) -> float:
        """The wait of a promoting load beyond its gets (0 before any was measured)."""
        return _median(self._promote) if self._promote else 0.0


@attrs.frozen(slots=True)
class LoadPlan:
    """How much of a matched prefix to load.

    Attributes:
        load_chunks: leading chunks to load; the rest of the prefix is recomputed.
        load_s: estimated seconds to load them.
        recompute_s: estimated seconds to recompute them instead.
        prefix_chunks: chunks matched.
    """

    load_chunks: int
    load_s: float
    recompute_s: float
    prefix_chunks: int

    @property
    def loads_all(self) -> bool:
        """Every matched chunk is loaded."""
        return self.load_chunks == self.prefix_chunks


def plan_load(
    prefix: Sequence[int | None],
    estimates: Sequence[TierEstimate | None],
    *,
    bytes_per_chunk: int,
    tokens_per_chunk: float,
    tokens_per_s: float | None,
    host_wait_s: float = 0.0,
    promote_wait_s: float = 0.0,
) -> LoadPlan:
    """The leading chunks of ``prefix`` worth loading.

    Args:
        prefix: the matched chunks in order: ``None`` for host memory, else the index (into
            ``estimates``) of the secondary tier holding it.
        estimates: each tier's current estimate; ``None`` (never measured) loads all that
            tier holds, which is how its first measurements are made.
        bytes_per_chunk: bytes one chunk moves.
        tokens_per_chunk: tokens one chunk saves from recomputing.
        tokens_per_s: the engine's prefill speed; ``None`` (unknown) loads everything.
        host_wait_s: what any load costs the request in engine steps (``LoadWaits``).
        promote_wait_s: the same for a load that promotes from a secondary tier, beyond
            its gets.

    Returns the plan whose load saves the most estimated time (ties: the fewer chunks).
    """
    n = len(prefix)
    if tokens_per_s is None or any(t is not None and estimates[t] is None for t in prefix):
        return LoadPlan(n, 0.0, n * tokens_per_chunk / tokens_per_s if tokens_per_s else 0.0, n)
    per_chunk = tokens_per_chunk / tokens_per_s
    used: dict[int, int] = {}
    best_chunks, best_saving, best_load = 0, 0.0, 0.0
    load = 0.0
    wait = host_wait_s
    for i, tier in enumerate(prefix):
        if tier is not None:
            estimate = estimates[tier]
            assert estimate is not None
            count = used.get(tier, 0)
            if count == 0:
                load += estimate.queue_s + estimate.latency_s
            load += bytes_per_chunk * estimate.seconds_per_byte
            used[tier] = count + 1
            wait = promote_wait_s
        saving = (i + 1) * per_chunk - load - wait
        if saving > best_saving:
            best_chunks, best_saving, best_load = i + 1, saving, load + wait
    return LoadPlan(best_chunks, best_load, best_chunks * per_chunk, n)


def plan_fixed(prefix: Sequence[int | None], *, tokens_per_chunk: float, min_tokens: int) -> int:
    """``LoadMode.FIXED``: the whole prefix when its secondary-tier chunks hold at least
    ``min_tokens`` tokens, else only its leading host-memory chunks."""
    secondary = sum(1 for t in prefix if t is not None) * tokens_per_chunk
    if secondary >= min_tokens:
        return len(prefix)
    return next((i for i, t in enumerate(prefix) if t is not None), len(prefix))
