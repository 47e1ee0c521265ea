"""In-memory adapters that keep real bytes: a host buffer, a secondary tier, a block transfer
and an event sink, one module each.

What service tests and domain-only users run on. Per-instance state only (no class-level
stores). ``MemoryTierStore`` is a real tier in miniature (a byte capacity with LRU eviction
that announces its removals, asynchronous jobs that finish on a later ``poll``, deterministic
faults); ``MemoryBlockTransfer`` copies between ``bytearray`` "device" caches and host slots
with the same ``SlotLayout`` as the torch transfer, so the whole stack runs without torch.
"""

from kvhex.adapters.memory.host import MemoryHostBuffer
from kvhex.adapters.memory.sink import MemoryEventSink
from kvhex.adapters.memory.tier import MemoryTierStore
from kvhex.adapters.memory.transfer import MemoryBlockTransfer

__all__ = ["MemoryBlockTransfer", "MemoryEventSink", "MemoryHostBuffer", "MemoryTierStore"]
