"""Ports: the small ``typing.Protocol`` boundaries between the service and technology.

Each port lives in its own module, speaks only domain types, and documents per method who
calls it, from which thread, whether it blocks, who owns buffers and what it raises. The
eviction-policy boundary lives in :mod:`kvhex.domain.policies.base` because the pure primary
tier itself drives it.
"""

from kvhex.ports.capabilities import Closeable, TenantRefusals, TierHealth
from kvhex.ports.codec import BlockCodec, CodecCorrupt, CodecRefused, RecordSealing
from kvhex.ports.event_sink import EventSink
from kvhex.ports.events import EventSource
from kvhex.ports.host_buffer import HostBuffer
from kvhex.ports.tier_store import (
    Deletes,
    Indexed,
    Occupancy,
    PeerView,
    RequestAware,
    ScheduledWork,
    TierStore,
)
from kvhex.ports.transfer import BlockTransfer

__all__ = [
    "BlockCodec",
    "BlockTransfer",
    "Closeable",
    "CodecCorrupt",
    "CodecRefused",
    "Deletes",
    "EventSink",
    "EventSource",
    "HostBuffer",
    "Indexed",
    "Occupancy",
    "PeerView",
    "RecordSealing",
    "RequestAware",
    "ScheduledWork",
    "TenantRefusals",
    "TierHealth",
    "TierStore",
]
