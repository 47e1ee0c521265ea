"""The router profiles: what each router credits, drops and miscredits, and the one-line
findings that say so (the same lines ``kvhex events --router`` prints and kvhex logs at
start-up)."""

from __future__ import annotations

import pytest

from kvhex.domain.routers import (
    DYNAMO,
    PROFILES,
    VLLM_ROUTER,
    Effect,
    RouterProfile,
    Rule,
    check_block_size,
    check_group,
    check_hash_form,
    check_locality,
    check_medium,
    check_ownership,
    check_parent_first,
    check_residency,
    check_store,
    check_topic,
)

KEYS = {"medium_key": "M", "locality_key": "L", "ownership_key": "O"}


def test_the_table_names_both_routers() -> None:
    assert sorted(PROFILES) == ["dynamo", "vllm-router"]
    assert PROFILES["dynamo"] is DYNAMO
    assert VLLM_ROUTER.label == "vllm-router 0.1.17"
    assert DYNAMO.label == "dynamo 1.6.1"


@pytest.mark.parametrize(
    ("profile", "medium", "effect", "weight"),
    [
        (VLLM_ROUTER, "GPU", Effect.CREDITS, "1.0 (the device)"),
        (VLLM_ROUTER, None, Effect.CREDITS, "1.0 (the device)"),
        (VLLM_ROUTER, "CPU", Effect.CREDITS, "0.8 (--kv-penalty-host)"),
        (VLLM_ROUTER, "cpu", Effect.CREDITS, "0.8 (--kv-penalty-host)"),  # any case
        (VLLM_ROUTER, "STORAGE", Effect.CREDITS, "0.3 (--kv-penalty-disk)"),
        (VLLM_ROUTER, "DISK", Effect.CREDITS, "0.3 (--kv-penalty-disk)"),
        (VLLM_ROUTER, "CPU_PINNED", Effect.MISCREDITS, None),
        (VLLM_ROUTER, "EXTERNAL", Effect.MISCREDITS, None),
        (VLLM_ROUTER, "SHARED_STORAGE", Effect.MISCREDITS, None),
        (DYNAMO, "GPU", Effect.CREDITS, "1.0 (the device)"),
        (DYNAMO, "CPU", Effect.CREDITS, "0.75 (DYN_ROUTER_HOST_CACHE_HIT_WEIGHT)"),
        (DYNAMO, "CPU_PINNED", Effect.CREDITS, "0.75 (DYN_ROUTER_HOST_CACHE_HIT_WEIGHT)"),
        (DYNAMO, "STORAGE", Effect.CREDITS, "0.25 (DYN_ROUTER_DISK_CACHE_HIT_WEIGHT)"),
        (DYNAMO, "DISK", Effect.CREDITS, "0.25 (DYN_ROUTER_DISK_CACHE_HIT_WEIGHT)"),
        (DYNAMO, "EXTERNAL", Effect.CREDITS, "0.25 (DYN_ROUTER_DISK_CACHE_HIT_WEIGHT)"),
        (DYNAMO, "SHARED_STORAGE", Effect.DROPS, None),
        (DYNAMO, "OBJECT_STORE", Effect.DROPS, None),
        (DYNAMO, "cpu", Effect.DROPS, None),
    ],
)
def test_each_medium_is_credited_at_its_weight_or_dropped_or_miscredited(
    profile: RouterProfile, medium: str | None, effect: Effect, weight: str | None
) -> None:
    finding = check_medium(profile, medium, key="$.tiers[0].options.medium")
    assert finding.effect is effect
    assert finding.rule is Rule.MEDIUM
    assert finding.mismatch is (effect is not Effect.CREDITS)
    if weight is not None:
        assert finding.line().endswith(f"at {weight}")
        assert finding.key is None
    else:
        assert finding.key == "$.tiers[0].options.medium"


