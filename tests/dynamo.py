"""Dynamo's standalone KV indexer, the index of a real KV-aware router, for kvhex's tests:
started on loopback as a subprocess of its own virtual environment (``make`` builds
``.venv-dynamo`` and passes its python in ``KVHEX_DYNAMO_PYTHON``), driven over HTTP with the
standard library, and a model of how it credits a prompt, to compare it with.

What the tests rely on (``ai-dynamo-runtime`` 1.6.1, measured):

* ``POST /register`` connects a SUB socket to a publisher's bound PUB (vLLM's frames: topic,
  8-byte big-endian sequence, msgpack batch) and a DEALER to its replay ROUTER. The replay is
  asked for when a message arrives past the sequence expected: after a gap, and on the first
  message of a late join (sequence above 0: everything from 0). Nothing is asked before a
  message arrives, so an indexer that joins after a publisher's last batch learns nothing
  (:meth:`DynamoIndexer.await_stream` publishes until one gets through).
* Block hashes decode only as integers (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``):
  a batch holding a byte-string hash fails to decode and is dropped whole.
* It hashes each block's tokens itself: a ``BlockStored`` whose ``block_size`` is not the one
  registered is dropped, and of one whose ``token_ids`` fall short of ``block_size`` per hash
  only the blocks covered whole are kept; every event naming an ``ownership``, or a
  ``locality`` other than ``LOCAL``, is dropped too. Media: ``GPU`` (or
  none) -> gpu, ``CPU``/``CPU_PINNED`` -> cpu, ``STORAGE``/``DISK``/``EXTERNAL`` -> disk.
* gpu is a strict radix tree (a block whose parent it does not hold is dropped); cpu and disk
  take a child before its parent and link it when the parent comes. No reference counts: one
  removal drops a block announced twice in a medium.
* ``POST /query`` credits each instance in tokens, cumulatively (:func:`expected_credit`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pytest

__all__ = [
    "BUILD",
    "PYTHON_VARIABLE",
    "Chains",
    "Credit",
    "DynamoIndexer",
    "call",
    "dynamo_indexer",
    "expected_credit",
    "free_port",
    "indexer_python",
]

PYTHON_VARIABLE = "KVHEX_DYNAMO_PYTHON"
"""The environment variable naming the python whose ``dynamo.indexer`` the tests start."""
BUILD = "make .venv-dynamo/.kvhex-installed"
"""How the indexer's environment is built (``make test`` does it and sets the variable)."""
MODEL = "kvhex-test"
"""The model name the tests register publishers under."""

T = TypeVar("T")


def indexer_python() -> str | None:
    """The python to start the indexer with: ``KVHEX_DYNAMO_PYTHON``, else ``None``."""
    return os.environ.get(PYTHON_VARIABLE) or None


