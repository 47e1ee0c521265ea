"""The announcer: stores parent-first and in chains, one residency per public identity,
keys waiting for their parent across steps (or, with the device's own events, to the step's
end), removals of waiting keys never announced."""

from __future__ import annotations

from kvhex.domain import Cleared, Locality, Medium, Removed, Stored, TierIdentity
from kvhex.domain.announce import Announcer
from kvhex.domain.events import BlockStored, TierEvent
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import record_of
from kvhex.domain.translate import EventTranslator
from tests.domain.requests import chunk_key, make_request

GROUP = KvGroup(0, tokens_per_block=4, blocks_per_chunk=2)
GEO = KvGeometry((GROUP,), tokens_per_hash=4)
CPU = TierIdentity(Medium.CPU)
FILES = TierIdentity(Medium.STORAGE, Locality.LOCAL, "files")
MORE = TierIdentity(Medium.STORAGE, Locality.LOCAL, "more")
ANON = TierIdentity(Medium.STORAGE, Locality.LOCAL)


def request(chunks: int = 4, **prov: object):  # type: ignore[no-untyped-def]
    ctx = make_request("r", list(range(100, 100 + 8 * chunks)), GEO, **prov)
    return ctx, [chunk_key(ctx, c, GROUP) for c in range(chunks)]


def stores(events: list[TierEvent]) -> list[tuple[TierIdentity, tuple[OffloadKey, ...]]]:
    return [(e.tier, e.keys) for e in events if isinstance(e, Stored)]


def test_a_jobs_keys_in_any_order_leave_as_one_chain_parent_first() -> None:
    ctx, keys = request(4)
    scrambled = (keys[2], keys[0], keys[3], keys[1])
    out = Announcer().order([Stored(scrambled, CPU, ctx)])
    assert stores(out) == [(CPU, tuple(keys))]
    (chain,) = EventTranslator(GEO).translate(out)
    assert isinstance(chain, BlockStored)
    prov = ctx.provenance
    assert prov is not None
    assert chain.block_hashes == list(prov.block_hashes)  # 4 chunks x 2 blocks, in order
    assert chain.parent_block_hash is None
    assert chain.token_ids == list(range(100, 132))


def test_a_child_waits_across_steps_and_follows_its_parent_at_once() -> None:
    ctx, keys = request(3)
    ann = Announcer()
    assert ann.order([Stored((keys[1], keys[2]), FILES, ctx)]) == []
    assert ann.waiting(FILES) == {keys[1], keys[2]}
    out = ann.order([Stored((keys[0],), CPU, ctx)])
    assert stores(out) == [(CPU, (keys[0],)), (FILES, (keys[1], keys[2]))]
    assert ann.waiting(FILES) == frozenset()
    # translated, the released keys are one chain under the CPU chunk
    _, chain = EventTranslator(GEO).translate(out)
    assert isinstance(chain, BlockStored)
    assert chain.parent_block_hash == keys[0][:-4]
    assert len(chain.block_hashes) == 4


def test_a_key_whose_parent_another_tier_announced_goes_now_the_rest_waits() -> None:
    ctx, keys = request(3)
    ann = Announcer()
    ann.order([Stored((keys[1],), CPU, ctx)])  # waits for keys[0]
    out = ann.order([Stored((keys[1], keys[2]), FILES, ctx)])
    assert out == []
    out = ann.order([Stored((keys[0],), CPU, ctx)])
    assert stores(out) == [(CPU, (keys[0], keys[1])), (FILES, (keys[1], keys[2]))]


def test_a_waiting_key_removed_is_never_announced_and_its_child_waits_for_it() -> None:
    ctx, keys = request(3)
    ann = Announcer()
    ann.order([Stored((keys[1], keys[2]), FILES, ctx)])
    assert ann.order([Removed((keys[1],), FILES)]) == []
    assert ann.waiting(FILES) == {keys[2]}
    out = ann.order([Stored((keys[0],), CPU, ctx)])
    assert stores(out) == [(CPU, (keys[0],))]  # keys[2]'s parent is still nowhere
    out = ann.order([Stored((keys[1],), CPU, ctx)])
    assert stores(out) == [(CPU, (keys[1],)), (FILES, (keys[2],))]


def test_with_the_devices_own_events_an_orphan_goes_at_the_end_of_its_step() -> None:
    ctx, keys = request(3, device_events=True)
    ann = Announcer()
    out = ann.order([Stored((keys[2], keys[1]), CPU, ctx), Removed((keys[2],), FILES)])
    assert stores(out) == [(CPU, (keys[1], keys[2]))]
    assert ann.waiting(CPU) == frozenset()


