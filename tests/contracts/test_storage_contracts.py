"""kvhex's storage tiers against the whole shipped kit: the TierStore contract with its order
checks, and the crash contract (writer processes killed with SIGKILL, then the tier reopened;
``kvhex fsck`` must find local roots clean after every recovery).

The file and NIXL POSIX tiers run on a fresh directory per check, the S3 and NIXL OBJ tiers
on a fresh bucket of the session's SeaweedFS, a real S3 server on loopback
(tests/adapters/conftest.py). Object stores are slower per request: their classes run fewer
and smaller racy trials and crash cycles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV, AesGcmCodec
from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.adapters.storage.files.fsck import check_root
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.namespace import check_sizes
from kvhex.domain.events import TierEvent
from kvhex.domain.keys import OffloadKey
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import CrashContract, TierStoreContract
from kvhex.testing.tier_kit import replay
from tests.adapters.conftest import CREDENTIALS, s3_options
from tests.adapters.storage.peer_kit import started

NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "dtype": "float16"}


def blocks_bytes(host: HostBuffer, blocks: int) -> int:
    """The capacity in bytes of ``blocks`` blocks of ``host``'s slots on these tiers."""
    return blocks * (HEADER_AREA + host.slot_bytes)


def fsck_clean(root: Path) -> None:
    report = check_root(root)
    problems = [p for ns in report.namespaces for p in ns.problems] + [
        f"block {f.key[:64].lstrip('0') or '0'}: {f.finding.value}, {f.reason}"
        for ns in report.namespaces
        for f in ns.findings
    ]
    if not report.clean:
        raise AssertionError("kvhex fsck after recovery:\n    " + "\n    ".join(problems))


class _Local:
    """A fresh directory per check; fsck must find it clean after each recovery."""

    root: Path

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path: Path) -> None:
        self.root = tmp_path

    def check_recovered(self, store: TierStore) -> None:
        fsck_clean(self.root)


class _Bucket:
    """A fresh bucket of the session's SeaweedFS per check. An object store announces the
    blocks it adopts at start-up once their records are read, after start-up: the kit reads
    a reopened tier's events at once, so the factories hand it over with them announced."""

    endpoint: str
    bucket: str

    @pytest.fixture(autouse=True)
    def _bucket(self, s3_server: str, bucket: str) -> None:
        self.endpoint, self.bucket = s3_server, bucket


class _Slow:
    """Object stores answer in milliseconds, not microseconds: fewer, smaller trials."""

    race_trials = 4
    race_bulk_blocks = 32
    race_slot_bytes = 1 << 14
    race_wide_slot_bytes = 1 << 18
    capacity_rounds = 10
    crash_cycles = 3
    crash_slot_bytes = 1 << 14


class PeerViewTier(FsspecTierStore):
    """The fsspec tier with its peer view scanning at every poll: the contract judges the
    events of its own blocks; those of other instances' blocks must replay on their own (each
    stored before it is removed, never twice)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, announce_peers=True, peer_scan_interval_s=0.001, **kwargs)
        self.peer_resident: set[OffloadKey] = set()

    def take_events(self) -> list[TierEvent]:
        events = super().take_events()
        peers = [e for e in events if e.tier == self.peer_identity]
        problems = replay(peers, self.peer_resident, self.peer_identity)
        assert not problems, "the peer view's events: " + "; ".join(problems)
        return [e for e in events if e.tier != self.peer_identity]


class TestFileTier(_Local, TierStoreContract, CrashContract):
    shared_storage = True
    crash_cycles = 10
    native_io: bool | None = None
    """The native data path wherever it was built (the file tier's default)."""
    tier_class: type[FsspecTierStore] = FsspecTierStore

    def make_store(self, host: HostBuffer) -> TierStore:
        return self._store(host, 1 << 24)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return self._store(host, blocks_bytes(host, capacity_blocks))

    def _store(self, host: HostBuffer, capacity: int) -> TierStore:
        return self.tier_class(
            host, str(self.root), capacity_bytes=capacity, namespace=NS, native_io=self.native_io
        )


class TestFileTierPythonIo(TestFileTier):
    """The file tier moving its blocks in Python: the whole contract and crash kit on each
    data path."""

    native_io = False


class TestFileTierWithPeerView(TestFileTier):
    """The file tier with ``announce_peers``: its own events, jobs and crash recovery as
    without it, while it scans the other instances' slabs (the contract's shared checks run
    two instances on one root)."""

    tier_class = PeerViewTier


class TestS3Tier(_Slow, _Bucket, TierStoreContract, CrashContract):
    shared_storage = True
    tier_class: type[FsspecTierStore] = FsspecTierStore

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 256)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return started(
            self.tier_class(
                host,
                f"s3://{self.bucket}/kv",
                capacity_bytes=blocks_bytes(host, capacity_blocks),
                name="s3",
                namespace=NS,
                storage_options=s3_options(self.endpoint),
            )
        )


class TestS3TierWithPeerView(TestS3Tier):
    """The S3 tier with ``announce_peers`` (a listing at every poll), as the file tier's."""

    tier_class = PeerViewTier


class _Coded:
    """Blocks through a lossless chain that compresses and seals them (zstd, then AES-GCM
    with the master key from the environment: the crash writers inherit it)."""

    @pytest.fixture(autouse=True)
    def _master_key(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(KEY_ENV, "7e" * 32)

    @staticmethod
    def chain() -> CodecChain:
        return CodecChain([ZstdCodec(), AesGcmCodec()])

    @staticmethod
    def coded_bytes(host: HostBuffer, blocks: int) -> int:
        return blocks * check_sizes(host, None, None, _Coded.chain())


class TestCodedFileTier(_Coded, _Local, TierStoreContract, CrashContract):
    """The file tier storing coded frames: the whole kit and crash recovery as raw blocks
    (fsck checks coded slots)."""

    shared_storage = True

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 1 << 12)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return FsspecTierStore(
            host,
            str(self.root),
            capacity_bytes=self.coded_bytes(host, capacity_blocks),
            namespace=NS,
            codec=self.chain(),
        )


class TestCodedS3Tier(_Coded, _Slow, _Bucket, TierStoreContract):
    """The S3 tier storing coded frames (objects shorter than a slot)."""

    shared_storage = True

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 256)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return started(
            FsspecTierStore(
                host,
                f"s3://{self.bucket}/kv",
                capacity_bytes=self.coded_bytes(host, capacity_blocks),
                name="s3",
                namespace=NS,
                storage_options=s3_options(self.endpoint),
                codec=self.chain(),
            )
        )


class TestNixlPosixTier(_Local, TierStoreContract, CrashContract):
    shared_storage = True

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 1024)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        from kvhex.adapters.storage.nixl import NixlTierStore

        capacity = blocks_bytes(host, capacity_blocks)
        return NixlTierStore(host, str(self.root), capacity_bytes=capacity, namespace=NS)


class TestNixlObjTier(_Slow, _Bucket, TierStoreContract, CrashContract):
    shared_storage = True

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 256)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        from kvhex.adapters.storage.nixl import NixlTierStore

        return started(
            NixlTierStore(
                host,
                f"s3://{self.bucket}/kv",
                capacity_bytes=blocks_bytes(host, capacity_blocks),
                namespace=NS,
                endpoint_url=self.endpoint,
                access_key=CREDENTIALS["key"],
                secret_key=CREDENTIALS["secret"],
                locality=None,
            )
        )
