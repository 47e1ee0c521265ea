"""Two real KV-aware routers for kvhex's tests, started on loopback as subprocesses of their own
virtual environments and driven over HTTP with the standard library: ``vllm-router`` 0.1.17
(``make`` builds ``.venv-router``, its python in ``KVHEX_ROUTER_PYTHON``) and Dynamo's selection
service (``ai-dynamo-runtime`` 1.6.1, ``.venv-dynamo``, ``KVHEX_DYNAMO_PYTHON``). Each reports
what it credits a prompt with; tests assert on that, never on which worker answered.

What the tests rely on (measured against a fake vLLM publisher, block size 32, two workers;
``tests/adapters/events/test_routers_fake.py`` checks the starred facts on every run):

vllm-router (``--policy kv_aware``, static ``--kv-event-source`` per worker):

* Credit per block: a medium ``CPU`` (any case) counts ``--kv-penalty-host`` (0.8),
  ``STORAGE``/``DISK`` ``--kv-penalty-disk`` (0.3), any ``ownership`` (any medium)
  ``--kv-penalty-external`` (0.6); every other medium (``GPU``, none, ``SHARED_STORAGE``,
  ``CPU_PINNED``, ``EXTERNAL``, custom) as the device, 1.0. ``locality`` changes nothing. The
  credit is the leading device run plus the best ONE lower tier's run right after it, rounded
  down (:func:`vllm_router_credit`): a prefix spread over CPU then STORAGE counts the CPU part
  only. (*)
* It hashes ``token_ids`` itself; hash values only link children to parents (in any medium),
  and may be bytes. A block whose parent it does not hold is dropped, in every medium, and not
  linked when the parent comes. (*) Removals are per medium and ownership (locality ignored),
  without reference counts: one removal drops a block announced twice. ``AllBlocksCleared``
  forgets every medium of that worker. (*) ``group_idx`` other than 0 and a LoRA the request
  does not name are not credited.
* Silent drops, no log line at debug, no counter: a non-empty ZMQ topic (no
  ``sequence advanced`` line either), a ``block_size`` other than ``--kv-event-block-size``. (*)
  ``token_ids`` short of ``block_size`` per hash keeps the whole blocks only.
* Replay: nothing is asked at start; the first live message past the sequence expected (0 for
  a late or restarted router) asks ``--kv-event-replay-source`` from that sequence. (*) A replay
  that skips a sequence (``WARN ... noncontiguous seq N, expected M``) leaves the worker with
  nothing it held, replayed batches included (*); a publisher whose sequence goes back
  (``restart seq 0 < N -> incarnation``) is taken as restarted: its old blocks are forgotten.
  kvhex's replay snapshot (sent under the last folded sequence) is therefore dropped whole.
* Reading it: only by routing. Each decision is logged at debug (``KV prefix decision ...
  worker=... credited_prefix_tokens=N``) for the chosen worker only; with no credit anywhere
  ties go to one worker. ``vllm_router_kv_placement_lookups_total{result="hit"}`` counts
  decisions made on the index (``outcome="prefix_cost"``), a credit of 0 included (with two
  real vLLM servers whose streams the router indexed): it does not say anything was credited;
  ``credited_prefix_tokens`` does. No endpoint shows the index (``/workers``, ``/get_loads``
  do not), so reading a credit sends a real request to a worker. The request's ``model`` goes
  to the worker as is (it must be what vLLM serves); ``--kv-event-model`` need not match it.

Dynamo's selection service (``python -m dynamo.select_service``, workers registered over HTTP):

* Media: ``GPU`` or none -> gpu; ``CPU``/``CPU_PINNED`` -> cpu, weighted
  ``DYN_ROUTER_HOST_CACHE_HIT_WEIGHT`` (0.75); ``STORAGE``/``DISK``/``EXTERNAL`` -> disk,
  ``DYN_ROUTER_DISK_CACHE_HIT_WEIGHT`` (0.25). Dropped: lowercase ``cpu``, ``SHARED_STORAGE``,
  ``OBJECT_STORE``, custom names, a ``locality`` other than ``LOCAL`` (any medium), any
  ``ownership``, ``group_idx`` 1. Credit = gpu + 0.75 (cpu - gpu) + 0.25 (disk - cpu) in the
  cumulative walk of :func:`tests.dynamo.expected_credit`. (*) Each tier is indexed on its own
  and ``EXTERNAL`` on one more: a batch's events can land out of order across them.
* gpu is strict (an orphan is dropped with ``WARN Failed to find parent block``); cpu and disk
  keep an orphan and link it when the parent comes. (*) No reference counts;
  ``AllBlocksCleared`` forgets every medium. Byte-string hashes fail the whole batch.
* Topics are not filtered (any topic is read). (*) A ``block_size`` other than the registered
  one is dropped with ``WARN Block not published``. (*)
* Replay: nothing at registration; the first message past the expected sequence asks the
  ``replay_endpoint`` (a string; a ``replay_endpoints`` map is ignored) from it (0 on a late
  join) (*); an incomplete replay is applied as far as it goes and warned about. A publisher
  whose sequence goes back is ignored, silently, until it passes the last sequence seen.
* Reading it without side effects: ``POST /overlap_scores`` (blocks per tier, every worker),
  ``POST /potential_loads`` (per worker, prompt tokens left to prefill, plus what reservations
  hold), ``POST /select`` without a ``selection_id`` (the chosen worker, its overlap and
  ``effective_prefill_tokens``; nothing booked). ``/select_and_reserve`` books load (*). It
  listens on 0.0.0.0.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self, TypeVar

import pytest

from tests.dynamo import BUILD as DYNAMO_BUILD
from tests.dynamo import MODEL, Credit, call, free_port
from tests.dynamo import PYTHON_VARIABLE as DYNAMO_VARIABLE

__all__ = [
    "ROUTER_BUILD",
    "ROUTER_VARIABLE",
    "Decision",
    "DynamoSelect",
    "Penalties",
    "Selection",
    "VllmRouter",
    "dynamo_select",
    "python_or_skip",
    "vllm_router",
    "vllm_router_credit",
    "vllm_router_tier",
]

ROUTER_VARIABLE = "KVHEX_ROUTER_PYTHON"
"""The environment variable naming the python whose ``vllm_router`` the tests start."""
ROUTER_BUILD = "make .venv-router/.kvhex-installed"
"""How vllm-router's environment is built (``make test`` does it and sets the variable)."""

