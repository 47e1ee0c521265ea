"""The IO pool under the storage tiers: every task runs once and shows up finished once,
waits end exactly when their tasks are done, closing cancels what has not started, and a
pool nobody closed does not keep its threads."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from kvhex.adapters.storage._io_pool import IoPool, IoTask, TaskCancelled


def drain(pool: IoPool, count: int, timeout: float = 10.0) -> list[IoTask]:
    """The next ``count`` finished tasks, in the order they finished."""
    got: list[IoTask] = []
    deadline = time.monotonic() + timeout
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} tasks finished"
        while pool.finished:
            got.append(pool.finished.popleft())
        time.sleep(0.001)
    return got


def until_done(tasks: list[IoTask], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(task.done for task in tasks):
        assert time.monotonic() < deadline, "a task never finished"
        time.sleep(0.001)


def test_each_task_runs_once_and_is_finished_once_with_its_outcome() -> None:
    pool = IoPool(3, "test")
    boom = OSError(5, "disk gone")

    def job(i: int) -> int:
        if i % 7 == 3:
            raise boom
        return i * i

    tasks = [pool.submit(job, i) for i in range(200)]
    finished = drain(pool, 200)
    assert sorted(map(id, finished)) == sorted(map(id, tasks))
    time.sleep(0.05)
    assert not pool.finished  # nothing twice
    for i, task in enumerate(tasks):
        assert task.done
        if i % 7 == 3:
            assert task.error is boom
        else:
            assert task.error is None
            assert task.value == i * i
    pool.close()


def test_a_task_waited_for_is_already_in_finished() -> None:
    """What a wait returned for can be collected at once (a tier's drain, then its poll)."""
    pool = IoPool(2, "test")
    for _ in range(300):
        tasks = [pool.submit(int, i) for i in range(4)]
        pool.wait(tasks)
        got = {id(pool.finished.popleft()) for _ in range(4)}
        assert got == {id(t) for t in tasks}
    pool.close()


def test_a_completed_task_is_finished_at_once() -> None:
    pool = IoPool(1, "test")
    task = pool.completed(("nothing", "written"))
    assert task.done
    assert list(pool.finished) == [task]
    assert task.value == ("nothing", "written")
    pool.wait([task])  # returns: it is done
    pool.close()


def test_wait_returns_exactly_when_its_tasks_are_done() -> None:
    pool = IoPool(2, "test")
    gate = threading.Event()
    held = pool.submit(gate.wait)
    quick = pool.submit(lambda: "quick")
    pool.wait([quick])
    assert quick.done
    assert not held.done
    waiter = threading.Thread(target=pool.wait, args=([held, quick],), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # held is not done: wait blocks
    gate.set()
    waiter.join(5)
    assert not waiter.is_alive()
    assert held.value is True
    pool.close()


def test_many_waiters_and_finishing_tasks_never_miss_a_wakeup() -> None:
    """Tasks finishing while threads start waiting for them, in random orders: every wait
    ends (a lost notify would leave a waiter blocked)."""
    pool = IoPool(4, "test")
    rng = random.Random(7)
    for _ in range(50):
        tasks = [pool.submit(time.sleep, rng.choice([0, 0, 0.0005, 0.002])) for _ in range(12)]
        waiters = [
            threading.Thread(
                target=pool.wait, args=(rng.sample(tasks, rng.randint(1, 12)),), daemon=True
            )
            for _ in range(3)
        ]
        for waiter in waiters:
            waiter.start()
        # a task of the pool waiting for others, as a put waits for a removal
        chained = pool.submit(pool.wait, tasks[:6])
        for waiter in waiters:
            waiter.join(5)
            assert not waiter.is_alive(), "a waiter missed its wakeup"
        until_done([chained])
        assert all(task.done for task in tasks[:6])
        until_done(tasks)
    drain(pool, 50 * 13)
    pool.close()


def test_close_cancels_queued_tasks_and_lets_running_ones_finish() -> None:
    pool = IoPool(1, "test")
    gate = threading.Event()
    started = threading.Event()

    def running() -> str:
        started.set()
        gate.wait()
        return "finished"

    first = pool.submit(running)
    queued = [pool.submit(lambda: "ran") for _ in range(3)]
    assert started.wait(5)
    waiter = threading.Thread(target=pool.wait, args=(queued,), daemon=True)
    waiter.start()
    closer = threading.Thread(target=pool.close, daemon=True)
    closer.start()
    waiter.join(5)
    assert not waiter.is_alive()  # cancelled tasks are done: their waiters go on
    assert closer.is_alive()  # close waits for the running task
    gate.set()
    closer.join(5)
    assert not closer.is_alive()
    assert first.value == "finished"
    for task in queued:
        assert isinstance(task.error, TaskCancelled)
        assert task.value is None
    assert {id(t) for t in drain(pool, 4)} == {id(t) for t in [first, *queued]}
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(lambda: None)
    pool.close()  # idempotent


def test_a_pool_nobody_closed_stops_its_threads_when_collected() -> None:
    before = {t.ident for t in threading.enumerate()}
    pool = IoPool(2, "forgotten")
    task = pool.submit(lambda: 1)
    pool.wait([task])
    ours = [t for t in threading.enumerate() if t.ident not in before]
    assert len(ours) == 2
    del pool
    gc.collect()
    for thread in ours:
        thread.join(5)
        assert not thread.is_alive()


def test_a_pool_needs_a_thread() -> None:
    with pytest.raises(ValueError, match="io_threads must be >= 1, got 0"):
        IoPool(0, "test")
