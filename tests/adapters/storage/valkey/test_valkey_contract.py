"""The Valkey tier against the whole shipped kit on real servers: the TierStore contract with
its order checks and the crash contract (writers killed with SIGKILL, the tier reopened), on
a standalone server with a password and on a 3-node cluster. Each check gets a fresh key
prefix; the servers are emptied after it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kvhex.adapters.codecs.aesgcm import KEY_ENV, AesGcmCodec
from kvhex.adapters.codecs.chain import CodecChain
from kvhex.adapters.codecs.zstd import ZstdCodec
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.namespace import check_sizes
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import TierStore
from kvhex.testing import CrashContract, TierStoreContract
from tests.adapters.storage.peer_kit import started
from tests.adapters.storage.valkey.servers import PASSWORD, Server, flush

NS = {"model": "tiny-llama", "blocks_per_chunk": 1, "dtype": "float16"}


class _Valkey:
    """A fresh prefix per check; requests take milliseconds: the object stores' sizes."""

    shared_storage = True
    race_trials = 4
    race_bulk_blocks = 32
    race_slot_bytes = 1 << 14
    race_wide_slot_bytes = 1 << 18
    capacity_rounds = 10
    crash_cycles = 3
    crash_slot_bytes = 1 << 14

    url: str
    password: str | None = None

    def make_store(self, host: HostBuffer) -> TierStore:
        return self.make_sized_store(host, 256)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        return started(
            ValkeyTierStore(
                host,
                self.url,
                capacity_bytes=capacity_blocks * (HEADER_AREA + host.slot_bytes),
                namespace=NS,
                password=self.password,
            )
        )


class TestValkeyStandalone(_Valkey, TierStoreContract, CrashContract):
    @pytest.fixture(autouse=True)
    def _prefix(self, valkey_standalone: Server) -> Iterator[None]:
        self.url = f"valkey://127.0.0.1:{valkey_standalone.port}/kv-{uuid.uuid4().hex[:8]}"
        self.password = PASSWORD
        yield
        flush([valkey_standalone.port], password=PASSWORD)


class TestValkeyCluster(_Valkey, TierStoreContract, CrashContract):
    @pytest.fixture(autouse=True)
    def _prefix(self, valkey_cluster: list[Server]) -> Iterator[None]:
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in valkey_cluster[:2])
        self.url = f"valkey://{seeds}/kv-{uuid.uuid4().hex[:8]}"
        yield
        flush([n.port for n in valkey_cluster])


class TestValkeyCodedStandalone(_Valkey, TierStoreContract):
    """Coded frames (zstd, then AES-GCM) in Valkey values shorter than a slot."""

    @pytest.fixture(autouse=True)
    def _prefix(self, valkey_standalone: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        monkeypatch.setenv(KEY_ENV, "7e" * 32)
        self.url = f"valkey://127.0.0.1:{valkey_standalone.port}/kv-{uuid.uuid4().hex[:8]}"
        self.password = PASSWORD
        yield
        flush([valkey_standalone.port], password=PASSWORD)

    def make_sized_store(self, host: HostBuffer, capacity_blocks: int) -> TierStore:
        chain = CodecChain([ZstdCodec(), AesGcmCodec()])
        return started(
            ValkeyTierStore(
                host,
                self.url,
                capacity_bytes=capacity_blocks * check_sizes(host, None, None, chain),
                namespace=NS,
                password=self.password,
                codec=chain,
            )
        )
