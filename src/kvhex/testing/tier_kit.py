"""What every TierStore suite shares: the hooks a tier's test class implements, keys and
payloads derived from each other, and the job plumbing.

Payloads are derived from their key (:func:`block_payload`), so a suite can verify any byte
any tier serves, in any process, without keeping records of what it wrote.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Collection, Iterable, Iterator

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.domain.events import Cleared, Removed, Stored, TierEvent
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import OffloadKey, make_offload_key
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import Deletes, TierStore

NO_DELETE = (
    "the tier has no delete (kvhex.ports.tier_store.Deletes), so the checks of deletes do not apply"
)
"""Why a delete check is skipped, or a part of a check left out."""

_JUNK = 0xEE
_job_ids = itertools.count(1)


def tier_key(i: int) -> OffloadKey:
    """The suites' key number ``i``: a well-formed 36-byte offload key."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def tier_key_id(key: OffloadKey) -> int:
    """The number of a key built by :func:`tier_key`."""
    return int.from_bytes(key[:32], "big")


def block_payload(key: OffloadKey, nbytes: int) -> bytes:
    """The ``nbytes`` every suite stores under ``key`` (SHAKE-128 of the key)."""
    return hashlib.shake_128(key).digest(nbytes)


def describe_keys(keys: Iterable[OffloadKey], limit: int = 8) -> str:
    """``"#3, #7"``: key numbers for messages, at most ``limit`` of them."""
    ids = sorted(tier_key_id(k) for k in keys)
    shown = ", ".join(f"#{i}" for i in ids[:limit])
    return shown + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "") or "none"