T = TypeVar("T")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')


def python_or_skip(variable: str, what: str, build: str, venv: str) -> str:
    """The python ``variable`` names, or skip the test saying how to get one."""
    python = os.environ.get(variable)
    if not python:
        pytest.skip(
            f"{what} is not installed: {build} builds it, then set "
            f"{variable}=$PWD/{venv}/bin/python (make test does both)"
        )
    return python


class _Service:
    """A server in a process group of its own, its output in ``log_path``; stopped by its own
    pid (the group's id) on every path out, start failures included."""

    NAME = "service"
    STARTUP_TIMEOUT_S = 30.0

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 (open until close)
        self._proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def _launch(self, attempt: Callable[[], list[str]], env: Mapping[str, str] | None) -> None:
        """Start ``attempt()``'s command until it is ready (a free port may be taken before
        the server binds it: that is retried twice); close on any failure."""
        try:
            for _ in range(3):
                self._proc = subprocess.Popen(
                    attempt(),
                    stdin=subprocess.DEVNULL,
                    stdout=self._log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=None if env is None else {**os.environ, **env},
                )
                if self._wait_ready():
                    return
                self._stop()
            raise AssertionError(f"{self.NAME} did not start{self.context()}")
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> bool:
        """Whether the server answered; ``False`` when it exited (both exit when a port is
        taken, saying ``Address already in use``)."""
        assert self._proc is not None
        deadline = time.monotonic() + self.STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False  # exited: its log says why
            try:
                if self._ready():
                    return True
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(
            f"{self.NAME} not ready within {self.STARTUP_TIMEOUT_S} s{self.context()}"
        )

    def _ready(self) -> bool:
        raise NotImplementedError

    def call(
        self, method: str, path: str, body: object = None, *, timeout: float = 30
    ) -> tuple[int, Any]:
        """``method path`` on the server: the status and the decoded answer."""
        return call(self.url + path, method, body, timeout=timeout)

    def _stop(self) -> None:
        """Stop the process group (SIGTERM, then SIGKILL), by the server's own pid."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server and close its log. Idempotent."""
        self._stop()
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- waiting and reporting -----------------------------------------------------------
    def settle(self, observe: Callable[[], T], want: T, timeout: float = 15) -> T:
        """Observe until the observation equals ``want`` or ``timeout`` passed; the last one
        (events reach the index asynchronously: the caller asserts on what this returns)."""
        deadline = time.monotonic() + timeout
        while True:
            got = observe()
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def log_lines(self) -> list[str]:
        """The server's output so far, colour codes removed."""
        text = self.log_path.read_text("utf-8", "replace")
        return [_ANSI.sub("", line) for line in text.splitlines()]

    def warnings(self) -> list[str]:
        """Its ``WARN`` and ``ERROR`` lines so far."""
        return [line for line in self.log_lines() if " WARN " in line or " ERROR " in line]

    def context(self, lines: int = 30) -> str:
        """What to add to a failed assertion: where the log is, its first warnings and its
        last lines."""
        first = "\n".join(self.warnings()[:5]) or "(none)"
        tail = "\n".join(self.log_lines()[-lines:])
        return (
            f"\n--- {self.NAME} log ({self.log_path}); first warnings:\n{first}"
            f"\n--- last {lines} lines:\n{tail}"
        )


