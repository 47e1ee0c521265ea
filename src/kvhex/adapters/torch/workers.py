"""``CopyWorkers``: the CPU path's copy threads, shared by both directions.

A submitted job is a list of tasks (``DirectCopier.plan``); every worker takes the next task
of any job when it is free (loads before stores: a load is a hit the engine waits for), so
the threads never wait for each other at a job's end and the next job's tasks start while
the last ones of the previous job finish. What that must not break is the order of writes:
a job that writes a destination (a host slot for a store, a device block for a load) that an
unfinished job of the same direction writes waits until that job finished; then its tasks
are queued. A job is finished when its last task is.

The tasks' copies release the GIL (numpy's copy loops, see
:mod:`kvhex.adapters.torch.direct`), so the threads copy in parallel.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from kvhex.domain.transfer import TransferKind

Task = tuple[Any, ...]


class Job:
    """One submitted job's tasks and outcome (read ``finished`` / ``error`` after ``done``)."""

    __slots__ = (
        "dependents",
        "dests",
        "done",
        "end",
        "error",
        "finished",
        "kind",
        "left",
        "nbytes",
        "start",
        "tasks",
        "waiting",
    )

    def __init__(
        self, kind: TransferKind, tasks: list[Task], nbytes: int, dests: Collection[int]
    ) -> None:
        self.kind = kind
        self.tasks = tasks
        self.nbytes = nbytes
        self.dests = dests
        self.left = len(tasks)
        self.waiting = 0
        self.dependents: list[Job] = []
        self.done = threading.Event()
        self.finished = False
        self.error: str | None = None
        self.start: float | None = None
        self.end = 0.0

    @property
    def seconds(self) -> float:
        """From the job's first task starting to its last task ending."""
        return self.end - self.start if self.start is not None else 0.0


class CopyWorkers:
    """``threads`` worker threads running ``run(task, store)`` for submitted jobs."""

    def __init__(self, run: Callable[[Task, bool], None], *, threads: int, name: str) -> None:
        self._run = run
        self._cond = threading.Condition()
        self._queues = {TransferKind.LOAD: deque[tuple[Job, Task]](), TransferKind.STORE: deque()}
        self._writers: dict[TransferKind, dict[int, Job]] = {kind: {} for kind in TransferKind}
        self._stopping = False
        self.threads = threads
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(self.threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, kind: TransferKind, tasks: list[Task], nbytes: int, dests: Collection[int]
    ) -> Job:
        """Queue a job's tasks (after the unfinished jobs of ``kind`` that write any of
        ``dests``). Never blocks on a copy."""
        job = Job(kind, tasks, nbytes, dests)
        with self._cond:
            writers = self._writers[kind]
            before = {w for d in dests if (w := writers.get(d)) is not None}
            for d in dests:
                writers[d] = job
            job.waiting = len(before)
            for earlier in before:
                earlier.dependents.append(job)
            if not before:
                self._release(job)
        return job

    def close(self) -> None:
        """Finish every queued task, then stop the threads. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    # -- under the condition's lock ----------------------------------------------------------
    def _release(self, job: Job) -> None:
        if not job.tasks:
            self._finish(job, time.perf_counter())
            return
        self._queues[job.kind].extend((job, task) for task in job.tasks)
        self._cond.notify(len(job.tasks))

    def _finish(self, job: Job, now: float) -> None:
        job.end = now
        job.finished = True
        job.tasks = []
        writers = self._writers[job.kind]
        for d in job.dests:
            if writers.get(d) is job:
                del writers[d]
        for later in job.dependents:
            later.waiting -= 1
            if later.waiting == 0:
                self._release(later)
        job.done.set()

    # -- worker threads --------------------------------------------------------------------
    def _work(self) -> None:
        loads, stores = self._queues[TransferKind.LOAD], self._queues[TransferKind.STORE]
        cond, run = self._cond, self._run
        while True:
            with cond:
                while not loads and not stores:
                    if self._stopping:
                        return
                    cond.wait()
                job, task = (loads or stores).popleft()
                if job.start is None:
                    job.start = time.perf_counter()
                skip = job.error is not None
            error = None
            if not skip:
                try:
                    run(task, job.kind is TransferKind.STORE)
                except Exception as exc:  # a copy failure is the job's failed result
                    error = f"{type(exc).__name__}: {exc}"
            with cond:
                if error is not None and job.error is None:
                    job.error = error
                job.left -= 1
                if job.left == 0:
                    self._finish(job, time.perf_counter())