class TierKit:
    """The hooks and helpers the TierStore suites share. Implement :meth:`make_store`; also
    :meth:`make_sized_store` (or set :attr:`capacity_blocks`) for the checks that need to know
    the tier's capacity.

    The helpers below are public: a tier's own checks use them too (build a host buffer and
    jobs, fill slots with the keys' payloads, run jobs to their results, check the bytes a get
    served). They assert, with a message, when the tier breaks the port while they wait.
    """

    num_slots = 16
    """Host slots of the basic checks."""
    slot_bytes = 4096
    """Bytes per host slot (one block) of the basic and order checks."""
    timeout_s = 30.0
    """How long a job may take before a check fails."""
    capacity_blocks: int | None = None
    """How many blocks of ``slot_bytes`` the tier built by :meth:`make_store` holds, when
    :meth:`make_sized_store` is not implemented (``None``: unknown)."""

    def make_store(self, host: HostBuffer) -> TierStore:
        """Build the tier under test over ``host``: on storage that is empty when a check
        starts, and the same storage on every call within one check (the restart and crash
        checks reopen it)."""
        raise NotImplementedError("implement make_store(host) in your test class")

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        """Optional: like :meth:`make_store`, holding at most ``capacity_blocks`` blocks of
        ``host.slot_bytes`` (evicting beyond)."""
        raise NotImplementedError("implement make_sized_store(host, capacity_blocks)")

    # -- building ------------------------------------------------------------------------
    @staticmethod
    def new_host(num_slots: int, slot_bytes: int) -> MemoryHostBuffer:
        """A host buffer of ``num_slots`` slots of ``slot_bytes`` (in memory, zeroed)."""
        return MemoryHostBuffer(num_slots, slot_bytes)

    def _sized(self) -> bool:
        return type(self).make_sized_store is not TierKit.make_sized_store

    def open_store(self, host: HostBuffer, capacity_blocks: int | None = None) -> TierStore:
        """The tier, sized to ``capacity_blocks`` where the test class can size it (else
        :meth:`make_store`'s)."""
        if capacity_blocks is not None and self._sized():
            return self.make_sized_store(host, capacity_blocks)
        return self.make_store(host)

    def bounded_store(self, host: HostBuffer, wanted: int) -> tuple[TierStore, int]:
        """A tier whose capacity in blocks is known, and that capacity (``wanted`` where the
        class can size it); skips the check (saying how to enable it) when it cannot."""
        if self._sized():
            return self.make_sized_store(host, wanted), wanted
        if self.capacity_blocks is not None:
            return self.make_store(host), self.capacity_blocks
        import pytest

        pytest.skip(
            f"{type(self).__name__}: the tier's capacity is unknown; implement "
            "make_sized_store(host, capacity_blocks) or set capacity_blocks"
        )
        raise AssertionError("unreachable: pytest.skip raises")

    def deleting(self, store: TierStore) -> Deletes:
        """``store`` as a tier that ``Deletes``; skips the check, saying so, when it does not
        (the delete checks apply only to tiers that can delete)."""
        if isinstance(store, Deletes):
            return store
        import pytest

        pytest.skip(f"{type(self).__name__}: {NO_DELETE}")
        raise AssertionError("unreachable: pytest.skip raises")

    # -- jobs ----------------------------------------------------------------------------
    @staticmethod
    def new_job(
        kind: JobKind,
        keys: Iterable[OffloadKey],
        slots: Iterable[int] = (),
        ctx: ReqContext | None = None,
    ) -> TierJob:
        """A job with a job id unique in this process."""
        return TierJob(JobId(next(_job_ids)), kind, tuple(keys), tuple(slots), ctx)

    @staticmethod
    def submit(store: TierStore, job: TierJob) -> None:
        """Submit ``job`` by its kind (``submit_put``, ``submit_get`` or ``submit_probe``)."""
        if job.kind is JobKind.PUT:
            store.submit_put(job)
        elif job.kind is JobKind.GET:
            store.submit_get(job)
        else:
            store.submit_probe(job)

    def wait_for(self, store: TierStore, jobs: Iterable[TierJob]) -> dict[JobId, JobResult]:
        """Poll until every one of ``jobs`` is reported; each exactly once, no stranger."""
        wanted = {job.job_id for job in jobs}
        got: dict[JobId, JobResult] = {}
        deadline = time.monotonic() + self.timeout_s
        while not wanted <= got.keys():
            for result in store.poll():
                assert result.job_id not in got, f"job {result.job_id} reported twice"
                assert result.job_id in wanted, f"job {result.job_id} was never submitted"
                got[result.job_id] = result
            if wanted <= got.keys():
                break
            assert time.monotonic() < deadline, f"jobs {sorted(wanted - got.keys())} never finished"
            time.sleep(0.0005)
        return got

    def run_job(self, store: TierStore, job: TierJob) -> JobResult:
        """Submit ``job`` and wait for its result."""
        self.submit(store, job)
        return self.wait_for(store, [job])[job.job_id]

    @staticmethod
    def fill(host: HostBuffer, keys: Iterable[OffloadKey], slots: Iterable[int]) -> None:
        """Each key's payload into its slot (before a put)."""
        for key, slot in zip(keys, slots, strict=True):
            host.slot_view(slot)[:] = block_payload(key, host.slot_bytes)

    @staticmethod
    def spoil(host: HostBuffer, slots: Iterable[int]) -> None:
        """Junk into get targets, so a get that claims a key without copying it is caught."""
        for slot in slots:
            host.slot_view(slot)[:] = bytes([_JUNK]) * host.slot_bytes

    def put_all(
        self, store: TierStore, host: HostBuffer, keys: list[OffloadKey]
    ) -> list[JobResult]:
        """Put ``keys`` in jobs of at most ``host.num_slots`` keys, one at a time."""
        results = []
        for chunk in _chunks(keys, host.num_slots):
            slots = range(len(chunk))
            self.fill(host, chunk, slots)
            results.append(self.run_job(store, self.new_job(JobKind.PUT, chunk, slots)))
        return results

    def probe(self, store: TierStore, keys: Collection[OffloadKey]) -> frozenset[OffloadKey]:
        """The keys a probe finds (a failed probe fails the check)."""
        result = self.run_job(store, self.new_job(JobKind.PROBE, keys))
        assert result.success, f"a probe failed: {result.error}"
        return result.found

    def get_all(
        self, store: TierStore, host: HostBuffer, keys: list[OffloadKey]
    ) -> tuple[set[OffloadKey], dict[OffloadKey, str]]:
        """Get ``keys`` (in jobs of at most ``host.num_slots``): the keys that loaded, and why
        the others did not. Every key reported loaded must hold exactly its payload."""
        loaded: set[OffloadKey] = set()
        errors: dict[OffloadKey, str] = {}
        for chunk in _chunks(keys, host.num_slots):
            slots = range(len(chunk))
            self.spoil(host, slots)
            result = self.run_job(store, self.new_job(JobKind.GET, chunk, slots))
            ok = set(chunk) if result.success else set(result.ok_keys or ())
            assert ok <= set(chunk), f"a get reported keys it was not asked for: {result}"
            self.check_bytes(host, chunk, slots, ok)
            loaded |= ok
            errors.update((k, result.error or "failed") for k in chunk if k not in ok)
        return loaded, errors

    @staticmethod
    def check_bytes(
        host: HostBuffer, keys: Iterable[OffloadKey], slots: Iterable[int], loaded: set[OffloadKey]
    ) -> None:
        """Every key of ``loaded`` holds exactly its payload in its slot (``AssertionError``
        naming the key otherwise)."""
        for key, slot in zip(keys, slots, strict=True):
            if key in loaded and bytes(host.slot_view(slot)) != block_payload(key, host.slot_bytes):
                raise AssertionError(f"key {describe_keys([key])} was served with wrong bytes")


def replay(
    events: Iterable[TierEvent], resident: set[OffloadKey], identity: TierIdentity
) -> list[str]:
    """Apply ``events`` to ``resident`` (``Stored`` adds, ``Removed`` removes, ``Cleared``
    clears) and say what in them breaks the port: another tier's identity, a key announced
    stored while already resident, a key announced removed that was not resident."""
    problems = []
    for event in events:
        if not isinstance(event, Stored | Removed | Cleared):  # a third party's
            problems.append(f"an event that is not a TierEvent: {event!r}")  # type: ignore[unreachable]
            continue
        if event.tier != identity:
            problems.append(f"an event for {event.tier}, not the tier's {identity}: {event!r}")
        if isinstance(event, Stored):
            again = [k for k in event.keys if k in resident]
            if again or len(set(event.keys)) != len(event.keys):
                problems.append(f"Stored twice without a Removed between: {describe_keys(again)}")
            resident.update(event.keys)
        elif isinstance(event, Removed):
            absent = [k for k in event.keys if k not in resident]
            if absent or len(set(event.keys)) != len(event.keys):
                problems.append(f"Removed while not resident (or twice): {describe_keys(absent)}")
            resident.difference_update(event.keys)
        else:
            resident.clear()
    return problems


def _chunks(keys: list[OffloadKey], size: int) -> Iterator[list[OffloadKey]]:
    for start in range(0, len(keys), size):
        yield keys[start : start + size]
