"""CopyWorkers, the CPU path's copy threads, on tasks that record what ran when: a job that
writes what an unfinished job writes waits for it, others overlap; loads go first; a failing
task fails its job only; close finishes what is queued."""

from __future__ import annotations

import threading
import time

from kvhex.adapters.torch.workers import CopyWorkers
from kvhex.domain import TransferKind

STORE, LOAD = TransferKind.STORE, TransferKind.LOAD


class Recorder:
    """Runs tasks ``(name, seconds)`` (``seconds < 0``: raise) and records start and end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, str]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, task: tuple[object, ...], store: bool) -> None:
        name, seconds = task
        assert isinstance(name, str)
        assert isinstance(seconds, float)
        with self.lock:
            self.events.append(("start", name))
        if name == "gated":
            self.gate.wait(10)
        if seconds < 0:
            raise RuntimeError(f"task {name} failed")
        time.sleep(seconds)
        with self.lock:
            self.events.append(("end", name))

    def at(self, kind: str, name: str) -> int:
        return self.events.index((kind, name))


def test_a_job_writing_what_an_unfinished_job_writes_waits_and_others_overlap() -> None:
    run = Recorder()
    workers = CopyWorkers(run, threads=2, name="test")
    first = workers.submit(STORE, [("a", 0.2)], 1, [5, 6])
    same = workers.submit(STORE, [("b", 0.0)], 1, [6, 9])  # slot 6 again: after "a"
    other = workers.submit(STORE, [("c", 0.0)], 1, [7])  # nothing shared: runs at once
    for job in (first, same, other):
        assert job.done.wait(10)
    workers.close()
    assert run.at("end", "c") < run.at("end", "a") < run.at("start", "b")
    assert (first.finished, same.finished, other.finished) == (True, True, True)
    assert first.seconds >= 0.2


def test_two_loads_writing_one_device_block_keep_their_order_and_directions_never_wait() -> None:
    run = Recorder()
    workers = CopyWorkers(run, threads=2, name="test")
    first = workers.submit(LOAD, [("l1", 0.2)], 1, [4])
    again = workers.submit(LOAD, [("l2", 0.0)], 1, [4])  # device block 4 again: after "l1"
    store = workers.submit(STORE, [("s1", 0.0)], 1, [4])  # slot 4: another direction's id
    for job in (first, again, store):
        assert job.done.wait(10)
    workers.close()
    assert run.at("end", "l1") < run.at("start", "l2")
    assert run.at("end", "s1") < run.at("end", "l1")  # ran beside "l1", not after it


def test_loads_are_taken_before_queued_stores() -> None:
    run = Recorder()
    run.gate.clear()
    workers = CopyWorkers(run, threads=1, name="test")
    stores = workers.submit(STORE, [("gated", 0.0), ("s2", 0.0), ("s3", 0.0)], 3, [1, 2, 3])
    while not run.events:  # the one thread is inside "gated"
        time.sleep(0.001)
    load = workers.submit(LOAD, [("l1", 0.0)], 1, [1])  # a load's blocks: no store conflict
    run.gate.set()
    assert stores.done.wait(10)
    assert load.done.wait(10)
    workers.close()
    assert [name for kind, name in run.events if kind == "start"] == ["gated", "l1", "s2", "s3"]


def test_a_failing_task_fails_its_job_skips_its_rest_and_later_jobs_run() -> None:
    run = Recorder()
    workers = CopyWorkers(run, threads=1, name="test")
    bad = workers.submit(STORE, [("x", -1.0), ("y", 0.0)], 2, [1])
    good = workers.submit(STORE, [("z", 0.0)], 1, [1])  # waits for the failed job, then runs
    assert bad.done.wait(10)
    assert good.done.wait(10)
    workers.close()
    assert bad.error == "RuntimeError: task x failed"
    assert ("start", "y") not in run.events
    assert (good.error, good.finished) == (None, True)


def test_an_empty_job_is_finished_at_once_and_close_finishes_queued_work() -> None:
    run = Recorder()
    workers = CopyWorkers(run, threads=2, name="test")
    empty = workers.submit(LOAD, [], 0, [])
    assert empty.finished
    assert empty.done.is_set()
    queued = [workers.submit(STORE, [(f"t{i}", 0.01)], 1, [i % 3]) for i in range(9)]
    workers.close()
    workers.close()  # idempotent
    assert all(job.finished for job in queued)
    assert sum(kind == "end" for kind, _ in run.events) == 9
