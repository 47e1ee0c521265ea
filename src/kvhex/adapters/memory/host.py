"""``MemoryHostBuffer``: the host primary tier's bytes in an ordinary ``bytearray``."""

from __future__ import annotations


class MemoryHostBuffer:
    """``num_slots`` x ``slot_bytes`` of ordinary host memory (a ``bytearray``)."""

    __slots__ = ("_buffer", "_view", "num_slots", "slot_bytes")

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        if num_slots < 0 or slot_bytes <= 0:
            raise ValueError(
                f"need num_slots >= 0 and slot_bytes > 0, got {num_slots}, {slot_bytes}"
            )
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self._buffer: bytearray | None = bytearray(num_slots * slot_bytes)
        self._view: memoryview | None = memoryview(self._buffer)

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of one slot. ``IndexError`` outside the buffer or after close."""
        if self._view is None:
            raise IndexError("host buffer is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        start = slot * self.slot_bytes
        return self._view[start : start + self.slot_bytes]

    def close(self) -> None:
        """Release the memory. Views handed out before stay valid until dropped."""
        self._view = None
        self._buffer = None

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._view is None
