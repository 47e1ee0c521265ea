"""``ReqContext``: one object per request, riding every call and every asynchronous job.

Compared by identity: two requests with the same id (a retried request, an id reused after the
first finished) are different contexts, and a late completion finalizes the context it carries,
never "whatever request now has that id". It keeps the key -> end-token position records that
later let the event translator find a stored chunk's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvhex.domain.keys import OffloadKey
from kvhex.domain.provenance import Provenance
from kvhex.domain.tiers import TierFilter


# validated when built, not on every later assignment, and by a hand-written __init__: one is
# built per request on the scheduler's hot path, where attrs' validator and per-assignment
# hook would take 70% more time
@attrs.define(eq=False, slots=True, weakref_slot=True, on_setattr=attrs.setters.NO_OP, init=False)
class ReqContext:
    """Request provenance. Hashable and equal by identity only.

    Attributes:
        req_id: the engine's request id (not unique over time).
        transfer_params: the engine's ``kv_transfer_params`` for the request, if any.
        tier_filter: which secondary tiers the request may load from.
        provenance: what full ``BlockStored`` events are built from (live references to the
            request's tokens and hashes, geometry, LoRA, multimodal inputs, salt); ``None``
            for work with no local request behind it (events then carry placeholders).
    """

    req_id: str
    transfer_params: Mapping[str, Any] | None = None
    tier_filter: TierFilter = TierFilter.ALL
    provenance: Provenance | None = None
    _positions: dict[OffloadKey, int] = attrs.field(factory=dict, init=False, repr=False)

    def __init__(
        self,
        req_id: str,
        transfer_params: Mapping[str, Any] | None = None,
        tier_filter: TierFilter = TierFilter.ALL,
        provenance: Provenance | None = None,
    ) -> None:
        if not isinstance(req_id, str):
            raise TypeError(f"'req_id' must be a str (got {req_id!r})")
        self.req_id = req_id
        self.transfer_params = transfer_params
        self.tier_filter = tier_filter
        self.provenance = provenance
        self._positions = {}

    def record_position(self, key: OffloadKey, end_token: int) -> None:
        """Remember that ``key``'s chunk ends at token ``end_token`` (exclusive) in this request."""
        self._positions[key] = end_token

    def position(self, key: OffloadKey) -> int | None:
        """The end-token position of ``key``'s chunk (or partial tail) in this request:
        recorded, or else found by its hash among the request's live block hashes."""
        end = self._positions.get(key)
        if end is None and self.provenance is not None:
            end = self.provenance.hash_position(key[:-4])
        return end

    @property
    def recorded_positions(self) -> Mapping[OffloadKey, int]:
        """The end-token positions recorded so far (read-only)."""
        return self._positions

    @property
    def recorded_keys(self) -> int:
        """How many key positions are recorded."""
        return len(self._positions)
