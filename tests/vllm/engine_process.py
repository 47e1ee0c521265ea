"""A real vLLM engine (tests/vllm/engine.py) in a process of its own, for tests that need two
engines at once: vLLM keeps its KV connector in a process-wide slot, so two ``LLM`` in one
process would share one connector.

The test side is :class:`EngineProcess`; the process runs this module
(``python -m tests.vllm.engine_process SPEC``, from the repository root). ``SPEC`` is JSON:
``model`` (the tiny model's directory), ``extra`` (kvhex's ``kv_connector_extra_config``),
``events`` (vLLM's ``endpoint`` and ``replay_endpoint`` of its ZMQ publisher) and ``engine``
(more ``LLM`` options). The engine starts, answers ``{"ready": true}``, then serves one JSON
command per line on stdin, one JSON answer per line: its own stdout, which nothing else
writes (vLLM's logs and every ``print`` go to stderr, which the test sends to a log file).
``held`` needs a file tier (``fs``); ``pool`` works on any one kvhex tier.
A command that fails answers ``{"error": traceback}`` and the engine serves on.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["EngineProcess", "Held", "Pool", "side_by_side"]

SETTLE_STEPS = 200
"""Requests :meth:`EngineProcess.settle` serves at most before kvhex's tier jobs are done."""
IDLE = [7, 8, 9]
"""A prompt shorter than a block: serving it steps the engine and stores nothing."""


class Held(NamedTuple):
    """Where an engine finds each full block of a prompt (one flag per block, in order), and
    what its file tier holds on the shared root."""

    gpu: list[bool]
    """In the device's prefix cache."""
    cpu: list[bool]
    """In kvhex's host memory (readable)."""
    disk: list[bool]
    """In this engine's own file tier (blocks it stored)."""
    root: list[bool]
    """On the file root, stored by this engine or another one."""
    own_blocks: int
    """Blocks this engine's file tier holds."""
    peer_blocks: int
    """Other engines' blocks its peer view announces now."""
    peer_scans: int
    """Scans its peer view did so far."""


class Pool(NamedTuple):
    """What an engine with one secondary tier (any kvhex tier: a shared pool) holds of a
    prompt's full blocks (one entry per block, in order), and what its tier did so far."""

    keys: list[str]
    """Each block's offload key (group 0), in hex: the name its stored block carries."""
    cpu: list[bool]
    """In kvhex's host memory (readable)."""
    tier: list[bool]
    """In this engine's own tier index: blocks it stored (or found at start-up)."""
    keys_put: int
    """Blocks this engine's tier stored."""
    keys_promoted: int
    """Blocks this engine's tier loaded into host memory."""
    hits: int
    """Lookups this engine's tier answered with a hit."""


class EngineProcess:
    """An engine served by a subprocess (started at once; :meth:`wait_ready` waits for it).

    Args:
        spec: what the engine runs (see the module docstring).
        log_path: where the process's stderr goes (vLLM's logs).

    The process inherits ``VLLM_CACHE_ROOT``: tests/vllm/conftest.py makes it private to the
    test session (another vLLM version sharing ``~/.cache/vllm`` breaks model inspection),
    and engines sharing it inspect a model once, not each in a subprocess of its own.
    """

    READY_TIMEOUT_S = 180.0
    CALL_TIMEOUT_S = 120.0

    def __init__(self, spec: dict[str, Any], log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        env = dict(os.environ)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in the process
        root = Path(__file__).resolve().parents[2]
        self._log = open(log_path, "ab")  # noqa: SIM115 (open until close)
        self._buffer = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm.engine_process", json.dumps(spec)],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
        )

    def wait_ready(self) -> None:
        """Wait until the engine started (its start-up failing is an ``AssertionError``)."""
        answer = self._answer(self.READY_TIMEOUT_S)
        assert answer == {"ready": True}, f"engine start answered {answer}{self.context()}"

    def call(self, op: str, **args: Any) -> Any:
        """Send one command and return its answer."""
        stdin = self._proc.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
            stdin.flush()
        except BrokenPipeError as exc:
            exited = f"the engine exited ({self._proc.wait()}){self.context()}"
            raise AssertionError(exited) from exc
        answer = self._answer(self.CALL_TIMEOUT_S)
        assert "error" not in answer, f"{op} failed:\n{answer['error']}{self.context()}"
        return answer["value"]

    def generate(self, tokens: list[int]) -> tuple[list[int], int]:
        """Greedy tokens of one prompt and how many of its tokens were cached."""
        output, cached = self.call("generate", tokens=tokens)
        return list(output), int(cached)

    def step(self) -> None:
        """Serve a prompt shorter than a block: the engine steps (kvhex polls its tiers and
        publishes their events) and stores nothing."""
        self.generate(IDLE)

    def settle(self) -> None:
        """Step until every job of kvhex's tiers finished."""
        self.call("settle")

    def held(self, tokens: list[int]) -> Held:
        """Where the engine finds each full block of ``tokens`` now."""
        return Held(**self.call("held", tokens=tokens))

    def pool(self, tokens: list[int]) -> Pool:
        """What the engine and its one tier hold of ``tokens`` now."""
        return Pool(**self.call("pool", tokens=tokens))

    def close(self) -> None:
        """Ask the engine to exit, then terminate and kill it if it does not. Idempotent."""
        proc = self._proc
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(b'{"op": "exit"}\n')
                proc.stdin.close()
                proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        self._log.close()

    def context(self, lines: int = 40) -> str:
        """What to add to a failed assertion: the last lines of the engine's log."""
        self._log.flush()
        text = self.log_path.read_text("utf-8", "replace").splitlines()
        tail = "\n".join(text[-lines:])
        return f"\n--- engine log ({self.log_path}), last {lines} lines:\n{tail}"

    def _answer(self, timeout: float) -> Any:
        stdout = self._proc.stdout
        assert stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"the engine did not answer within {timeout} s{self.context()}"
            readable, _, _ = select.select([stdout], [], [], left)
            if readable:
                chunk = os.read(stdout.fileno(), 1 << 16)
                assert chunk, f"the engine exited ({self._proc.wait()}){self.context()}"
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)


