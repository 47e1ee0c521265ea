"""``EventSink``: where public KV-event batches go (ZMQ, a JSONL file, logs, memory)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvhex.domain.events import EventBatch


@runtime_checkable
class EventSink(Protocol):
    """Receives one batch per scheduler step, in order."""

    def publish(self, batch: EventBatch) -> None:
        """Hand over one batch. Called from the scheduler thread; must not block on the
        network (queue and send from a thread of its own). Batches arrive in order and the
        sink must keep that order. Raises ``RuntimeError`` after ``close``."""
        ...

    def close(self) -> None:
        """Flush what can be flushed within a short bound and release sockets and files.
        Idempotent."""
        ...
