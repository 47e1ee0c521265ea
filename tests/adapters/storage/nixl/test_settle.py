"""How a thread waits for its NIXL transfer: NIXL offers only a state to poll, and each nap
costs CPU that, on a small machine, the object store's server or the scheduler needs. No NIXL
here: a transfer is a clock that turns ``DONE`` (or ``ERR``) at a set time."""

from __future__ import annotations

import time

import pytest

from kvhex.adapters.storage.nixl import POLL_MAX_S, settle


class Transfer:
    """A transfer that ends in ``final`` ``seconds`` after it was made, counting how often
    its state was asked."""

    def __init__(self, seconds: float, final: str = "DONE") -> None:
        self.ends = time.perf_counter() + seconds
        self.final = final
        self.asked = 0

    def state(self) -> str:
        self.asked += 1
        return self.final if time.perf_counter() >= self.ends else "PROC"


@pytest.mark.parametrize("final", ["DONE", "ERR"])
def test_a_long_transfer_is_seen_ending_soon_after_few_wakeups(final: str) -> None:
    transfer = Transfer(0.4, final)
    assert settle("PROC", transfer.state) == final
    late = time.perf_counter() - transfer.ends
    # naps of 1/16 of the wait, at most POLL_MAX_S: about 130 checks for 0.4 s (about 1,300
    # with naps of at most 0.2 ms, the earlier rule), the end seen within one nap (and
    # scheduling)
    assert transfer.asked <= 200
    assert late <= POLL_MAX_S + 0.05


def test_a_short_transfer_is_not_slept_past() -> None:
    transfer = Transfer(0.02)
    started = time.perf_counter()
    assert settle("INIT", transfer.state) == "DONE"
    assert time.perf_counter() - started < 0.02 + 0.05
    # naps of a fraction of the wait (about 60 checks in 20 ms on an idle machine), not
    # long fixed ones: the end of a short transfer is seen soon after it
    assert transfer.asked >= 8


def test_a_transfer_done_at_submission_is_not_polled() -> None:
    transfer = Transfer(0.0)
    assert settle("DONE", transfer.state) == "DONE"
    assert transfer.asked == 0
