"""Raw tier events: what one tier says about the storage it owns.

A tier (the host primary tier, a file tier, an object store) appends these as its state
changes; nothing sends them from the domain. A composing manager only concatenates its tiers'
streams and never builds one of its own. Translation into vLLM-compatible public events
(``BlockStored`` with full provenance, ``BlockRemoved``, ``AllBlocksCleared``) happens later,
outside the domain state machines.

Ordering contract per tier: a ``Removed`` for keys evicted to make room is appended before the
``Stored`` of the keys that reuse that capacity; ``Stored`` is appended only when the keys are
readable; a failed store appends nothing.
"""

from __future__ import annotations

import attrs

from kvhex.domain.keys import OffloadKey
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import TierIdentity

__all__ = ["Cleared", "Removed", "Stored", "TierEvent"]


@attrs.frozen(slots=True)
class Stored:
    """``keys`` became readable on ``tier``; ``ctx`` is the request whose work stored them
    (``None`` only for work with no request behind it)."""

    keys: tuple[OffloadKey, ...]
    tier: TierIdentity
    ctx: ReqContext | None = None


@attrs.frozen(slots=True)
class Removed:
    """``keys`` left ``tier`` (evicted, deleted, or found corrupt)."""

    keys: tuple[OffloadKey, ...]
    tier: TierIdentity


@attrs.frozen(slots=True)
class Cleared:
    """Every key of ``tier`` is gone at once (a reset)."""

    tier: TierIdentity


TierEvent = Stored | Removed | Cleared
