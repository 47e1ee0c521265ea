"""``EventPipeline``: raw tier events -> translator -> sinks, one batch per step."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from kvhex.domain.events import EventBatch, PublicEvent, TierEvent
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.translate import EventTranslator
from kvhex.ports.event_sink import EventSink
from kvhex.service.stats import EventStats, SinkStats

log = structlog.get_logger(__name__)


class EventPipeline:
    """Translates each step's raw events and publishes them as one batch to every sink.

    A sink that fails is logged and counted; the others still receive the batch, and the
    engine keeps running (events are observability, never a reason to stop serving).
    """

    def __init__(
        self,
        translator: EventTranslator | None = None,
        sinks: Sequence[EventSink] = (),
        *,
        clock: Callable[[], float] = time.time,
        data_parallel_rank: int | None = None,
    ) -> None:
        self.translator = translator or EventTranslator()
        self.sinks = list(sinks)
        self._clock = clock
        self._rank = data_parallel_rank
        self.batches_published = 0
        self.publish_failures = 0
        self.events_published: dict[tuple[str, str], int] = {}
        """Public events published (to the sinks, or taken by the host engine), per (event
        type, medium); ``AllBlocksCleared`` carries no medium and counts under ``""``."""
        self.sink_batches: list[int] = [0] * len(self.sinks)
        """Batches each sink (by position) took."""
        self.sink_failures: list[int] = [0] * len(self.sinks)
        """Batches each sink refused (its ``publish`` raised): lost for that sink."""

    def process(self, raw: list[TierEvent]) -> list[PublicEvent]:
        """Translate ``raw`` (releasing the contexts it carried); publish the result as one
        batch if it is not empty; return the public events."""
        events = self.translator.translate(raw)
        raw.clear()  # the raw events, and the request contexts they hold, are done
        counts = self.events_published
        for event in events:
            kind = (type(event).__name__, getattr(event, "medium", None) or "")
            counts[kind] = counts.get(kind, 0) + 1
        if events and self.sinks:
            batch = EventBatch(self._clock(), events, self._rank)
            if len(self.sink_batches) < len(self.sinks):  # sinks appended to the list
                grow = len(self.sinks) - len(self.sink_batches)
                self.sink_batches += [0] * grow
                self.sink_failures += [0] * grow
            for i, sink in enumerate(self.sinks):
                try:
                    sink.publish(batch)
                    self.sink_batches[i] += 1
                except Exception as exc:
                    self.publish_failures += 1
                    self.sink_failures[i] += 1
                    log.warning(
                        "event_sink_publish_failed", sink=type(sink).__name__, error=repr(exc)
                    )
            self.batches_published += 1
        return events

    def set_geometry(self, geometry: KvGeometry | None) -> None:
        """Describe full events with ``geometry`` (the model's KV groups) from now on."""
        self.translator.geometry = geometry

    def add_sink(self, sink: EventSink) -> None:
        """Publish to ``sink`` too, from the next batch on (closed with the others)."""
        self.sinks.append(sink)

    def stats(self) -> EventStats:
        """A copy of the counts, the translator's included."""
        translator = self.translator
        sent, dropped = list(self.sink_batches), list(self.sink_failures)
        sinks = tuple(
            SinkStats(type(sink).__name__, *((sent[i], dropped[i]) if i < len(sent) else (0, 0)))
            for i, sink in enumerate(list(self.sinks))
        )
        return EventStats(
            dict(self.events_published),
            self.batches_published,
            self.publish_failures,
            sinks,
            translator.full_stores,
            translator.placeholder_stores,
        )

    def close(self) -> None:
        """Close every sink; failures are logged, not raised."""
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:
                log.warning("event_sink_close_failed", sink=type(sink).__name__, error=repr(exc))