# -- vllm-router -----------------------------------------------------------------------------
class Penalties(NamedTuple):
    """vllm-router's credit per lower tier (``--kv-penalty-host/-external/-disk``)."""

    host: float = 0.8
    external: float = 0.6
    disk: float = 0.3


DEFAULT_PENALTIES = Penalties()


def vllm_router_tier(medium: str | None, ownership: str | None = None) -> str:
    """The tier vllm-router files a ``BlockStored`` under: gpu, host, external or disk."""
    if ownership is not None:
        return "external"
    name = (medium or "").upper()
    if name == "CPU":
        return "host"
    if name in ("STORAGE", "DISK"):
        return "disk"
    return "gpu"


def vllm_router_credit(
    held: Sequence[Collection[str]], block_size: int, penalties: Penalties = DEFAULT_PENALTIES
) -> int:
    """What vllm-router credits a prompt whose i-th block is held in the tiers ``held[i]``
    (:func:`vllm_router_tier` names): the leading gpu run, plus the best one lower tier's
    run right after it at that tier's penalty, in tokens rounded down."""
    gpu = 0
    while gpu < len(held) and "gpu" in held[gpu]:
        gpu += 1
    best = float(gpu)
    for tier, weight in zip(("host", "external", "disk"), penalties, strict=True):
        run = 0
        while gpu + run < len(held) and tier in held[gpu + run]:
            run += 1
        best = max(best, gpu + weight * run)
    return math.floor(best * block_size + 1e-9)  # a whole product stays whole


class Decision(NamedTuple):
    """One ``KV prefix decision`` line: the worker chosen, why (``outcome``: ``prefix_cost``
    is the lowest cost), and what it credited that worker with."""

    worker: str
    outcome: str
    input_tokens: int
    new_prefill_tokens: int
    credited_prefix_tokens: int
    fields: dict[str, str]


_SEQ = re.compile(r"kv_index (live|replay) sequence advanced source=(\S+) rank=\d+ seq=(\d+)")