@contextlib.contextmanager
def side_by_side(specs: Mapping[str, dict[str, Any]], logs: Path) -> Iterator[list[EngineProcess]]:
    """An engine per spec (by name, in order), all started before any is waited for (each
    logs to ``logs/engine-NAME.log``); every one closed on the way out."""
    engines: list[EngineProcess] = []
    try:
        for name, spec in specs.items():
            engines.append(EngineProcess(spec, logs / f"engine-{name}.log"))
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.close()


# -- the process ------------------------------------------------------------------------
def _held(llm: Any, tokens: list[int]) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    from tests.vllm.engine import block_hashes, kvhex_manager, scheduler

    manager = kvhex_manager(llm)
    in_host = set(manager.engine.host_keys())
    (files,) = manager.tier_stores
    cache = scheduler(llm).kv_cache_manager.block_pool.cached_block_hash_to_block._cache
    device = {get_block_hash(k) for k in cache}
    hashes = block_hashes(tokens)
    keys = [h + bytes(4) for h in hashes]  # group 0's offload keys

    def on_root(key: bytes) -> bool:
        try:
            files.location(key)
        except KeyError:
            return False
        return True

    return {
        "gpu": [h in device for h in hashes],
        "cpu": [k in in_host for k in keys],
        "disk": [k in files for k in keys],
        "root": [on_root(k) for k in keys],
        "own_blocks": len(files.keys()),
        "peer_blocks": files.peer_blocks,
        "peer_scans": files.peer_scans,
    }


def _pool(llm: Any, tokens: list[int]) -> dict[str, Any]:
    from tests.vllm.engine import block_hashes, kvhex_manager

    manager = kvhex_manager(llm)
    in_host = set(manager.engine.host_keys())
    (store,) = manager.tier_stores
    (stats,) = manager.stats().tiers
    keys = [h + bytes(4) for h in block_hashes(tokens)]  # group 0's offload keys
    return {
        "keys": [k.hex() for k in keys],
        "cpu": [k in in_host for k in keys],
        "tier": [k in store for k in keys],
        "keys_put": stats.keys_put,
        "keys_promoted": stats.keys_promoted,
        "hits": stats.hits,
    }


def _settle(llm: Any) -> int:
    from tests.vllm.engine import generate, kvhex_manager

    manager = kvhex_manager(llm)
    for steps in range(SETTLE_STEPS):
        if not manager.has_pending_work():
            return steps
        generate(llm, IDLE)
    raise AssertionError(f"kvhex still had work in flight after {SETTLE_STEPS} requests")


def _serve(spec: dict[str, Any], answer: Any) -> None:
    from vllm.config import KVEventsConfig

    from tests.vllm.engine import generate, kvhex_transfer, offline_engine

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", **spec["events"])
    with offline_engine(
        Path(spec["model"]),
        kv_transfer_config=kvhex_transfer(spec["extra"]),
        kv_events_config=events,
        **spec.get("engine", {}),
    ) as llm:
        answer({"ready": True})
        for line in sys.stdin:
            command = json.loads(line)
            op = command.pop("op")
            if op == "exit":
                return
            try:
                if op == "generate":
                    value: Any = generate(llm, command["tokens"])
                elif op == "settle":
                    value = _settle(llm)
                elif op == "held":
                    value = _held(llm, command["tokens"])
                elif op == "pool":
                    value = _pool(llm, command["tokens"])
                else:
                    raise ValueError(f"unknown command {op!r}")
            except Exception:
                answer({"error": traceback.format_exc()})
            else:
                answer({"value": value})


def main() -> None:
    """Serve the engine ``sys.argv[1]`` describes (see the module docstring)."""
    # answers go to the real stdout; everything else writing to fd 1 goes to stderr
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(message: Any) -> None:
        replies.write(json.dumps(message) + "\n")

    _serve(json.loads(sys.argv[1]), answer)


if __name__ == "__main__":
    main()
