"""Event translation with provenance (reference §F.6, scenarios 57-72 and 79-80, adapted)."""

from __future__ import annotations

import gc
import hashlib
import weakref

from kvhex.domain import Cleared, Locality, Medium, Removed, ReqContext, Stored, TierIdentity
from kvhex.domain.events import BlockRemoved, BlockStored
from kvhex.domain.geometry import CacheKind, KvGeometry, KvGroup
from kvhex.domain.locator import ChunkRecord
from kvhex.domain.translate import EventTranslator
from tests.domain.requests import (
    MmFeature,
    boundary_key,
    chunk_key,
    extend_hashes,
    make_request,
    recompute,
)

G0 = KvGroup(0, tokens_per_block=4)
GEO = KvGeometry((G0,), tokens_per_hash=4)
CPU = TierIdentity(Medium.CPU)
DISK = TierIdentity(Medium.STORAGE, Locality.LOCAL, "files")
REMOTE = TierIdentity(Medium.STORAGE, Locality.REMOTE, "s3")


def tokens(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


def stored(events: list[object]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events: list[object]) -> list[BlockRemoved]:
    return [e for e in events if isinstance(e, BlockRemoved)]


def test_locality_rides_full_stores_placeholders_and_removals() -> None:
    ctx = make_request("r", tokens(8), GEO)
    k0, k1 = chunk_key(ctx, 0, G0), chunk_key(ctx, 1, G0)
    tr = EventTranslator(GEO)
    out = tr.translate(
        [Stored((k0,), REMOTE, ctx), Stored((k1,), REMOTE, None), Removed((k0, k1), REMOTE)]
    )
    assert [e.locality for e in out] == ["REMOTE", "REMOTE", "REMOTE"]  # type: ignore[union-attr]
    assert [e.ownership for e in out] == ["s3", "s3", "s3"]  # type: ignore[union-attr]


def test_full_payloads_chain_parents_across_batches() -> None:
    ctx = make_request("r", tokens(12), GEO)
    prov = ctx.provenance
    assert prov is not None
    tr = EventTranslator(GEO)
    events = []
    for c in range(3):
        events += tr.translate([Stored((chunk_key(ctx, c, G0),), CPU, ctx)])
    for c, ev in enumerate(stored(events)):
        assert ev.block_hashes == [prov.block_hashes[c]]
        assert ev.parent_block_hash == (prov.block_hashes[c - 1] if c else None)
        assert ev.token_ids == tokens(12)[4 * c : 4 * c + 4]
        assert (ev.block_size, ev.lora_id, ev.lora_name, ev.extra_keys) == (4, None, None, None)
        assert (ev.group_idx, ev.kv_cache_spec_kind, ev.medium) == (0, "full_attention", "CPU")
    assert tr.detached_keys == 3


def test_contiguous_multi_block_chunks_are_one_chain_and_one_removal_has_every_hash() -> None:
    group = KvGroup(0, tokens_per_block=4, blocks_per_chunk=3)
    geo = KvGeometry((group,), tokens_per_hash=4)
    ctx = make_request("r", tokens(24), geo)
    prov = ctx.provenance
    assert prov is not None
    k0, k1 = chunk_key(ctx, 0, group), chunk_key(ctx, 1, group)
    tr = EventTranslator(geo)
    (chain,) = stored(tr.translate([Stored((k0, k1), CPU, ctx)]))
    assert chain.block_hashes == prov.block_hashes[0:6]
    assert chain.token_ids == tokens(24)
    assert (chain.parent_block_hash, chain.block_size) == (None, 4)
    (gone,) = removed(tr.translate([Removed((k0, k1), CPU)]))
    assert gone.block_hashes == prov.block_hashes[0:6]
    assert (gone.medium, gone.group_idx) == ("CPU", 0)
    assert tr.detached_keys == 0


def test_order_independence_and_unknown_keys_are_placeholders() -> None:
    group = KvGroup(0, tokens_per_block=4, blocks_per_chunk=3)
    geo = KvGeometry((group,), tokens_per_hash=4)
    ctx = make_request("r", tokens(24), geo)
    stranger = make_request("x", tokens(12, base=900), geo)
    unknown = chunk_key(stranger, 0, group)
    keys = (chunk_key(ctx, 1, group), unknown, chunk_key(ctx, 0, group))
    out = stored(EventTranslator(geo).translate([Stored(keys, CPU, ctx)]))
    assert [len(e.block_hashes) for e in out] == [3, 1, 3]
    assert out[1].is_placeholder
    assert out[1].token_ids == []
    assert out[1].block_hashes == [unknown[:-4]]


def test_work_without_provenance_gives_placeholders_and_plain_removals() -> None:
    ctx = make_request("r", tokens(12), GEO)
    keys = tuple(chunk_key(ctx, c, G0) for c in range(3))
    tr = EventTranslator(GEO)
    out = tr.translate([Stored(keys, CPU, ReqContext("external")), Removed(keys, CPU)])
    assert all(e.is_placeholder for e in stored(out))
    (gone,) = removed(out)
    assert gone.block_hashes == [k[:-4] for k in keys]


def test_sliding_window_and_mamba_groups_stay_placeholders_with_their_kind() -> None:
    swa = KvGroup(1, tokens_per_block=4, kind=CacheKind.SLIDING_WINDOW, sliding_window=128)
    mamba = KvGroup(2, tokens_per_block=4, kind=CacheKind.MAMBA)
    geo = KvGeometry((G0, swa, mamba), tokens_per_hash=4)
    ctx = make_request("r", tokens(8), geo)
    out = stored(
        EventTranslator(geo).translate(
            [
                Stored(
                    (chunk_key(ctx, 0, swa), chunk_key(ctx, 0, mamba), chunk_key(ctx, 0, G0)),
                    CPU,
                    ctx,
                )
            ]
        )
    )
    assert [e.is_placeholder for e in out] == [True, True, False]
    assert [(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in out[:2]] == [
        ("sliding_window", 128),
        ("mamba", None),
    ]


def test_hashes_resolve_to_the_groups_block_size() -> None:
    for blocks, expected in ((1, [63]), (2, [63, 127])):
        group = KvGroup(0, tokens_per_block=256, blocks_per_chunk=blocks)
        geo = KvGeometry((group,), tokens_per_hash=4)
        ctx = make_request("r", tokens(512), geo)
        prov = ctx.provenance
        assert prov is not None
        (ev,) = stored(
            EventTranslator(geo).translate([Stored((chunk_key(ctx, 0, group),), CPU, ctx)])
        )
        assert ev.block_hashes == [prov.block_hashes[i] for i in expected]
        assert ev.block_size == 256
        assert len(ev.token_ids) == 256 * blocks


def test_partial_tail_is_described_at_hash_block_size() -> None:
    group = KvGroup(0, tokens_per_block=16)
    geo = KvGeometry((group,), tokens_per_hash=4)
    ctx = make_request("r", tokens(30), geo)
    prov = ctx.provenance
    assert prov is not None
    (ev,) = stored(
        EventTranslator(geo).translate([Stored((boundary_key(ctx, 28, group),), CPU, ctx)])
    )
    assert ev.block_hashes == prov.block_hashes[4:7]
    assert ev.parent_block_hash == prov.block_hashes[3]
    assert ev.token_ids == tokens(30)[16:28]
    assert ev.block_size == 4
    swa = KvGroup(0, tokens_per_block=16, kind=CacheKind.SLIDING_WINDOW, sliding_window=64)
    geo2 = KvGeometry((swa,), tokens_per_hash=4)
    ctx2 = make_request("s", tokens(30), geo2)
    (ph,) = stored(
        EventTranslator(geo2).translate([Stored((boundary_key(ctx2, 28, swa),), CPU, ctx2)])
    )
    assert ph.is_placeholder


def test_a_key_restored_after_eviction_uses_the_new_requests_tokens() -> None:
    tr = EventTranslator(GEO)
    first = make_request("a", tokens(4), GEO)
    key = chunk_key(first, 0, G0)
    tr.translate([Stored((key,), CPU, first), Removed((key,), CPU)])
    assert tr.detached_keys == 0
    second = make_request("b", tokens(4), GEO, session_id="s2")
    (ev,) = stored(tr.translate([Stored((key,), CPU, second)]))
    assert ev.token_ids == tokens(4)
    assert ev.session_id == "s2"


def test_removals_of_two_groups_give_one_event_per_group() -> None:
    g1 = KvGroup(1, tokens_per_block=4)
    geo = KvGeometry((G0, g1), tokens_per_hash=4)
    ctx = make_request("r", tokens(8), geo)
    keys = (chunk_key(ctx, 0, G0), chunk_key(ctx, 0, g1), chunk_key(ctx, 1, G0))
    tr = EventTranslator(geo)
    tr.translate([Stored(keys, CPU, ctx)])
    out = removed(tr.translate([Removed(keys, CPU)]))
    assert [(e.group_idx, len(e.block_hashes)) for e in out] == [(0, 2), (1, 1)]


def test_placeholders_keep_the_static_group_classification() -> None:
    swa = KvGroup(3, tokens_per_block=4, kind=CacheKind.SLIDING_WINDOW, sliding_window=32)
    geo = KvGeometry((swa,), tokens_per_hash=4)
    key = chunk_key(make_request("r", tokens(4), geo), 0, swa)
    (ev,) = stored(EventTranslator(geo).translate([Stored((key,), DISK, None)]))
    assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, ev.ownership) == (
        "sliding_window",
        32,
        "files",
    )


def test_residencies_are_independent() -> None:
    ctx = make_request("r", tokens(8), GEO)
    prov = ctx.provenance
    assert prov is not None
    key = chunk_key(ctx, 1, G0)
    tr = EventTranslator(GEO)
    tr.translate([Stored((key,), CPU, ctx), Stored((key,), DISK, ctx)])
    (gone,) = removed(tr.translate([Removed((key,), DISK)]))
    assert gone.block_hashes == [prov.block_hashes[1]]
    assert tr.detached_keys == 1  # still resident on CPU
    (again,) = removed(tr.translate([Removed((key,), CPU)]))
    assert again.block_hashes == [prov.block_hashes[1]]
    assert tr.detached_keys == 0


def test_same_batch_removal_then_store_keeps_the_hashes() -> None:
    ctx = make_request("r", tokens(12), GEO)
    key = chunk_key(ctx, 2, G0)
    tr = EventTranslator(GEO)
    tr.translate([Stored((key,), CPU, ctx)])
    later = ReqContext("no-provenance")  # the re-store itself cannot describe the chunk
    out = tr.translate([Removed((key,), CPU), Stored((key,), CPU, later)])
    assert out[1].is_placeholder  # type: ignore[union-attr]
    (gone,) = removed(tr.translate([Removed((key,), CPU)]))
    assert len(gone.block_hashes) == 1
    assert tr.detached_keys == 0


def test_cleared_tier_becomes_removals_of_exactly_its_keys_with_its_medium() -> None:
    ctx = make_request("r", tokens(8), GEO)
    k0, k1 = chunk_key(ctx, 0, G0), chunk_key(ctx, 1, G0)
    tr = EventTranslator(GEO)
    tr.translate([Stored((k0, k1), CPU, ctx), Stored((k1,), DISK, ctx)])
    out = tr.translate([Cleared(CPU)])
    assert [(type(e).__name__, e.medium, len(e.block_hashes)) for e in out] == [  # type: ignore[union-attr]
        ("BlockRemoved", "CPU", 2)
    ]
    assert tr.resident_keys(DISK) == [k1]
    assert tr.translate([Cleared(CPU)]) == []


def test_extra_keys_are_the_gpus_lora_multimodal_salt_and_embeddings() -> None:
    def digest(start: int, end: int) -> bytes:
        return hashlib.sha256(f"emb{start}:{end}".encode()).digest()

    ctx = make_request(
        "r",
        tokens(12),
        GEO,
        lora_id=7,
        lora_name="adapter",
        cache_salt="tenant-a",
        mm_features=(MmFeature("img-1", offset=2, length=5),),
        prompt_embeds_digest=digest,
    )
    prov = ctx.provenance
    assert prov is not None
    keys = tuple(chunk_key(ctx, c, G0) for c in range(3))
    (chain,) = stored(EventTranslator(GEO).translate([Stored(keys, CPU, ctx)]))
    assert chain.extra_keys == [
        ("adapter", ("img-1", 2), "tenant-a", digest(0, 4)),
        ("adapter", ("img-1", -2), digest(4, 8)),
        ("adapter", digest(8, 12)),
    ]
    assert (chain.lora_id, chain.lora_name) == (7, "adapter")
    n = len(chain.block_hashes)
    assert recompute(None, chain.token_ids, chain.block_size, chain.extra_keys, n) == (
        chain.block_hashes
    )


def test_int_hashes_publish_the_low_64_bits_big_endian() -> None:
    ctx = make_request("r", tokens(4), GEO)
    prov = ctx.provenance
    assert prov is not None
    key = chunk_key(ctx, 0, G0)
    (ev,) = EventTranslator(GEO, int_hashes=True).translate([Stored((key,), CPU, ctx)])
    assert ev.block_hashes == [int.from_bytes(prov.block_hashes[0], "big") & (2**64 - 1)]  # type: ignore[union-attr]


def test_int_hashes_of_a_long_chain_and_its_removal_are_each_hashes_low_64_bits() -> None:
    """A chain's hashes are converted in one pass over their bytes: the same numbers."""
    ctx = make_request("r", tokens(4 * 40), GEO)
    prov = ctx.provenance
    assert prov is not None
    keys = tuple(chunk_key(ctx, c, G0) for c in range(40))
    tr = EventTranslator(GEO, int_hashes=True)
    (ev,) = tr.translate([Stored(keys, CPU, ctx)])
    low = [int.from_bytes(h, "big") & (2**64 - 1) for h in prov.block_hashes]
    assert ev.block_hashes == low  # type: ignore[union-attr]
    assert ev.parent_block_hash is None  # type: ignore[union-attr]
    (gone,) = tr.translate([Removed(keys, CPU)])
    assert gone.block_hashes == low  # type: ignore[union-attr]


def test_records_of_mixed_hash_lengths_publish_each_hashes_own_low_64_bits() -> None:
    hashes = [bytes([n]) * (8 if n % 3 else 16) + bytes([n, 255]) * 4 for n in range(1, 12)]
    record = ChunkRecord(
        hashes, None, list(range(44)), 4, None, 0, "full_attention", None, None, None
    )
    (ev,) = EventTranslator(GEO, int_hashes=True).translate(
        [Stored((chunk_key(make_request("r", tokens(4), GEO), 0, G0),), DISK, None, (record,))]
    )
    assert ev.block_hashes == [int.from_bytes(h, "big") & (2**64 - 1) for h in hashes]  # type: ignore[union-attr]


def test_token_mutating_requests_and_stale_positions_are_placeholders() -> None:
    ctx = make_request("r", tokens(8), GEO, mutates_tokens=True)
    (ev,) = stored(EventTranslator(GEO).translate([Stored((chunk_key(ctx, 0, G0),), CPU, ctx)]))
    assert ev.is_placeholder
    ok = make_request("s", tokens(8), GEO)
    key = chunk_key(ok, 1, G0)
    ok.record_position(key, 4)  # a wrong record: the hash at that position differs
    (ev,) = stored(EventTranslator(GEO).translate([Stored((key,), CPU, ok)]))
    assert ev.is_placeholder


def test_live_references_see_tokens_appended_after_the_store() -> None:
    ctx = make_request("r", tokens(4), GEO)
    prov = ctx.provenance
    assert prov is not None
    prov.token_ids.extend(tokens(4, base=500))  # type: ignore[attr-defined]
    extend_hashes(prov)
    key = chunk_key(ctx, 1, G0)
    (ev,) = stored(EventTranslator(GEO).translate([Stored((key,), CPU, ctx)]))
    assert ev.token_ids == tokens(4, base=500)


def test_translation_releases_the_context() -> None:
    ctx = make_request("r", tokens(4), GEO)
    key = chunk_key(ctx, 0, G0)
    ref = weakref.ref(ctx)
    tr = EventTranslator(GEO)
    raw = [Stored((key,), CPU, ctx)]
    del ctx
    tr.translate(raw)
    del raw
    gc.collect()
    assert ref() is None
