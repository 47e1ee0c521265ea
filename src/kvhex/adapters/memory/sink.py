"""``MemoryEventSink``: keeps every published batch (tests, embedding)."""

from __future__ import annotations

from kvhex.domain.events import EventBatch


class MemoryEventSink:
    """Keeps every published batch in a list (for tests and embedding)."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.closed = False

    def publish(self, batch: EventBatch) -> None:
        """Append ``batch``."""
        if self.closed:
            raise RuntimeError("memory event sink is closed")
        self.batches.append(batch)

    def close(self) -> None:
        """Refuse further batches."""
        self.closed = True
