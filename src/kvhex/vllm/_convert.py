"""Translations between vLLM's offloading types and kvhex's, in one place (the version
differences they meet are :mod:`kvhex.vllm._compat`'s).

* Request contexts: vLLM's ``ReqContext`` (a dataclass, not hashable, per request) carries
  kvhex's ``ReqContext`` in its per-request state (``set_state``), created on first sight.
* Tier filters, lookup results and offload policies map name for name.
* Raw tier events: kvhex's ``Stored`` / ``Removed`` become vLLM ``OffloadingEvent``s (for
  vLLM's own events tracker); kvhex's public events become vLLM's wire structs (for vLLM's
  publisher), field for field.
* Requests: a vLLM ``Request`` becomes kvhex ``Provenance`` holding live references to its
  token ids and block hashes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import structlog
from vllm.distributed import kv_events as vev
from vllm.v1.kv_offload import base as vbase

from kvhex.domain import events as kev
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.primary import PRIMARY_IDENTITY
from kvhex.domain.provenance import MmFeature, Provenance
from kvhex.domain.request import ReqContext
from kvhex.domain.tiers import (
    Locality,
    LookupResult,
    Medium,
    OffloadPolicy,
    TierFilter,
    TierIdentity,
    TierMatcher,
)
from kvhex.vllm._compat import block_stored

log = structlog.get_logger(__name__)
_T = TypeVar("_T")

LOOKUP = {
    LookupResult.HIT: vbase.LookupResult.HIT,
    LookupResult.MISS: vbase.LookupResult.MISS,
    LookupResult.HIT_PENDING: vbase.LookupResult.HIT_PENDING,
    LookupResult.RETRY: vbase.LookupResult.RETRY,
}
"""kvhex lookup answer -> vLLM's."""

_MEDIA = {"CPU": vbase.Medium.CPU, "STORAGE": vbase.Medium.STORAGE}
_unmapped_media: set[str] = set()
_unmapped_localities: set[TierIdentity] = set()


def policy_of(policy: OffloadPolicy) -> vbase.RequestOffloadingContext:
    """kvhex offload policy -> vLLM's per-request offloading context."""
    if policy is _KVHEX_CHUNK_LEVEL:  # once per request: no lookup by value
        return vbase.RequestOffloadingContext(_CHUNK_LEVEL)
    return vbase.RequestOffloadingContext(vbase.OffloadPolicy(policy.value))


# (an enum member read off its class is a Python-level lookup, 70 ns more than a global's:
# per request, these are read as globals)
_KVHEX_CHUNK_LEVEL = OffloadPolicy.CHUNK_LEVEL
_CHUNK_LEVEL = vbase.OffloadPolicy.CHUNK_LEVEL


def tier_filter_of(vfilter: vbase.TierFilter) -> TierFilter:
    """vLLM's per-request tier filter -> kvhex's (``ALL`` stays the identical sentinel)."""
    if vfilter is vbase.TierFilter.ALL:
        return TierFilter.ALL
    return TierFilter(
        tuple(
            TierMatcher(
                Medium(m.medium.value) if m.medium is not None else None,
                Locality(m.locality.value) if m.locality is not None else None,
            )
            for m in vfilter.matchers
        )
    )


def context_of(vctx: vbase.ReqContext) -> tuple[ReqContext, bool]:
    """kvhex's context for vLLM's ``vctx`` and whether it was created by this call.

    The kvhex context is kept in ``vctx``'s per-request state, so it lives exactly as long as
    vLLM keeps the request, and every job the request starts carries this one object.
    """
    ctx = vctx.get_state(ReqContext)
    if ctx is not None:
        return ctx, False
    # (positional: once per request, and keywords cost a third of building it)
    ctx = ReqContext(vctx.req_id, vctx.kv_transfer_params, tier_filter_of(vctx.load_tier_filter))
    vctx.set_state(ctx)
    return ctx, True


def provenance_of(request: Any, geometry: KvGeometry) -> Provenance:
    """The provenance of a live vLLM ``Request``: references (not copies) to its token ids
    and block hashes, its LoRA, multimodal features, cache salt and prompt-embedding digests,
    exactly as vLLM's block hasher used them; its blocks are on the GPU, which announces
    them itself."""
    lora = request.lora_request
    mm_features = request.mm_features
    features = (
        tuple(
            sorted(
                (
                    MmFeature(
                        str(f.identifier), int(f.mm_position.offset), int(f.mm_position.length)
                    )
                    for f in mm_features
                    if f.identifier is not None
                ),
                key=lambda f: f.offset,
            )
        )
        if mm_features
        else ()
    )
    digest = None
    if getattr(request, "prompt_embeds", None) is not None:
        from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

        def digest(start: int, end: int) -> bytes:
            # vLLM's own per-block digest (and its per-request cache of it)
            return bytes(_gen_prompt_embeds_extra_hash_keys(request, start, end)[0][1])

    return Provenance(
        geometry=geometry,
        token_ids=request.all_token_ids,
        block_hashes=request.block_hashes,
        lora_id=lora.lora_int_id if lora is not None else None,
        lora_name=lora.lora_name if lora is not None else None,
        mm_features=features,
        cache_salt=request.cache_salt or None,
        prompt_embeds_digest=digest,
        session_id=getattr(request, "session_id", None),
        # kvhex's events go out only with vLLM's KV events on, and then vLLM's GPU prefix
        # cache announces every block of the request, before kvhex's events of each step
        device_events=True,
    )