def test_the_medium_findings_read_as_one_line_each() -> None:
    dropped = check_medium(DYNAMO, "SHARED_STORAGE", key="$.tiers[1].options.medium")
    assert dropped.line() == (
        "dynamo 1.6.1 drops events with medium 'SHARED_STORAGE': it reads only the media "
        "CPU, CPU_PINNED, DISK, EXTERNAL, GPU, STORAGE (or none); fix: set "
        "$.tiers[1].options.medium to 'STORAGE'"
    )
    pinned = check_medium(VLLM_ROUTER, "CPU_PINNED", key="K")
    assert pinned.line() == (
        "vllm-router 0.1.17 miscredits events with medium 'CPU_PINNED': it credits them as if "
        "on the device (1.0); it weighs only CPU, DISK, GPU, STORAGE; fix: set K to 'CPU'"
    )
    assert check_medium(DYNAMO, "cpu", key="K").fix == "set K to 'CPU'"  # Mooncake's name
    credited = check_medium(DYNAMO, "CPU", key="K")
    assert credited.line() == (
        "dynamo 1.6.1 credits events with medium 'CPU' at 0.75 (DYN_ROUTER_HOST_CACHE_HIT_WEIGHT)"
    )


@pytest.mark.parametrize(
    ("locality", "dropped"), [(None, False), ("LOCAL", False), ("REMOTE", True), ("SHARED", True)]
)
def test_dynamo_reads_only_local_or_no_locality_and_vllm_router_any(
    locality: str | None, dropped: bool
) -> None:
    assert check_locality(VLLM_ROUTER, locality, key="L") is None
    finding = check_locality(DYNAMO, locality, key="$.tiers[0].options.locality")
    assert (finding is not None) is dropped
    if finding is not None:
        assert finding.line() == (
            f"dynamo 1.6.1 drops events with locality {locality!r}: it reads only the "
            "locality LOCAL or none; fix: set $.tiers[0].options.locality to 'LOCAL' (only "
            "if every instance the router sends to can load from the tier)"
        )


def test_an_ownership_is_dropped_by_dynamo_and_credited_as_external_by_vllm_router() -> None:
    assert check_ownership(DYNAMO, None, key="O") is None
    assert check_ownership(VLLM_ROUTER, None, key="O") is None
    finding = check_ownership(DYNAMO, "files", key="$.tiers[0].announce_ownership")
    assert finding is not None
    assert finding.line() == (
        "dynamo 1.6.1 drops events with ownership 'files': it drops every event that names an "
        "ownership; fix: set $.tiers[0].announce_ownership to false"
    )
    external = check_ownership(VLLM_ROUTER, "files", key="$.tiers[0].announce_ownership")
    assert external is not None
    assert external.effect is Effect.MISCREDITS
    assert external.line() == (
        "vllm-router 0.1.17 miscredits events with ownership 'files': it credits every event "
        "that names an ownership at 0.6 (--kv-penalty-external), whatever its medium; fix: set "
        "$.tiers[0].announce_ownership to false"
    )


@pytest.mark.parametrize("profile", [VLLM_ROUTER, DYNAMO])
def test_both_credit_kv_group_0_only(profile: RouterProfile) -> None:
    assert check_group(profile, None) is None
    assert check_group(profile, 0) is None
    finding = check_group(profile, 1)
    assert finding is not None
    assert finding.line().startswith(
        f"{profile.label} drops events with group_idx 1: it credits KV group 0 only; fix: none"
    )


def test_a_residency_gets_each_reason_it_is_dropped_or_its_one_credit() -> None:
    found = check_residency(DYNAMO, "SHARED_STORAGE", "REMOTE", "files", **KEYS)
    assert [(f.rule, f.key) for f in found] == [
        (Rule.MEDIUM, "M"),
        (Rule.LOCALITY, "L"),
        (Rule.OWNERSHIP, "O"),
    ]
    (credit,) = check_residency(DYNAMO, "STORAGE", "LOCAL", None, **KEYS)
    assert credit.effect is Effect.CREDITS
    (credit,) = check_residency(VLLM_ROUTER, "STORAGE", "REMOTE", None, **KEYS)
    assert credit.effect is Effect.CREDITS
    (external,) = check_residency(VLLM_ROUTER, "STORAGE", "REMOTE", "files", **KEYS)
    assert (external.rule, external.effect) == (Rule.OWNERSHIP, Effect.MISCREDITS)


