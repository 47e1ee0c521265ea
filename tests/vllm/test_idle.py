"""``IdleWaker``: wakes an idle engine once kvhex's tiers' own work is due, and not while the
engine steps by itself (no vLLM needed: the engine is played by the test)."""

from __future__ import annotations

import threading
import time

from kvhex.vllm.idle import LONGEST_SLEEP_S, IdleWaker


class Engine:
    """An engine that steps only when woken (as vLLM's does without requests)."""

    def __init__(self) -> None:
        self.stepped = time.monotonic()
        self.woken = threading.Event()

    def wake(self) -> None:
        self.stepped = time.monotonic()
        self.woken.set()


def test_an_idle_engine_is_woken_when_the_work_falls_due_and_only_then() -> None:
    engine = Engine()
    due: list[float | None] = [None]
    waker = IdleWaker(lambda: due[0], lambda: engine.stepped, engine.wake)
    try:
        time.sleep(2 * LONGEST_SLEEP_S)
        assert waker.wakeups == 0  # nothing scheduled: never woken
        due[0] = time.monotonic() + 0.3
        set_at = time.monotonic()
        assert engine.woken.wait(timeout=5)
        late = time.monotonic() - set_at
        assert 0.25 <= late < 0.3 + LONGEST_SLEEP_S, late
        due[0] = None  # the step applied it
        count = waker.wakeups
        time.sleep(2 * LONGEST_SLEEP_S)
        assert waker.wakeups == count
    finally:
        waker.stop()


def test_an_engine_that_steps_by_itself_is_left_alone() -> None:
    engine = Engine()
    waker = IdleWaker(lambda: time.monotonic() - 1, lambda: engine.stepped, engine.wake)
    try:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:
            engine.stepped = time.monotonic()  # busy: it polls the tiers each step
            time.sleep(0.005)
        assert waker.wakeups == 0
    finally:
        waker.stop()
    assert not waker._thread.is_alive()