class VllmRouter(_Service):
    """``vllm-router --policy kv_aware`` (or another ``policy``, which reads no events) on
    free loopback ports (HTTP and Prometheus), one static event source per worker, at
    ``--log-level debug`` (decisions are read from the log).

    ``sources`` maps each worker's URL to its publisher's PUB endpoint (the router's SUB
    connects); ``replay_sources`` the same for replay ROUTER endpoints. The router waits for
    every worker's ``/health`` before it listens: start it after the workers answer. Reading
    a decision needs requests one at a time. Failed assertions should end with :meth:`context`.
    """

    NAME = "vllm-router"

    def __init__(
        self,
        python: str,
        log_path: Path,
        sources: Mapping[str, str],
        *,
        replay_sources: Mapping[str, str] | None = None,
        block_size: int = 32,
        model: str = MODEL,
        penalties: Penalties = DEFAULT_PENALTIES,
        policy: str = "kv_aware",
        log_level: str = "debug",
        args: Sequence[str] = (),
    ) -> None:
        super().__init__(log_path)
        self.sources = dict(sources)
        self.model = model
        self.block_size = block_size
        self.penalties = penalties
        self.metrics_url = ""
        fixed = ["--policy", policy, "--log-level", log_level, "--worker-urls", *self.sources]
        if policy == "kv_aware":  # the only policy that reads events
            for worker, endpoint in self.sources.items():
                fixed += ["--kv-event-source", f"{worker}={endpoint}"]
            for worker, endpoint in (replay_sources or {}).items():
                fixed += ["--kv-event-replay-source", f"{worker}={endpoint}"]
            fixed += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
            fixed += ["--kv-penalty-host", str(penalties.host)]
            fixed += ["--kv-penalty-external", str(penalties.external)]
            fixed += ["--kv-penalty-disk", str(penalties.disk)]
        # give up on workers when the tests do, checking them every second
        fixed += ["--worker-startup-timeout-secs", str(int(self.STARTUP_TIMEOUT_S))]
        fixed += ["--worker-startup-check-interval", "1"]

        def attempt() -> list[str]:
            port, metrics = free_port(), free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
            return [
                *(python, "-m", "vllm_router.launch_router", "--host", "127.0.0.1"),
                *("--port", str(port), "--prometheus-host", "127.0.0.1"),
                *("--prometheus-port", str(metrics), *fixed, *args),
            ]

        self._launch(attempt, None)

    def _ready(self) -> bool:
        return self.call("GET", "/readiness", timeout=1)[0] == 200

    def complete(
        self, prompt: Sequence[int], max_tokens: int = 1, *, timeout: float = 300, **fields: Any
    ) -> Any:
        """``POST /v1/completions`` through the router (greedy, token ids, more ``fields``
        such as ``return_token_ids``): the answer."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens}
        body = {"temperature": 0, **body, **fields}
        status, answer = self.call("POST", "/v1/completions", body, timeout=timeout)
        assert status == 200, f"completion answered {status}: {answer}{self.context()}"
        return answer

    def route(
        self, prompt: Sequence[int], max_tokens: int = 1, *, timeout: float = 300, **fields: Any
    ) -> Decision:
        """Send ``prompt`` through the router and return the decision it logged for it (one
        request at a time: decisions carry no request id)."""
        before = len(self.decisions())
        self.complete(prompt, max_tokens, timeout=timeout, **fields)
        deadline = time.monotonic() + 5  # logged before the request goes out; flushed by line
        while not (decisions := self.decisions()[before:]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(decisions) == 1, f"{len(decisions)} decisions for one request{self.context()}"
        return decisions[0]

    def decisions(self) -> list[Decision]:
        """Every routing decision logged so far, oldest first."""
        found = []
        for line in self.log_lines():
            if "KV prefix decision" not in line:
                continue
            f = {k: v.strip('"') for k, v in _FIELD.findall(line.split("KV prefix decision")[1])}
            found.append(
                Decision(
                    f.get("worker", ""),
                    f.get("outcome", ""),
                    int(f.get("input_tokens", -1)),
                    int(f.get("new_prefill_tokens", -1)),
                    int(f.get("credited_prefix_tokens", -1)),
                    f,
                )
            )
        return found

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples, keyed as printed (``name{label="v"}``)."""
        status, text = call(self.metrics_url, "GET")
        assert status == 200, f"metrics answered {status}{self.context()}"
        samples = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def lookups(self) -> dict[str, float]:
        """``vllm_router_kv_placement_lookups_total`` by result (``hit``, ``miss``)."""
        prefix = 'vllm_router_kv_placement_lookups_total{result="'
        return {k[len(prefix) : -2]: v for k, v in self.metrics().items() if k.startswith(prefix)}

    def sequences(self, worker: str) -> list[tuple[str, int]]:
        """``(live|replay, sequence)`` of every batch it took from ``worker``'s publisher."""
        found = (_SEQ.search(line) for line in self.log_lines())
        return [(m[1], int(m[3])) for m in found if m is not None and m[2] == worker]

    def await_sequence(self, worker: str, seq: int, timeout: float = 15) -> None:
        """Wait until the batch ``seq`` from ``worker``'s publisher arrived, live or replayed."""
        deadline = time.monotonic() + timeout
        while all(s != seq for _, s in self.sequences(worker)):
            assert time.monotonic() < deadline, (
                f"no batch {seq} from {worker} in {timeout} s{self.context()}"
            )
            time.sleep(0.02)


