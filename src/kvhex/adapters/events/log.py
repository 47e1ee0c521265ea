"""An event sink that logs a one-line summary of every batch through structlog."""

from __future__ import annotations

from collections import Counter

import structlog

from kvhex.domain.events import BlockRemoved, BlockStored, EventBatch

log = structlog.get_logger(__name__)


class StructlogEventSink:
    """Logs ``kv_events_published`` with event counts per type and medium (no token ids)."""

    def __init__(self) -> None:
        self._closed = False

    def publish(self, batch: EventBatch) -> None:
        """Log one summary line."""
        if self._closed:
            raise RuntimeError("log event sink is closed")
        counts: Counter[str] = Counter()
        placeholders = 0
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                counts[f"{type(event).__name__}:{event.medium}"] += 1
                if isinstance(event, BlockStored) and event.is_placeholder:
                    placeholders += 1
            else:
                counts[type(event).__name__] += 1
        log.info(
            "kv_events_published",
            ts=batch.ts,
            events=len(batch.events),
            placeholders=placeholders,
            **dict(counts),
        )

    def close(self) -> None:
        """Stop accepting batches."""
        self._closed = True
