"""``IoPool``: the IO threads under a storage tier, lighter per job than
:class:`concurrent.futures.ThreadPoolExecutor`.

The scheduler calls a tier per chunk per step, so what a job costs the scheduler thread
before and after its IO is part of the tier's rate: every microsecond of it holds the GIL
that the IO threads need between their syscalls (docs/performance.md). An executor's
``submit`` builds a ``Future`` with its condition variable, a work item, and wakes a thread
through a semaphore; its result is read back under the future's lock. Here a job is one
slotted :class:`IoTask` put on a ``queue.SimpleQueue`` (C code); a thread that finishes it
appends it to :attr:`IoPool.finished`, where the scheduler thread finds it with no lock
taken. Only a thread that waits for tasks (a put waiting for a removal, ``drain``) takes the
pool's condition, and the IO threads notify it only while someone waits.

Threads: :meth:`IoPool.submit`, :meth:`IoPool.completed` and :meth:`IoPool.close` run on the
thread that owns the pool; :meth:`IoPool.wait` on any thread; each task runs on one of the
pool's threads.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_UNSET: Any = None
"""A task's ``value`` until it has one (and for good where it failed)."""


class TaskCancelled(Exception):
    """The pool closed before the task started."""


class IoTask(Generic[T]):
    """One call to run on a pool thread, then its outcome: what the call returned
    (``value``) or raised (``error``).

    ``done`` turns true once, after ``value`` or ``error`` is set (a cancelled task's error
    is :class:`TaskCancelled`) and the task is in its pool's ``finished``. ``value`` is
    ``None`` until then, and stays ``None`` where ``error`` is set: read it once ``done``
    and ``error`` is ``None``.
    """

    __slots__ = ("args", "done", "error", "fn", "value")

    def __init__(self, fn: Callable[..., T], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.value: T = _UNSET
        self.error: BaseException | None = None
        self.done = False


class IoPool:
    """``threads`` daemon threads running submitted tasks in submission order. A pool left
    open is closed when it is collected or at interpreter exit, whichever comes first
    (running tasks finish, queued ones are cancelled).

    Args:
        threads: how many tasks run at once.
        name: prefix of the threads' names.
    """

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {threads}")
        shared = self._shared = _Shared()
        self.finished = shared.finished
        """Tasks in the order they finished (cancelled ones included); the owner pops them."""
        workers = [
            threading.Thread(target=_work, args=(shared,), name=f"{name}_{i}", daemon=True)
            for i in range(threads)
        ]
        for worker in workers:
            worker.start()
        # the threads hold the shared state, not the pool: a pool nobody closed still goes
        self._close = weakref.finalize(self, _shut_down, shared, workers)

    def submit(self, fn: Callable[..., T], *args: Any) -> IoTask[T]:
        """Queue ``fn(*args)``; the task shows up in :attr:`finished` once it ran.

        Raises:
            RuntimeError: the pool is closed.
        """
        if not self._close.alive:
            raise RuntimeError("the IO pool is closed")
        task = IoTask(fn, args)
        self._shared.queue.put(task)
        return task

    def completed(self, value: T) -> IoTask[T]:
        """A task that is done already with ``value``, queued in :attr:`finished`."""
        task: IoTask[T] = IoTask(_nothing, ())
        task.value = value
        task.done = True
        self.finished.append(task)
        return task

    def wait(self, tasks: Iterable[IoTask[Any]]) -> None:
        """Block until every one of ``tasks`` is done."""
        pending = [task for task in tasks if not task.done]
        if not pending:
            return
        shared = self._shared
        with shared.cond:
            shared.waiting += 1
            try:
                for task in pending:
                    while not task.done:
                        shared.cond.wait()
            finally:
                shared.waiting -= 1

    def close(self) -> None:
        """Cancel the queued tasks (they show up in :attr:`finished`, failed), let the running
        ones finish, stop the threads. Idempotent."""
        self._close()


class _Shared:
    """What the pool's threads and its owner share."""

    __slots__ = ("cond", "finished", "queue", "waiting")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[IoTask[Any] | None] = queue.SimpleQueue()
        self.finished: deque[IoTask[Any]] = deque()
        self.cond = threading.Condition(threading.Lock())
        self.waiting = 0  # threads in IoPool.wait: only then do finishing tasks notify


def _work(shared: _Shared) -> None:
    get = shared.queue.get
    while (task := get()) is not None:
        try:
            task.value = task.fn(*task.args)
        except BaseException as exc:  # the owner reads it from the task
            task.error = exc
        task.fn = _nothing
        task.args = ()  # nothing kept alive by a finished task
        _finish(shared, task)


def _finish(shared: _Shared, task: IoTask[Any]) -> None:
    # queued before it is done: whoever waited for it finds it in ``finished`` (a tier's
    # drain promises pollable results); ``done`` is set before ``waiting`` is read: a waiter
    # registered after that read finds the task done when it checks, one registered before
    # it is notified
    shared.finished.append(task)
    task.done = True
    if shared.waiting:
        with shared.cond:
            shared.cond.notify_all()


def _shut_down(shared: _Shared, workers: list[threading.Thread]) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            task = shared.queue.get_nowait()
            if task is not None:
                task.error = TaskCancelled("the IO pool closed before the task started")
                _finish(shared, task)
    for _ in workers:
        shared.queue.put(None)
    for worker in workers:
        if worker is not threading.current_thread():
            worker.join()


def _nothing() -> Any:
    return None
