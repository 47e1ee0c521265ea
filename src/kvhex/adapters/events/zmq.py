"""A ZMQ PUB event sink speaking vLLM's KV-event protocol, with a replay ROUTER.

Wire-compatible with vLLM 0.33's ``ZmqEventPublisher``: each batch goes out as the multipart
message ``(topic, sequence as 8-byte big-endian, msgpack payload)``; a subscriber that missed
batches sends the first sequence it wants (8-byte big-endian) to the replay socket (a DEALER
talking to our ROUTER) and receives every buffered ``(topic, sequence, payload)`` from there
on, then an end marker ``(b"", -1 as 8-byte signed big-endian, b"")``. The endpoint's TCP port
is offset by the data-parallel rank (``inproc`` endpoints get a ``_dp{rank}`` suffix). A
subscriber asking from a sequence older than the buffer gets, first, a snapshot of what the
older batches still announce (:class:`~kvhex.adapters.events.replay.ReplayLog`): nothing a
late or restarted indexer asks for is lost.

Bind or connect is said, not guessed: the PUB socket binds ``endpoint`` (``tcp://127.0.0.1:N``
is reachable from this machine only, ``tcp://*:N`` from everywhere) unless ``connect=True``
(a broker, or ``kvhex events --bind``); the replay socket always binds. vLLM guesses from the
address instead (``*`` binds, a host name connects), which made two programs that both
connect look like a quiet stream. Sending happens on a thread of the sink's own; ``publish``
only enqueues; ``close`` sends what is queued and gives subscribers up to a second to get it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import structlog
import zmq

from kvhex.adapters.events.endpoints import endpoint_problem, refusal
from kvhex.adapters.events.replay import ReplayLog
from kvhex.adapters.events.wire import encode_batch
from kvhex.domain.events import EventBatch
from kvhex.errors import ConfigError

log = structlog.get_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """vLLM's rule: TCP port + rank (port 0 and ``*`` stay), inproc gets ``_dp{rank}``."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{base}:{int(port) + rank}"
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} must start with tcp:// or inproc://")


def _offset(endpoint: str, rank: int, *, bind: bool) -> tuple[str | None, str]:
    """``endpoint`` offset by ``rank``, and what is wrong with the result (``None``: fine)."""
    try:
        moved = offset_endpoint(endpoint, rank)
    except ValueError:
        return f"data-parallel rank {rank} needs a tcp:// or inproc:// endpoint", endpoint
    assert moved is not None  # a non-empty endpoint stays one
    problem = endpoint_problem(moved, bind=bind)
    if problem is not None:
        problem = f"offset by data-parallel rank {rank} to {moved!r}: {problem}"
    return problem, moved


class ZmqEventSink:
    """Publishes batches on a ZMQ PUB socket (and serves replays), like vLLM's publisher.

    Args:
        endpoint: the PUB address, bound: ``tcp://127.0.0.1:5557`` (this machine only),
            ``tcp://*:5557`` (every interface), ``tcp://127.0.0.1:*`` (any free port: see
            :attr:`endpoint`), ``ipc://PATH``.
        replay_endpoint: optional ROUTER address for replay requests (always bound).
        connect: connect the PUB socket to ``endpoint`` instead of binding it (the
            subscriber or a broker binds).
        data_parallel_rank: offsets the ports; stamped on batches that carry none.
        buffer_steps: batches kept whole for replay; older ones are folded into a snapshot
            of the blocks they still announce, sent first to a subscriber asking from
            before the buffer.
        hwm: the PUB socket's high-water mark.
        max_queue_size: batches queued for the sender thread before ``publish`` blocks.
        topic: the first frame of every message.

    Raises:
        ConfigError: an endpoint that cannot be used, naming the option and what would work.
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        connect: bool = False,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        self.data_parallel_rank = data_parallel_rank
        wanted = {"endpoint": (endpoint, not connect)}
        if replay_endpoint is not None:
            wanted["replay_endpoint"] = (replay_endpoint, True)
        resolved: dict[str, str] = {}
        issues = []
        for option, (value, binds) in wanted.items():
            problem = endpoint_problem(value, bind=binds)
            if problem is None:
                problem, resolved[option] = _offset(value, data_parallel_rank, bind=binds)
            if problem is not None:
                issues.append((option, f"{option} {value!r}: {problem}"))
        if issues:
            raise ConfigError(issues)
        pub_at, replay_at = resolved["endpoint"], resolved.get("replay_endpoint")
        # in-process subscribers share the process-wide context; anything else gets a context
        # of its own, so close can wait for the last messages to leave (ctx.term)
        inproc = pub_at.startswith("inproc://")
        self._own_ctx = not inproc
        self._ctx: zmq.Context[zmq.Socket[bytes]] = (
            zmq.Context.instance() if inproc else zmq.Context()
        )
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._log = ReplayLog(buffer_steps, encode_batch)
        self._topic = topic.encode("utf-8")
        self._seq = itertools.count()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        option, at = "endpoint", pub_at
        try:
            if "[" in pub_at:
                self._pub.setsockopt(zmq.IPV6, 1)
            if connect:
                self._pub.connect(pub_at)
            else:
                self._pub.bind(pub_at)
                pub_at = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay_at is not None:
                option, at = "replay_endpoint", replay_at
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                if "[" in replay_at:
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(replay_at)
                replay_at = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets(linger_ms=0)
            pub = option == "endpoint"
            problem = refusal(exc.errno, exc.strerror, bind=not (pub and connect), may_connect=pub)
            raise ConfigError([(option, f"{option} {at!r}: {problem}")]) from exc
        self.endpoint: str = pub_at
        """Where the PUB socket is bound (a ``*`` port resolved) or connected."""
        self.replay_endpoint: str | None = replay_at
        """Where the replay ROUTER is bound, if any."""
        self.batches_sent = 0
        """Batches the sender thread has put on the wire (and holds for replay)."""
        log.info(
            "zmq_event_sink_started",
            endpoint=self.endpoint,
            mode="connect" if connect else "bind",
            replay_endpoint=self.replay_endpoint,
        )
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvhex-zmq-events", daemon=True)
        self._thread.start()

    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending (stamping the data-parallel rank if it has none)."""
        if not self._running:
            raise RuntimeError("ZMQ event sink is closed")
        if batch.data_parallel_rank is None:
            batch = EventBatch(batch.ts, batch.events, self.data_parallel_rank)
        self._queue.put(batch)

    def close(self) -> None:
        """Send what is queued, give connected subscribers up to ``SHUTDOWN_TIMEOUT_S`` to
        receive it, then close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("zmq_event_sink_close_timed_out", queued=self._queue.qsize())
        self._close_sockets(linger_ms=int(self.SHUTDOWN_TIMEOUT_S * 1000))

    def _close_sockets(self, *, linger_ms: int) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._own_ctx:
            self._ctx.term()  # returns once the last messages left, or the linger ran out

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except zmq.ZMQError as exc:
                    log.warning("zmq_replay_failed", error=repr(exc))
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq = next(self._seq)
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as exc:
                log.warning("zmq_publish_failed", seq=seq, error=repr(exc))
                time.sleep(0.01)
            self._log.append(seq, batch, payload)
            self.batches_sent += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("zmq_replay_request_invalid", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._log.since(first):
            self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
