"""``HostBuffer``: the primary tier's bytes, one fixed-size region per slot."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class HostBuffer(Protocol):
    """Host memory behind the primary tier's slots (pinned where a GPU exists).

    Owned by the engine (or the composition root), never by a tier: tiers borrow slot views for
    the duration of a job, and the buffer must outlive every tier that may still use it.
    """

    @property
    def num_slots(self) -> int:
        """Number of slots."""
        ...

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (one chunk: every layer and group of ``blocks_per_chunk`` blocks)."""
        ...

    def slot_view(self, slot: int) -> memoryview:
        """A writable, zero-copy view of one slot's bytes.

        Called by tiers from any thread while a job holds the slot. Never copies. Raises
        ``IndexError`` for a slot outside ``0..num_slots-1``.
        """
        ...
