"""``EventSource``: anything that owns storage and announces its changes as raw tier events."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvhex.domain.events import TierEvent


@runtime_checkable
class EventSource(Protocol):
    """Owns some storage and reports every change to it, in order."""

    def take_events(self) -> list[TierEvent]:
        """Events since the last call, oldest first; the source forgets them.

        Called by the tiering manager on the scheduler thread once per step. Never blocks.
        A ``Stored`` is reported only for bytes that are readable; a failed store is never
        announced; a removal is reported for every key that stops being readable.
        """
        ...