def test_a_child_of_a_parent_the_device_evicted_waits_until_someone_holds_it() -> None:
    """A promotion or cascade that finishes after the device evicted the parent: the child
    goes out only once the device holds the parent again, or a tier announced it; a child
    its tier drops meanwhile never goes."""
    ctx, keys = request(4, device_events=True)
    on_device: set[OffloadKey] = set()
    ann = Announcer()
    ann.see_device(on_device.__contains__)
    assert stores(ann.order([Stored((keys[1],), CPU, ctx)])) == []
    assert ann.waiting(CPU) == {keys[1]}
    assert stores(ann.order([])) == []  # step after step, while the device lacks keys[0]
    on_device.add(keys[0])  # the device computed the parent again (and announced it)
    assert stores(ann.order([])) == [(CPU, (keys[1],))]
    on_device.clear()
    assert stores(ann.order([Stored((keys[3],), FILES, ctx)])) == []  # keys[2]: nowhere
    assert ann.waiting(FILES) == {keys[3]}
    assert stores(ann.order([Removed((keys[3],), FILES)])) == []  # dropped while it waited
    assert ann.waiting(FILES) == frozenset()
    # keys[1] is announced on CPU: its child goes at once, whatever the device holds
    assert stores(ann.order([Stored((keys[2],), FILES, ctx)])) == [(FILES, (keys[2],))]
    assert ann.waiting(FILES) == frozenset()


def test_tiers_announced_under_one_identity_are_one_residency() -> None:
    ctx, keys = request(2)
    ann = Announcer({FILES: ANON, MORE: ANON})
    out = ann.order([Stored(tuple(keys), FILES, ctx), Stored((keys[0],), MORE, ctx)])
    assert stores(out) == [(ANON, tuple(keys))]
    assert ann.order([Removed((keys[0],), FILES)]) == []  # MORE still holds it
    assert ann.order([Removed((keys[0],), MORE)]) == [Removed((keys[0],), ANON)]
    assert ann.order([Removed((keys[0],), MORE)]) == []  # never twice


def test_a_cleared_tier_takes_back_what_it_announced_and_drops_what_waited() -> None:
    ctx, keys = request(3)
    ann = Announcer()
    ann.order([Stored((keys[0],), CPU, ctx), Stored((keys[2],), FILES, ctx)])
    assert ann.order([Cleared(CPU)]) == [Removed((keys[0],), CPU)]
    ann.order([Cleared(FILES)])
    assert ann.waiting(FILES) == frozenset()
    assert ann.order([Stored((keys[1],), CPU, ctx)]) == []  # its parent is gone
    assert not ann.is_announced(keys[2])


def test_stores_described_by_records_are_ordered_by_their_parents() -> None:
    ctx, keys = request(4)
    records = {k: record_of(ctx, k) for k in keys}
    scrambled = (keys[3], keys[1], keys[2], keys[0])
    adopted = Stored(scrambled, FILES, None, tuple(records[k] for k in scrambled))
    out = Announcer().order([adopted])
    assert stores(out) == [(FILES, tuple(keys))]
    (chain,) = EventTranslator(GEO).translate(out)
    assert isinstance(chain, BlockStored)
    assert not chain.is_placeholder
    assert chain.token_ids == list(range(100, 132))


def test_placeholders_wait_for_nothing() -> None:
    _, keys = request(2)
    out = Announcer().order([Stored((keys[1],), FILES, None)])
    assert stores(out) == [(FILES, (keys[1],))]


def test_a_tier_found_announced_alike_later_shares_the_residency_exactly() -> None:
    """MORE is announced as FILES; FILES itself (not in the mapping) shows up after MORE
    announced alone: from then on the two are counted, MORE's earlier keys included."""
    ctx, keys = request(2)
    ann = Announcer({MORE: FILES})
    assert stores(ann.order([Stored(tuple(keys), MORE, ctx)])) == [(FILES, tuple(keys))]
    assert ann.order([Stored((keys[0],), FILES, ctx)]) == []  # already announced there
    assert ann.order([Removed((keys[0],), MORE)]) == []  # FILES still holds it
    assert ann.order([Removed((keys[0],), FILES)]) == [Removed((keys[0],), FILES)]
    assert ann.order([Removed((keys[1],), MORE)]) == [Removed((keys[1],), FILES)]


def test_a_key_listed_twice_or_never_announced_is_named_once_or_not_at_all() -> None:
    """Placeholders (no provenance) of a tier announced alone: the common case, taken on a
    path of its own. A key listed twice is announced once; a removal names each announced
    key once and never one that was not announced."""
    a, b, c, d = (bytes([i]) * 36 for i in range(4))
    ann = Announcer()
    out = ann.order([Stored((a, b, a), CPU), Stored((b, c), CPU)])
    assert stores(out) == [(CPU, (a, b)), (CPU, (c,))]
    out = ann.order([Removed((a, d, a), CPU), Removed((d,), CPU), Removed((b, c), CPU)])
    assert [(e.tier, e.keys) for e in out] == [(CPU, (a,)), (CPU, (b, c))]
    assert not ann.is_announced(a)
    assert not ann.is_announced(c)
    out = ann.order([Stored((a,), CPU), Stored((a,), ANON)])  # again, and elsewhere too
    assert stores(out) == [(CPU, (a,)), (ANON, (a,))]
    assert ann.order([Cleared(CPU)]) == [Removed((a,), CPU)]
    assert ann.is_announced(a)  # still in the other residency