def vllm_locality(tier: TierIdentity) -> vbase.Locality | None:
    """The locality vLLM's events can say for ``tier``: vLLM's member of the same name, or
    none where vLLM has no such member (``SHARED``: warned once per tier)."""
    locality = tier.locality
    if locality is None:
        return None
    member = vbase.Locality.__members__.get(locality.value)
    if member is None and tier not in _unmapped_localities:
        _unmapped_localities.add(tier)
        log.warning("locality_announced_as_none", locality=locality.value, tier=tier.ownership)
    return member


def vllm_medium(tier: TierIdentity) -> vbase.Medium:
    """The medium vLLM's events can say for ``tier``: ``CPU`` or ``STORAGE``, and
    ``STORAGE`` for any other (warned once per medium)."""
    medium = _MEDIA.get(tier.medium.name)
    if medium is None:
        if tier.medium.name not in _unmapped_media:
            _unmapped_media.add(tier.medium.name)
            log.warning("medium_announced_as_storage", medium=tier.medium.name, tier=tier.ownership)
        return vbase.Medium.STORAGE
    return medium


def offloading_events(raw: Iterable[kev.TierEvent]) -> list[vbase.OffloadingEvent]:
    """kvhex raw tier events -> vLLM ``OffloadingEvent``s for vLLM's events tracker.

    ``raw`` is what the engine announces (``OffloadEngine.take_raw_events``: public
    identities, parent first). A secondary tier's events say ``removal_expected=True``
    (kvhex tiers announce their removals, so the tracker keeps the payload for them); the
    host tier's are vLLM's CPU tier's. ``Cleared`` (a reset) has no vLLM counterpart: vLLM's
    managers announce nothing on reset and its scheduler drops the tracker's state instead.
    """
    out: list[vbase.OffloadingEvent] = []
    make = _offloading_event
    last: TierIdentity | None = None  # (a tier identity hashes in Python: once per run)
    for event in raw:
        if isinstance(event, kev.Cleared):
            continue
        tier = event.tier
        if tier is not last:
            last = tier
            if (described := _vtiers.get(tier)) is None:
                described = _vtiers[tier] = (
                    vllm_medium(tier),
                    vllm_locality(tier),
                    tier != PRIMARY_IDENTITY,
                )
            medium, locality, removal_expected = described
        out.append(
            make(
                list(event.keys),
                medium,
                type(event) is kev.Removed,
                locality,
                tier.ownership,
                removal_expected,
            )
        )
    return out


def by_position(cls: Callable[..., _T], fields: tuple[str, ...]) -> Callable[..., _T]:
    """A builder of the vLLM dataclass ``cls`` from the values of ``fields``, in that order:
    ``cls`` itself where it declares these fields first and in this order (per step, and
    keywords cost up to 80% more per object), else a call by keyword."""
    declared = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    if declared[: len(fields)] == fields:
        return cls

    def by_keyword(*values: Any) -> _T:
        return cls(**dict(zip(fields, values, strict=True)))

    return by_keyword


_EVENT_FIELDS = ("keys", "medium", "removed", "locality", "ownership", "removal_expected")
_offloading_event = by_position(vbase.OffloadingEvent, _EVENT_FIELDS)


_vtiers: dict[TierIdentity, tuple[vbase.Medium, vbase.Locality | None, bool]] = {}
"""Each announced tier as vLLM's events name it: medium, locality, removal expected."""


def vllm_events(events: Iterable[kev.PublicEvent]) -> list[vev.KVCacheEvent]:
    """kvhex public events -> vLLM's ``kv_events`` structs (same fields, same order)."""
    out: list[vev.KVCacheEvent] = []
    for event in events:
        if isinstance(event, kev.BlockStored):
            out.append(block_stored(event))
        elif isinstance(event, kev.BlockRemoved):
            out.append(vev.BlockRemoved(*event))
        else:
            out.append(vev.AllBlocksCleared())
    return out
