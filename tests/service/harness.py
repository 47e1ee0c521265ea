"""A small world for service tests: host buffer, primary tier, in-memory secondary tiers, and
a fake device that writes known bytes into host slots."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvhex.adapters.memory import MemoryHostBuffer, MemoryTierStore
from kvhex.domain import (
    LookupResult,
    LruPolicy,
    OffloadKey,
    PrimaryTier,
    ReqContext,
    make_offload_key,
)
from kvhex.service import TieringManager

SLOT_BYTES = 64


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def payload(k: OffloadKey) -> bytes:
    """The bytes the fake device computes for chunk ``k``."""
    return hashlib.shake_256(k).digest(SLOT_BYTES)


class World:
    def __init__(
        self,
        num_slots: int = 8,
        tiers: int = 2,
        tier_capacity_slots: int = 64,
        complete_after_polls: int = 1,
    ) -> None:
        self.host = MemoryHostBuffer(num_slots, SLOT_BYTES)
        self.primary = PrimaryTier(num_slots, LruPolicy(num_slots))
        self.tiers = [
            MemoryTierStore(
                self.host,
                capacity_bytes=tier_capacity_slots * SLOT_BYTES,
                name=f"mem{i}",
                complete_after_polls=complete_after_polls,
            )
            for i in range(tiers)
        ]
        self.manager = TieringManager(self.primary, self.tiers, host=self.host)

    def store(
        self, ids: Sequence[int], ctx: ReqContext, *, success: bool = True
    ) -> list[OffloadKey]:
        """Device -> host store of chunks ``ids``: prepare, write bytes, complete."""
        plan = self.manager.prepare_store(keys(*ids), ctx)
        assert plan is not None
        for k, slot in zip(plan.keys, plan.slots, strict=True):
            self.host.slot_view(slot)[:] = payload(k)
        self.manager.complete_store(plan.keys, ctx, success)
        return plan.keys

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.manager.on_schedule_end()

    def lookup(self, ids: Sequence[int], ctx: ReqContext) -> list[LookupResult]:
        return [self.manager.lookup(k, ctx) for k in keys(*ids)]

    def host_bytes(self, k: OffloadKey) -> bytes:
        slot = self.primary.slot_of(k)
        assert slot is not None
        return bytes(self.host.slot_view(slot))
