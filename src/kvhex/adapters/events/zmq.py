"""A ZMQ PUB event sink speaking vLLM's KV-event protocol, with a replay ROUTER.

Wire-compatible with vLLM 0.33's ``ZmqEventPublisher``: each batch goes out as the multipart
message ``(topic, sequence as 8-byte big-endian, msgpack payload)``; a subscriber that missed
batches sends the first sequence it wants (8-byte big-endian) to the replay socket (a DEALER
talking to our ROUTER) and receives every buffered ``(topic, sequence, payload)`` from there
on, then an end marker ``(b"", -1 as 8-byte signed big-endian, b"")``. The endpoint's TCP port
is offset by the data-parallel rank (``inproc`` endpoints get a ``_dp{rank}`` suffix).
Endpoints containing ``*`` or ``::``, and ``ipc://``/``inproc://`` ones, are bound; others are
connected to. Sending happens on a thread of the sink's own; ``publish`` only enqueues.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque

import structlog
import zmq

from kvhex.adapters.events.wire import encode_batch
from kvhex.domain.events import EventBatch

__all__ = ["ZmqEventSink", "offset_endpoint"]

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


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventSink:
    """Publishes batches on a ZMQ PUB socket (and serves replays), like vLLM's publisher.

    Args:
        endpoint: PUB address, e.g. ``tcp://*:5557`` (bind) or ``tcp://host:5557`` (connect).
        replay_endpoint: optional ROUTER address for replay requests (always bound).
        data_parallel_rank: offsets the ports; stamped on batches that carry none.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark.
        max_queue_size: batches queued for the sender thread before ``publish`` blocks.
        topic: the first frame of every message.
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
    ) -> None:
        self.data_parallel_rank = data_parallel_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode("utf-8")
        self._seq = itertools.count()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        resolved = offset_endpoint(endpoint, data_parallel_rank)
        assert resolved is not None
        try:
            if _binds(resolved):
                self._pub.bind(resolved)
                resolved = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(resolved)
            replay = offset_endpoint(replay_endpoint, data_parallel_rank)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(replay)
                replay = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint: str = resolved
        self.replay_endpoint: str | None = replay
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
        """Send what is queued (bounded by one second), then close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("zmq_event_sink_close_timed_out", queued=self._queue.qsize())
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

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
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("zmq_replay_request_invalid", frames=len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
