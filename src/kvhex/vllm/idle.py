"""``IdleWaker``: an idle vLLM engine still announces what kvhex's tiers find on their own.

vLLM's engine core stops stepping when it has no request: it blocks on its input queue, and
nothing it publishes changes until a request arrives. Most of kvhex's events follow the
engine's own work and go out in its steps (the connector's ``has_pending_push_work`` keeps
the engine stepping while kvhex's jobs are in flight). Some tiers also work on a schedule of
their own (``ScheduledWork``): a peer view scans the storage other instances share for what
they stored and dropped, a Valkey tier hears of blocks its server evicted. On an idle
server that work would wait, unannounced, for the next request: a router would credit it
with blocks long gone and miss blocks its peers stored meanwhile.

The waker is a thread of the scheduler's process that sleeps until that work is due and then,
if the engine has not stepped since, wakes the engine core (``EngineHooks.wake``); the engine
then steps, as long as the connector says kvhex has work, and publishes what the tiers found.
It reads the due time through plain attribute reads (``OffloadEngine.next_poll_at``) and
never touches kvhex's state otherwise: every poll still runs on the scheduler thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

LONGEST_SLEEP_S = 0.5
"""The waker looks at the due time at least this often (a due time may move earlier)."""
STEPPED_WITHIN_S = 0.05
"""An engine that stepped this recently is not idle: it polls kvhex's tiers by itself."""


class IdleWaker:
    """Wakes an idle engine when kvhex's tiers' own work is due (see the module docstring).

    Args:
        next_due: when the work is next due (``time.monotonic``), ``None`` when nothing is
            scheduled; called on the waker's thread (plain reads).
        last_step: when the engine last stepped (``time.monotonic``).
        wake: wakes the engine core (safe from any thread).
    """

    def __init__(
        self,
        next_due: Callable[[], float | None],
        last_step: Callable[[], float],
        wake: Callable[[], None],
    ) -> None:
        self._next_due = next_due
        self._last_step = last_step
        self._wake = wake
        self._stop = threading.Event()
        self.wakeups = 0
        """Times the engine was woken."""
        self._thread = threading.Thread(target=self._run, name="kvhex-idle-waker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self._sleep()):
                self._maybe_wake()
        except Exception as exc:  # a bug: never take the engine down, say so once
            log.warning("kvhex_idle_waker_failed", error=repr(exc))

    def _sleep(self) -> float:
        due = self._next_due()
        if due is None:
            return LONGEST_SLEEP_S
        return min(max(due - time.monotonic(), 0.0), LONGEST_SLEEP_S) or STEPPED_WITHIN_S

    def _maybe_wake(self) -> None:
        due = self._next_due()
        now = time.monotonic()
        if due is None or due > now or now - self._last_step() < STEPPED_WITHIN_S:
            return
        self.wakeups += 1
        self._wake()

    def stop(self) -> None:
        """Stop the thread (idempotent; waits for it briefly)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * LONGEST_SLEEP_S)
