"""The writer processes of the crash checks (``kvhex.testing.tier_crash``).

A *launcher* is started once per check with ``multiprocessing``'s "spawn" context: a fresh
interpreter that receives the test instance (any :class:`~kvhex.testing.tier_kit.TierKit`)
and a :class:`WriterPlan` by pickle (importing the test module), and never opens a tier nor
starts a thread. For each crash cycle it forks writers (a fork of a clean, single-threaded
process is safe and costs milliseconds, where a spawn costs the imports again), reports their
pids, waits for them and reports how each ended. The test process kills writers with
``SIGKILL`` by pid. A writer builds its tier with the suite's factory and runs random puts,
gets, probes and (where the tier ``Deletes``) deletes until it is killed, checking every byte
it loads.
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from typing import NamedTuple

from kvhex.domain.jobs import JobId, JobKind, TierJob
from kvhex.ports.tier_store import Deletes
from kvhex.testing.tier_kit import TierKit, tier_key

HOST_SLOTS = 32
"""Host slots of a writer (and of the checks that reopen its tier)."""
JOB_KEYS = 8
"""The most keys a writer's job names."""


class WriterPlan(NamedTuple):
    """What a writer does, besides building its tier with the suite's factory.

    Attributes:
        slot_bytes: bytes per host slot (one block).
        capacity_blocks: asked of ``make_sized_store`` (``make_store`` is used as it is).
        keys: the writers' keys are ``tier_key(0)`` .. ``tier_key(keys - 1)``.
    """

    slot_bytes: int
    capacity_blocks: int
    keys: int


class Launcher:
    """The launcher process, seen from the test process."""

    def __init__(
        self, context: SpawnContext, suite: TierKit, plan: WriterPlan, timeout_s: float
    ) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_launch, args=(suite, plan, child), daemon=True)
        try:
            self.process.start()
        except Exception as exc:  # pickling the suite failed
            raise TypeError(
                "CrashContract pickles the test instance into a process started with the "
                f"spawn context: define {type(suite).__qualname__} at module level of a test "
                "module pytest imports by name, and keep what make_store needs in plain "
                f"attributes ({exc!r})"
            ) from exc
        finally:
            child.close()
        self._answer(timeout_s, "ready", "the writer launcher did not start")

    def _answer(self, timeout_s: float, want: str, late: str) -> list[object]:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"{late} in {timeout_s} s")
        try:
            message = self.conn.recv()
        except EOFError:
            raise AssertionError(f"{late}: the launcher died ({self.process.exitcode})") from None
        tag, *rest = message
        assert tag == want, f"{late}:\n{rest[0] if rest else message}"
        return list(rest)

    def start(self, seeds: list[int]) -> list[int]:
        """Fork one writer per seed; their pids."""
        self.conn.send(seeds)
        (pids,) = self._answer(60, "started", "the writers did not start")
        assert isinstance(pids, list)
        return pids

    def ended(self, timeout_s: float) -> list[str]:
        """Why each writer of the last :meth:`start` ended, when not by ``SIGKILL``."""
        (ends,) = self._answer(timeout_s, "ended", "the writers did not end")
        assert isinstance(ends, list)
        return [
            f"exited by itself ({code})" + (f":\n{text}" if text else "")
            for code, text in ends
            if code != -signal.SIGKILL
        ]

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(30)
        self.conn.close()


def _launch(suite: TierKit, plan: WriterPlan, conn: Connection) -> None:
    """The launcher: fork writers on request, report their pids and how they ended."""
    try:
        conn.send(("ready",))
        while True:
            seeds = conn.recv()
            started = []
            for seed in seeds:
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:  # the writer
                    os.close(read)
                    _write(suite, plan, seed, write)
                os.close(write)
                started.append((pid, read))
            conn.send(("started", [pid for pid, _ in started]))
            ends = []
            for pid, read in started:
                _, status = os.waitpid(pid, 0)
                with os.fdopen(read, "rb") as pipe:
                    text = pipe.read().decode(errors="replace")
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                ends.append((code, text))
            conn.send(("ended", ends))
    except EOFError:  # the test process is done with it
        return
    except BaseException:
        conn.send(("failed", traceback.format_exc()))


def _write(suite: TierKit, plan: WriterPlan, seed: int, errors: int) -> None:
    """A writer: random puts, gets, probes and deletes until it is killed; every loaded
    block is checked byte for byte. Never returns (``os._exit``)."""
    try:
        rng = random.Random(seed)
        host = suite.new_host(HOST_SLOTS, plan.slot_bytes)
        store = suite.open_store(host, plan.capacity_blocks)
        deleter = store if isinstance(store, Deletes) else None
        free = list(range(HOST_SLOTS))
        jobs: dict[JobId, TierJob] = {}
        while True:
            op = rng.random()
            n = rng.randint(1, JOB_KEYS)
            keys = [tier_key(i) for i in rng.sample(range(plan.keys), n)]
            job = None
            if op < 0.7 and len(free) >= n:
                slots = [free.pop() for _ in keys]
                if op < 0.45:
                    suite.fill(host, keys, slots)
                    job = suite.new_job(JobKind.PUT, keys, slots)
                else:
                    suite.spoil(host, slots)
                    job = suite.new_job(JobKind.GET, keys, slots)
            elif op < 0.8:
                job = suite.new_job(JobKind.PROBE, keys)
            elif op < 0.92:
                if deleter is not None:
                    deleter.delete(keys)
            else:
                store.drain()
            if job is not None:
                jobs[job.job_id] = job
                suite.submit(store, job)
            for result in store.poll():
                done = jobs.pop(result.job_id)
                free.extend(done.slots)
                if done.kind is JobKind.GET:
                    ok = set(done.keys) if result.success else set(result.ok_keys or ())
                    suite.check_bytes(host, done.keys, done.slots, ok)
            store.take_events()
            if len(free) < JOB_KEYS:
                time.sleep(0.0002)
    except BaseException:
        os.write(errors, traceback.format_exc().encode())
    finally:
        os._exit(1)
