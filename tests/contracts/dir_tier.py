"""``DirTierStore``: the smallest persistent tier that keeps the TierStore contract (one file
per block in a directory), so the kit has a correct persistent tier to pass and a torn one
(``atomic=False``) to catch.

Jobs run when submitted and are reported by the next ``poll``; capacity is counted in blocks,
least recently used evicted first and announced. A block is written to a temporary file and
renamed into place (a crash leaves a whole block or none); at start-up the blocks found are
announced once, oldest first, and temporary files left by a crash are deleted.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from kvhex.domain.events import Removed, Stored, TierEvent
from kvhex.domain.jobs import JobResult, TierJob
from kvhex.domain.keys import OffloadKey
from kvhex.domain.tiers import Locality, Medium, TierIdentity
from kvhex.errors import TierUnavailable
from kvhex.ports.host_buffer import HostBuffer

__all__ = ["DirTierStore"]


class DirTierStore:
    """Blocks as files ``<key hex>.blk`` under ``root``, at most ``capacity_blocks`` of them.

    ``atomic=False`` writes blocks in place, in pieces (a crash leaves a torn block that a
    restart serves); ``announce_restart=False`` forgets to announce what it finds at start-up.
    Both are deliberate faults for the kit to catch.
    """

    def __init__(
        self,
        host: HostBuffer,
        root: str | os.PathLike[str],
        capacity_blocks: int,
        *,
        atomic: bool = True,
        announce_restart: bool = True,
    ) -> None:
        self._host = host
        self._root = Path(root)
        self._root.mkdir(parents=True, exist_ok=True)
        self._capacity = capacity_blocks
        self._atomic = atomic
        self._identity = TierIdentity(Medium.STORAGE, Locality.LOCAL, "dir")
        self._events: list[TierEvent] = []
        self._results: list[JobResult] = []
        self._closed = False
        self._index: OrderedDict[OffloadKey, None] = OrderedDict()  # least recent first
        for tmp in self._root.glob("*.tmp"):
            tmp.unlink()
        blocks = sorted(self._root.glob("*.blk"), key=lambda p: p.stat().st_mtime_ns)
        for path in blocks[: max(0, len(blocks) - capacity_blocks)]:
            path.unlink()
        for path in blocks[-capacity_blocks:]:
            self._index[OffloadKey(bytes.fromhex(path.stem))] = None
        if self._index and announce_restart:
            self._events.append(Stored(tuple(self._index), self._identity, None))

    @property
    def identity(self) -> TierIdentity:
        return self._identity

    def _path(self, key: OffloadKey) -> Path:
        return self._root / f"{key.hex()}.blk"

    def _check(self) -> None:
        if self._closed:
            raise TierUnavailable("closed", tier="dir")

    def submit_put(self, job: TierJob) -> None:
        self._check()
        pairs = dict(zip(job.keys, job.slots, strict=True))
        new = [(k, s) for k, s in pairs.items() if k not in self._index]
        for key in job.keys:
            if key in self._index:
                self._index.move_to_end(key)
        if len(new) > self._capacity:
            self._results.append(JobResult(job.job_id, False, error="larger than the tier"))
            return
        victims = [k for k in self._index if k not in job.keys][
            : max(0, len(self._index) + len(new) - self._capacity)
        ]
        self._forget(victims)
        for key, slot in new:
            self._write(key, self._host.slot_view(slot))
            self._index[key] = None
        if new:
            self._events.append(Stored(tuple(k for k, _ in new), self._identity, job.ctx))
        self._results.append(JobResult(job.job_id, True))

    def _write(self, key: OffloadKey, data: memoryview) -> None:
        if self._atomic:
            tmp = self._path(key).with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self._path(key))
            return
        with open(self._path(key), "wb") as f:  # torn by a crash between the pieces
            step = max(1, len(data) // 4)
            for start in range(0, len(data), step):
                f.write(data[start : start + step])
                f.flush()
                time.sleep(0.001)

    def submit_get(self, job: TierJob) -> None:
        self._check()
        ok = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self._index:
                data = self._path(key).read_bytes()
                self._host.slot_view(slot)[: len(data)] = data
                self._index.move_to_end(key)
                ok.append(key)
        if len(ok) == len(job.keys):
            self._results.append(JobResult(job.job_id, True))
        else:
            self._results.append(JobResult(job.job_id, False, ok_keys=frozenset(ok), error="miss"))

    def submit_probe(self, job: TierJob) -> None:
        self._check()
        found = frozenset(k for k in job.keys if k in self._index)
        self._results.append(JobResult(job.job_id, True, found=found))

    def poll(self) -> list[JobResult]:
        results, self._results = self._results, []
        return results

    def delete(self, keys: Sequence[OffloadKey]) -> None:
        self._forget([k for k in dict.fromkeys(keys) if k in self._index])

    def _forget(self, keys: list[OffloadKey]) -> None:
        for key in keys:
            del self._index[key]
            self._path(key).unlink()
        if keys:
            self._events.append(Removed(tuple(keys), self._identity))

    def drain(self) -> None:
        return None

    def close(self) -> None:
        self._closed = True

    def take_events(self) -> list[TierEvent]:
        events, self._events = self._events, []
        return events
