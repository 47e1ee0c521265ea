"""kvhex's pure domain: values and state machines, no IO, no clocks, no threads.

Imports only the standard library, attrs and ``kvhex.errors``. Read ``keys``, ``tiers``,
``request`` and ``events`` first, then ``primary`` (the host tier's state machine).
"""

from kvhex.domain.backpressure import AdmissionPolicy, AlwaysAdmit, EmaBackpressure
from kvhex.domain.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cleared,
    EventBatch,
    PublicEvent,
    Removed,
    Stored,
    TierEvent,
)
from kvhex.domain.geometry import CacheKind, KvGeometry, KvGroup
from kvhex.domain.jobs import JobId, JobKind, JobResult, TierJob
from kvhex.domain.keys import (
    OffloadKey,
    make_offload_key,
    offload_key_group,
    offload_key_hash,
    unpack_offload_key,
)
from kvhex.domain.policies import ArcPolicy, EvictionPolicy, LruPolicy, PolicyFactory
from kvhex.domain.primary import PrimaryStats, PrimaryTier, StorePlan
from kvhex.domain.provenance import MmFeature, Provenance
from kvhex.domain.request import ReqContext
from kvhex.domain.residency import Reservation, Residency, Snapshot
from kvhex.domain.slot_layout import ByteRange, ChunkRun, SlotLayout
from kvhex.domain.tiers import (
    Locality,
    LookupResult,
    Medium,
    OffloadPolicy,
    TierFilter,
    TierIdentity,
    TierMatcher,
)
from kvhex.domain.transfer import TransferJob, TransferKind, TransferResult
from kvhex.domain.translate import EventTranslator

__all__ = [
    "AdmissionPolicy",
    "AllBlocksCleared",
    "AlwaysAdmit",
    "ArcPolicy",
    "BlockRemoved",
    "BlockStored",
    "ByteRange",
    "CacheKind",
    "ChunkRun",
    "Cleared",
    "EmaBackpressure",
    "EventBatch",
    "EventTranslator",
    "EvictionPolicy",
    "JobId",
    "JobKind",
    "JobResult",
    "KvGeometry",
    "KvGroup",
    "Locality",
    "LookupResult",
    "LruPolicy",
    "Medium",
    "MmFeature",
    "OffloadKey",
    "OffloadPolicy",
    "PolicyFactory",
    "PrimaryStats",
    "PrimaryTier",
    "Provenance",
    "PublicEvent",
    "Removed",
    "ReqContext",
    "Reservation",
    "Residency",
    "SlotLayout",
    "Snapshot",
    "StorePlan",
    "Stored",
    "TierEvent",
    "TierFilter",
    "TierIdentity",
    "TierJob",
    "TierMatcher",
    "TransferJob",
    "TransferKind",
    "TransferResult",
    "make_offload_key",
    "offload_key_group",
    "offload_key_hash",
    "unpack_offload_key",
]