def free_port() -> int:
    """A free TCP port on loopback (free when asked: bind it soon)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Credit(NamedTuple):
    """What the indexer credits one instance with for a prompt, in tokens: ``gpu`` its
    leading blocks held on the device, ``cpu`` that walk continued through blocks held in
    host memory, ``disk`` the cpu walk continued through blocks held on storage."""

    gpu: int
    cpu: int
    disk: int


NOTHING = Credit(0, 0, 0)


def expected_credit(
    tokens: Sequence[int],
    block_size: int,
    *,
    gpu: Collection[tuple[int, ...]] = (),
    cpu: Collection[tuple[int, ...]] = (),
    disk: Collection[tuple[int, ...]] = (),
) -> Credit:
    """What Dynamo's indexer credits for ``tokens`` when each medium holds the blocks ending
    the token prefixes given (whole blocks; :class:`Chains` turns held hashes into them).

    The walk goes block by block: first through blocks held in gpu, then on through blocks
    held in cpu, then on through blocks held on disk; each credit is where its stretch
    stopped. So credits only grow from gpu to disk, a cpu block after a disk block counts for
    neither, and a block whose parent is held nowhere is never reached.
    """
    prefixes = [tuple(tokens[: (i + 1) * block_size]) for i in range(len(tokens) // block_size)]
    walked = 0
    credit = []
    for held in (gpu, cpu, disk):
        while walked < len(prefixes) and prefixes[walked] in held:
            walked += 1
        credit.append(walked * block_size)
    return Credit(*credit)


class Chains:
    """The token prefix each known block hash ends, from token lists and their block hashes
    (one per ``block_size`` tokens, each chained to the one before): what a tier holds, by
    hash, becomes what :func:`expected_credit` reads, by prefix."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._prefix: dict[object, tuple[int, ...]] = {}

    def add(self, tokens: Sequence[int], hashes: Sequence[object]) -> None:
        """The blocks of ``tokens``: ``hashes[i]`` ends the first ``i + 1`` blocks."""
        assert len(hashes) == len(tokens) // self.block_size, "one hash per whole block"
        for i, block_hash in enumerate(hashes):
            self._prefix[block_hash] = tuple(tokens[: (i + 1) * self.block_size])

    def prefix(self, block_hash: object) -> tuple[int, ...]:
        """The tokens up to and including the block ``block_hash`` ends."""
        found = self._prefix.get(block_hash)
        assert found is not None, f"a held block of no known prompt: {block_hash!r}"
        return found

    def held(self, hashes: Iterable[object]) -> frozenset[tuple[int, ...]]:
        """The prefixes the blocks ``hashes`` end."""
        return frozenset(self.prefix(h) for h in hashes)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Loopback requests never go through a proxy the environment names."""


def call(url: str, method: str, body: object = None, *, timeout: float = 30) -> tuple[int, Any]:
    """An HTTP request with a JSON body: the status and the decoded answer (text if not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with _NO_PROXY.open(request, timeout=timeout) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode("utf-8", "replace")
    try:
        return status, json.loads(text) if text.strip() else None
    except ValueError:
        return status, text


class DynamoIndexer:
    """``python -m dynamo.indexer`` on a free port, its output in ``log_path``.

    It listens on ``0.0.0.0``: the indexer has a ``--port`` flag and no host flag, so for as
    long as a test runs it is reachable from other machines too (it holds nothing but the
    test's synthetic blocks). Failed assertions should end with :meth:`context`.
    """

    STARTUP_TIMEOUT_S = 30.0

    def __init__(self, python: str, log_path: Path, *, threads: int | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (open until close)
        self._threads = threads
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        try:
            for _ in range(3):  # another program may take the free port before it binds
                if self._start(python):
                    return
            raise AssertionError(f"Dynamo's indexer did not start{self.context()}")
        except BaseException:
            self.close()
            raise

    def _start(self, python: str) -> bool:
        port = free_port()
        command = [python, "-m", "dynamo.indexer", "--port", str(port)]
        if self._threads is not None:
            command += ["--threads", str(self._threads)]
        self._proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False  # exited: its log says why (a port taken is retried)
            try:
                status, _ = self._call("GET", "/health", timeout=1)
            except OSError:
                status = 0
            if status == 200:
                return True
            time.sleep(0.05)
        raise AssertionError(
            f"Dynamo's indexer not healthy within {self.STARTUP_TIMEOUT_S} s{self.context()}"
        )

    def close(self) -> None:
        """Stop the indexer (terminate, then kill) and close its log. Idempotent."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._log.close()

    # -- HTTP ----------------------------------------------------------------------------
    def _call(
        self, method: str, path: str, body: object = None, *, timeout: float = 10
    ) -> tuple[int, Any]:
        return call(self.url + path, method, body, timeout=timeout)

    def register(
        self,
        instance_id: int,
        endpoint: str,
        replay_endpoint: str | None,
        block_size: int,
    ) -> None:
        """Subscribe to a publisher's PUB socket at ``endpoint`` (bound by the publisher),
        asking ``replay_endpoint`` for what it misses, as instance ``instance_id``."""
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": MODEL,
            "block_size": block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        status, answer = self._call("POST", "/register", body)
        assert status == 201, f"register answered {status}: {answer}{self.context()}"

    def credits(self, tokens: Sequence[int]) -> dict[int, Credit]:
        """Every instance the indexer credits for ``tokens`` (instances it credits nothing
        are absent)."""
        status, answer = self._call(
            "POST", "/query", {"token_ids": list(tokens), "model_name": MODEL}
        )
        assert status == 200, f"query answered {status}: {answer}{self.context()}"
        return {
            int(instance): Credit(c["gpu"], c["cpu"], c["disk"])
            for instance, c in answer["instances"].items()
        }

    def credit(self, tokens: Sequence[int], instance_id: int = 1) -> Credit:
        """What ``instance_id`` is credited for ``tokens`` (all 0 when nothing)."""
        return self.credits(tokens).get(instance_id, NOTHING)

    def dump(self) -> Any:
        """``GET /dump``: every block the indexer holds, as store events per medium."""
        return self._call("GET", "/dump")[1]

    def workers(self) -> Any:
        """``GET /workers``: the registered instances and their listeners."""
        return self._call("GET", "/workers")[1]

    # -- waiting and reporting -----------------------------------------------------------
    def settle(self, observe: Callable[[], T], want: T, timeout: float = 30) -> T:
        """Observe until the observation equals ``want`` or ``timeout`` passed; the last one
        (events reach the index asynchronously: the caller asserts on what this returns)."""
        deadline = time.monotonic() + timeout
        while True:
            got = observe()
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def await_stream(
        self, publish_probe: Callable[[int], Sequence[int]], timeout: float = 30
    ) -> int:
        """Publish probes until one reaches the index: ``publish_probe(n)`` publishes the n-th
        (a store of tokens no other prompt shares, on a medium credited as cpu or disk) and
        returns its tokens. The indexer then has a live message past what it missed, so it
        has asked the replay socket for the rest. Returns how many probes went out."""
        deadline = time.monotonic() + timeout
        n = 0
        while time.monotonic() < deadline:
            tokens = publish_probe(n)
            n += 1
            wait = time.monotonic() + 0.2
            while time.monotonic() < wait:
                if self.credit(tokens) != NOTHING:
                    return n
                time.sleep(0.01)
        raise AssertionError(f"no probe of {n} reached the index in {timeout} s{self.context()}")

    def log_lines(self) -> list[str]:
        """The indexer's output so far, colour codes removed."""
        text = self.log_path.read_text("utf-8", "replace")
        return [_ANSI.sub("", line) for line in text.splitlines()]

    def context(self, lines: int = 30) -> str:
        """What to add to a failed assertion: where the log is, its first warnings (the
        cause, where a replay repeats the same complaint) and its last lines."""
        log = self.log_lines()
        warned = [line for line in log if " WARN " in line or " ERROR " in line][:5]
        tail = "\n".join(log[-lines:])
        first = "\n".join(warned) or "(none)"
        return (
            f"\n--- Dynamo indexer log ({self.log_path}); first warnings:\n{first}"
            f"\n--- last {lines} lines:\n{tail}"
        )


@pytest.fixture
def dynamo_indexer(tmp_path: Path) -> Iterator[DynamoIndexer]:
    """Dynamo's indexer on a free loopback port, stopped after the test; skips where its
    environment was not built (``make test`` always builds it)."""
    python = indexer_python()
    if python is None:
        pytest.skip(
            f"Dynamo's KV indexer is not installed: {BUILD} builds it, then set "
            f"{PYTHON_VARIABLE}=$PWD/.venv-dynamo/bin/python (make test does both)"
        )
    indexer = DynamoIndexer(python, tmp_path / "dynamo-indexer.log")
    try:
        yield indexer
    finally:
        indexer.close()