# -- Dynamo's selection service ----------------------------------------------------------------
class Selection(NamedTuple):
    """A ``/select`` or ``/select_and_reserve`` answer: the worker, its cumulative overlap in
    tokens, and ``credit`` = prompt tokens - ``effective_prefill_tokens``."""

    worker_id: int
    endpoint: str
    overlap: Credit
    credit: int
    answer: dict[str, Any]


class DynamoSelect(_Service):
    """``python -m dynamo.select_service --threads 1`` on a free port, its output in
    ``log_path``; ``host_weight``/``disk_weight`` set ``DYN_ROUTER_HOST_CACHE_HIT_WEIGHT`` and
    ``DYN_ROUTER_DISK_CACHE_HIT_WEIGHT`` (0 and 0: the device only, vLLM's own view).

    It listens on ``0.0.0.0``: it has a ``--port`` flag and no host flag, so while a test runs
    it is reachable from other machines too (it holds only the test's blocks).
    """

    NAME = "Dynamo select service"

    def __init__(
        self,
        python: str,
        log_path: Path,
        *,
        host_weight: float | None = None,
        disk_weight: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(log_path)
        extra = dict(env or {})
        if host_weight is not None:
            extra["DYN_ROUTER_HOST_CACHE_HIT_WEIGHT"] = str(host_weight)
        if disk_weight is not None:
            extra["DYN_ROUTER_DISK_CACHE_HIT_WEIGHT"] = str(disk_weight)

        def attempt() -> list[str]:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            return [python, "-m", "dynamo.select_service", "--port", str(port), "--threads", "1"]

        self._launch(attempt, extra)

    def _ready(self) -> bool:
        return self.call("GET", "/health", timeout=1)[0] == 200

    def _ok(self, method: str, path: str, body: object = None, want: int = 200) -> Any:
        status, answer = self.call(method, path, body)
        assert status == want, f"{method} {path} answered {status}: {answer}{self.context()}"
        return answer

    def register(
        self,
        worker_id: int,
        endpoint: str,
        events: str,
        *,
        replay: str | None = None,
        block_size: int = 32,
        model: str = MODEL,
    ) -> Any:
        """Add (or replace) worker ``worker_id`` serving at ``endpoint``: its SUB connects to
        the PUB at ``events``, its DEALER to the replay ROUTER at ``replay``. The record."""
        body: dict[str, Any] = {
            "worker_id": worker_id,
            "model_name": model,
            "endpoint": endpoint,
            "block_size": block_size,
            "kv_events_endpoints": {"0": events},
        }
        if replay is not None:
            body["replay_endpoint"] = replay
        record = self._ok("POST", "/workers", body, want=201)
        assert record["lifecycle"] == "schedulable", f"{record}{self.context()}"
        return record

    def remove(self, worker_id: int) -> None:
        """Drop a worker and its listener."""
        self._ok("DELETE", f"/workers/{worker_id}")

    def workers(self) -> Any:
        """``GET /workers``: the catalog."""
        return self._ok("GET", "/workers")

    def overlaps(self, tokens: Sequence[int], model: str = MODEL) -> dict[int, Credit]:
        """Every worker's cumulative overlap with ``tokens`` in tokens (``/overlap_scores``,
        no side effects)."""
        answer = self._ok("POST", "/overlap_scores", {"model_name": model, "token_ids": [*tokens]})
        size = answer["block_size"]
        return {
            w["worker_id"]: Credit(
                w["device_blocks"] * size, w["host_pinned_blocks"] * size, w["disk_blocks"] * size
            )
            for w in answer["workers"]
        }

    def credits(self, tokens: Sequence[int], model: str = MODEL) -> dict[int, int]:
        """Every worker's weighted credit for ``tokens``, as the service prices it: prompt
        tokens minus its ``/potential_loads`` prefill, less what reservations already hold
        there (no side effects; exact while no reservation changes meanwhile)."""
        body = {"model_name": model, "token_ids": [*tokens]}
        potential = self._ok("POST", "/potential_loads", body)
        held = {
            w["worker_id"]: w["potential_prefill_tokens"]
            for group in self._ok("GET", "/loads")
            if group["model_name"] == model
            for w in group["loads"]
        }
        left = {w["worker_id"]: w["potential_prefill_tokens"] for w in potential}
        return {worker: len(tokens) - n + held.get(worker, 0) for worker, n in left.items()}

    def select(self, tokens: Sequence[int], model: str = MODEL) -> Selection:
        """The worker it would pick for ``tokens`` (``/select`` with no selection id: nothing
        booked, nothing cached)."""
        answer = self._ok("POST", "/select", {"model_name": model, "token_ids": [*tokens]})
        return self._selection(tokens, answer)

    def select_and_reserve(
        self, selection_id: str, tokens: Sequence[int], model: str = MODEL
    ) -> Selection:
        """Pick a worker for ``tokens`` and book its load under ``selection_id``."""
        body = {"selection_id": selection_id, "model_name": model, "token_ids": [*tokens]}
        return self._selection(tokens, self._ok("POST", "/select_and_reserve", body))

    def prefill_complete(self, selection_id: str) -> None:
        """Shift the reservation's load from prefill to decode (its first streamed chunk)."""
        self._ok("POST", f"/reservations/{selection_id}/prefill_complete", {})

    def release(self, selection_id: str) -> None:
        """Free the reservation (the request ended)."""
        self._ok("DELETE", f"/reservations/{selection_id}")

    def loads(self) -> Any:
        """``GET /loads``: active load per model and worker."""
        return self._ok("GET", "/loads")

    def dump(self) -> Any:
        """``GET /dump``: every block it holds, as store events per worker and tier."""
        return self._ok("GET", "/dump")

    def _selection(self, tokens: Sequence[int], answer: Any) -> Selection:
        overlap = answer["overlap"]  # in tokens
        return Selection(
            answer["worker_id"],
            answer["endpoint"],
            Credit(overlap["gpu"], overlap["cpu"], overlap["disk"]),
            len(tokens) - answer["effective_prefill_tokens"],
            answer,
        )


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture
def vllm_router(tmp_path: Path) -> Iterator[Callable[..., VllmRouter]]:
    """Starts vllm-routers (``VllmRouter``'s arguments after the python and log), each stopped
    after the test; skips where ``.venv-router`` was not built (``make test`` builds it)."""
    python = python_or_skip(ROUTER_VARIABLE, "vllm-router", ROUTER_BUILD, ".venv-router")
    started: list[VllmRouter] = []

    def start(sources: Mapping[str, str], **options: Any) -> VllmRouter:
        log = tmp_path / f"vllm-router-{len(started)}.log"
        router = VllmRouter(python, log, sources, **options)
        started.append(router)
        return router

    try:
        yield start
    finally:
        for router in started:
            router.close()


@pytest.fixture
def dynamo_select(tmp_path: Path) -> Iterator[Callable[..., DynamoSelect]]:
    """Starts Dynamo selection services (``DynamoSelect``'s keyword arguments), each stopped
    after the test; skips where ``.venv-dynamo`` was not built (``make test`` builds it)."""
    python = python_or_skip(DYNAMO_VARIABLE, "Dynamo's runtime", DYNAMO_BUILD, ".venv-dynamo")
    started: list[DynamoSelect] = []

    def start(**options: Any) -> DynamoSelect:
        service = DynamoSelect(python, tmp_path / f"dynamo-select-{len(started)}.log", **options)
        started.append(service)
        return service

    try:
        yield start
    finally:
        for service in started:
            service.close()
