"""Cascade admission: whether a put to a secondary tier is submitted or dropped.

Only cascades (host -> tier puts) are gated; promotions always run. The manager keeps one
policy per tier, asks ``admit`` before each cascade, and reports every finished cascade to
``on_completed``. Pure: latencies come from job results, never from a clock here.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvhex.domain.jobs import JobResult


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Decides whether a cascade of ``n_keys`` chunks goes to this policy's tier."""

    @property
    def dropped_jobs(self) -> int:
        """Cascades refused so far."""
        ...

    @property
    def dropped_keys(self) -> int:
        """Chunks in the cascades refused so far."""
        ...

    def admit(self, n_keys: int) -> bool:
        """True to submit the cascade; False drops it (and counts it)."""
        ...

    def on_completed(self, result: JobResult) -> None:
        """A cascade to this tier finished (success or not)."""
        ...

    def reset(self) -> None:
        """Forget learned state (the manager was reset)."""
        ...


class AlwaysAdmit:
    """Every cascade is submitted."""

    __slots__ = ()

    dropped_jobs = 0
    dropped_keys = 0

    def admit(self, n_keys: int) -> bool:
        """Always True."""
        return True

    def on_completed(self, result: JobResult) -> None:
        """Nothing to learn."""

    def reset(self) -> None:
        """Nothing to forget."""


class EmaBackpressure:
    """Drops cascades to a tier whose put latency runs too high.

    Keeps an exponential moving average of successful put latency (``JobResult.seconds``).
    After ``warmup`` samples, pressure turns on when the average exceeds ``high_water_s`` and
    off when it falls below ``low_water_s`` (hysteresis). Under pressure every
    ``probe_every``-th cascade is still admitted, so the average keeps learning and pressure
    can lift even when nothing else is in flight.

    The constructor's defaults are those of a tier's configured ``backpressure`` table
    (``kvhex.config.BackpressureConfig``; a tier without one admits every cascade).

    Raises:
        ValueError: a parameter out of range; the message starts with its name.
    """

    __slots__ = (
        "_dropped_in_row",
        "_samples",
        "alpha",
        "dropped_jobs",
        "dropped_keys",
        "ema_s",
        "high_water_s",
        "low_water_s",
        "probe_every",
        "under_pressure",
        "warmup",
    )

    def __init__(
        self,
        alpha: float = 0.3,
        high_water_s: float = 1.0,
        low_water_s: float = 0.5,
        warmup: int = 3,
        probe_every: int = 8,
    ) -> None:
        # each message starts with the parameter at fault: configs report it at that key
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha: must be in (0, 1], got {alpha!r}")
        if high_water_s < 0.0:
            raise ValueError(f"high_water_s: must be >= 0, got {high_water_s!r}")
        if not 0.0 <= low_water_s <= high_water_s:
            raise ValueError(
                f"low_water_s: must be between 0 and high_water_s ({high_water_s!r}), "
                f"got {low_water_s!r}"
            )
        if warmup < 0:
            raise ValueError(f"warmup: must be >= 0, got {warmup!r}")
        if probe_every < 1:
            raise ValueError(f"probe_every: must be >= 1, got {probe_every!r}")
        self.alpha = alpha
        self.high_water_s = high_water_s
        self.low_water_s = low_water_s
        self.warmup = warmup
        self.probe_every = probe_every
        self.ema_s: float | None = None
        self.under_pressure = False
        self.dropped_jobs = 0
        self.dropped_keys = 0
        self._samples = 0
        self._dropped_in_row = 0

    def admit(self, n_keys: int) -> bool:
        """False (and counted) under pressure, except every ``probe_every``-th cascade."""
        if not self.under_pressure:
            return True
        self._dropped_in_row += 1
        if self._dropped_in_row >= self.probe_every:
            self._dropped_in_row = 0
            return True
        self.dropped_jobs += 1
        self.dropped_keys += n_keys
        return False

    def on_completed(self, result: JobResult) -> None:
        """Fold a successful put's latency into the average and update pressure."""
        if not result.success or result.seconds is None:
            return
        sample = result.seconds
        self.ema_s = (
            sample if self.ema_s is None else self.alpha * sample + (1 - self.alpha) * self.ema_s
        )
        self._samples += 1
        if self._samples < self.warmup:
            return
        if self.ema_s > self.high_water_s:
            self.under_pressure = True
        elif self.ema_s < self.low_water_s:
            self.under_pressure = False
            self._dropped_in_row = 0

    def reset(self) -> None:
        """Forget the average and pressure; drop counters are kept (they are cumulative)."""
        self.ema_s = None
        self.under_pressure = False
        self._samples = 0
        self._dropped_in_row = 0
