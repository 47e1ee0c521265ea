"""Session fixtures: a standalone Valkey server (password required) and a 3-node cluster,
real ``valkey-server`` processes on loopback (tests/adapters/storage/valkey/servers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.adapters.storage.valkey.servers import (
    Server,
    start_cluster,
    start_standalone,
)


@pytest.fixture(scope="session")
def valkey_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_standalone(Path(tmp_path_factory.mktemp("valkey")))
    yield server
    server.kill()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Server]]:
    nodes = start_cluster(Path(tmp_path_factory.mktemp("valkey-cluster")))
    yield nodes
    for node in nodes:
        node.kill()