def test_bytes_hashes_drop_whole_batches_for_dynamo_only() -> None:
    assert check_hash_form(VLLM_ROUTER, key="K") is None
    finding = check_hash_form(DYNAMO, key="$.events.int_block_hashes")
    assert finding is not None
    assert finding.line() == (
        "dynamo 1.6.1 drops whole batches with block hashes as bytes: it decodes int hashes "
        "only (the low 64 bits, vLLM's default); fix: set $.events.int_block_hashes to true"
    )
    named = check_hash_form(DYNAMO, key="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", value="1")
    assert named is not None
    assert named.fix == "set VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES to 1"


def test_a_topic_drops_every_event_for_vllm_router_only() -> None:
    assert check_topic(VLLM_ROUTER, "", key="T") is None
    assert check_topic(DYNAMO, "kv", key="T") is None
    finding = check_topic(VLLM_ROUTER, "kv", key="$.sinks[0].options.topic")
    assert finding is not None
    assert finding.line() == (
        "vllm-router 0.1.17 drops every event with ZMQ topic 'kv': it reads only the empty "
        'topic (0.1.17 has no topic setting); fix: set $.sinks[0].options.topic to ""'
    )


@pytest.mark.parametrize("profile", [VLLM_ROUTER, DYNAMO])
def test_another_block_size_is_dropped_by_both(profile: RouterProfile) -> None:
    assert check_block_size(profile, 16, 16, key="B", told="t") is None
    assert check_block_size(profile, 0, 16, key="B", told="t") is None  # a placeholder's
    finding = check_block_size(profile, 32, 16, key="$.events.router_block_size", told="t")
    assert finding is not None
    assert finding.effect is Effect.DROPS
    assert finding.line() == (
        f"{profile.label} drops stores with block_size 32: it reads block_size 16 only (t); "
        f"fix: configure the router for block size 32 ({profile.block_size_setting}) and set "
        "$.events.router_block_size to 32, or serve with block size 16"
    )


@pytest.mark.parametrize("profile", [VLLM_ROUTER, DYNAMO])
def test_placeholders_and_partial_blocks_are_dropped_by_both(profile: RouterProfile) -> None:
    assert check_store(profile, hashes=2, tokens=32, block_size=16) is None
    assert check_store(profile, hashes=2, tokens=64, block_size=16) is None  # more: ignored
    placeholder = check_store(profile, hashes=1, tokens=0, block_size=0)
    assert placeholder is not None
    assert placeholder.rule is Rule.PLACEHOLDER
    assert placeholder.key is None  # no kvhex key fixes it
    assert placeholder.line().startswith(
        f"{profile.label} drops stores with token_ids [] (placeholders, block_size 0): it "
        "hashes each block's token_ids itself; fix: none in kvhex"
    )
    partial = check_store(profile, hashes=2, tokens=24, block_size=16)
    assert partial is not None
    assert partial.rule is Rule.PARTIAL_BLOCK
    assert partial.line().startswith(
        f"{profile.label} drops the last blocks of stores with token_ids short of block_size "
        "per hash: it keeps only the blocks whose block_size token_ids are all there"
    )


def test_a_block_before_its_parent_is_dropped_by_dynamos_device_tree_and_by_vllm_router() -> None:
    assert check_parent_first(DYNAMO, "CPU") is None  # its host tree attaches it later
    assert check_parent_first(DYNAMO, "STORAGE") is None
    finding = check_parent_first(DYNAMO, "GPU")
    assert finding is not None
    assert finding.line().startswith(
        "dynamo 1.6.1 drops GPU stores with parent_block_hash not held yet: its device tree "
        "keeps a block only under a parent it holds there"
    )
    assert check_parent_first(DYNAMO, None) is not None
    assert not DYNAMO.parent_anywhere
    for medium in ("GPU", "CPU", "STORAGE", None):
        anywhere = check_parent_first(VLLM_ROUTER, medium)
        assert anywhere is not None
        assert "it keeps a block only under a parent it holds, in any medium" in anywhere.line()
    assert VLLM_ROUTER.parent_anywhere
