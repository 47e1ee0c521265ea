"""What KV-aware routers read of a KV-event stream, and what they silently drop or miscredit.

A router that reads vLLM's KV events (Dynamo's indexer, vllm-router's ``kv_aware`` policy,
llm-d) does not complain about what it cannot use: it drops an event, or credits it as
something else, and says so at most in a debug log or a counter. Each :class:`RouterProfile`
below is what one router release does, measured against the real router (``tests/dynamo.py``,
``tests/routers.py``, docs/events.md "What routers read"); the ``check_*`` functions turn one
fact of a stream or a configuration into a :class:`Finding`: one line naming the router, what
it does (drops, miscredits, credits at a weight), the field and its value, and what to change
in kvhex's configuration (the key, which the caller names: a key path at start-up, the flag
or option a stream's reader should look at) to fix it.

``kvhex events --router`` runs these over a stream and kvhex's start-up runs them over its
configuration (``kvhex.bootstrap.routers``): one table, one wording.

To add a router (llm-d's indexer, a later release of these), add a :class:`RouterProfile` to
:data:`PROFILES` with what it credits per medium, which localities and KV groups it reads,
what it does with events naming an ownership, the hash forms and topics it reads, how it is
told its block size and where it drops a block whose parent it does not hold; say where each
fact was measured. Nothing else changes: the checker and the start-up warnings read the table.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping

import attrs


class Effect(enum.Enum):
    """What a router does with an event."""

    CREDITS = "credits"
    """Uses it, at the weight its tier gets."""
    MISCREDITS = "miscredits"
    """Uses it at a weight that is not its tier's (a storage block counted as on the device)."""
    DROPS = "drops"
    """Ignores it, silently."""


class Rule(enum.Enum):
    """Which fact of a stream or configuration a finding is about."""

    MEDIUM = "medium"
    LOCALITY = "locality"
    OWNERSHIP = "ownership"
    HASH_FORM = "hash_form"
    TOPIC = "topic"
    BLOCK_SIZE = "block_size"
    PLACEHOLDER = "placeholder"
    PARTIAL_BLOCK = "partial_block"
    PARENT_FIRST = "parent_first"
    GROUP = "group"


@attrs.frozen
class Credit:
    """The weight a router gives a block on one medium (the device's is 1.0), and what sets
    it in the router (a flag, an environment variable)."""

    weight: float
    setting: str


DEVICE = Credit(1.0, "the device")


@attrs.frozen(kw_only=True)
class RouterProfile:
    """What one router release reads of a KV-event stream.

    Attributes:
        name: the name ``kvhex events --router`` and the ``router`` key take.
        version: the release these facts were measured on.
        media: each medium it credits (``None``: an event naming no medium), at what weight.
        folded_media: media of :attr:`media` it also reads in any case (``cpu``).
        other_media: what it does with any other medium name: ``DROPS``, or ``MISCREDITS``
            (credited as :attr:`other_media_credit`).
        other_media_credit: how a miscredited medium counts.
        localities: the localities it reads (``None`` in the set: none named); ``None``: it
            does not read the field.
        drops_ownership: it drops every event that names an ``ownership``.
        ownership_credit: how it credits an event naming an ``ownership``, whatever its
            medium (``None``: as its medium).
        groups: the KV groups (``group_idx``; ``None``: unnamed) it credits; ``None``: any.
        int_hashes_only: it decodes only int block hashes, and drops a whole batch holding
            a bytes hash.
        empty_topic_only: it drops every message whose ZMQ topic is not empty.
        block_size_setting: how the router is told the block size it reads.
        default_block_size: the block size it reads unless told (``None``: it must be told).
        hashes_tokens: it hashes each block's ``token_ids`` itself: a block without its
            ``block_size`` token ids (a placeholder's, a partial tail's) is dropped.
        strict_parent_media: media whose blocks it drops when it does not hold their parent
            yet, and never attaches when the parent comes (``None``: every medium); blocks of
            other media are kept and attached later.
        parent_anywhere: a parent held in any medium counts (else only one held in
            :attr:`strict_parent_media`).
        orphan_why: what it does with such a block, in words.
    """

    name: str
    version: str
    media: Mapping[str | None, Credit]
    folded_media: frozenset[str] = frozenset()
    other_media: Effect
    other_media_credit: Credit | None = None
    localities: frozenset[str | None] | None = None
    drops_ownership: bool = False
    ownership_credit: Credit | None = None
    groups: frozenset[int | None] | None = None
    int_hashes_only: bool = False
    empty_topic_only: bool = False
    block_size_setting: str
    default_block_size: int | None = None
    hashes_tokens: bool = True
    strict_parent_media: frozenset[str | None] | None = frozenset()
    parent_anywhere: bool = False
    orphan_why: str = ""

    @property
    def label(self) -> str:
        """``name version``, as findings name the router."""
        return f"{self.name} {self.version}"

    def credit(self, medium: str | None) -> Credit | None:
        """The credit of a block on ``medium`` (``None``: dropped or miscredited)."""
        credit = self.media.get(medium)
        if credit is None and medium is not None and medium.upper() in self.folded_media:
            credit = self.media.get(medium.upper())
        return credit

    def strict_parent(self, medium: str | None) -> bool:
        """Whether a ``medium`` block whose parent it does not hold is dropped."""
        return self.strict_parent_media is None or medium in self.strict_parent_media


_VLLM_HOST = Credit(0.8, "--kv-penalty-host")
_VLLM_DISK = Credit(0.3, "--kv-penalty-disk")
_DYNAMO_HOST = Credit(0.75, "DYN_ROUTER_HOST_CACHE_HIT_WEIGHT")
_DYNAMO_DISK = Credit(0.25, "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT")

VLLM_ROUTER = RouterProfile(
    name="vllm-router",
    version="0.1.17",
    media={
        None: DEVICE,
        "GPU": DEVICE,
        "CPU": _VLLM_HOST,
        "STORAGE": _VLLM_DISK,
        "DISK": _VLLM_DISK,
    },
    folded_media=frozenset({"CPU"}),
    other_media=Effect.MISCREDITS,
    other_media_credit=Credit(1.0, "as if on the device"),
    ownership_credit=Credit(0.6, "--kv-penalty-external"),
    groups=frozenset({None, 0}),
    empty_topic_only=True,
    block_size_setting="--kv-event-block-size",
    default_block_size=16,
    strict_parent_media=None,
    parent_anywhere=True,
    orphan_why="it keeps a block only under a parent it holds, in any medium, and does not "
    "attach it when the parent comes",
)
"""vllm-router 0.1.17, ``--policy kv_aware`` (``tests/routers.py``, measured against the
router): ``CPU`` (any case) at 0.8 (``--kv-penalty-host``), ``STORAGE`` and ``DISK`` at 0.3
(``--kv-penalty-disk``), every other medium name (``CPU_PINNED``, ``EXTERNAL``,
``SHARED_STORAGE``, a custom one) as if on the device; an event naming an ``ownership`` at
0.6 (``--kv-penalty-external``) whatever its medium; ``group_idx`` other than 0 not credited;
every event of a message with a non-empty ZMQ topic dropped (0.1.17 has no topic flag); stores
of another block size than ``--kv-event-block-size`` (default 16) dropped; a block whose
parent it does not hold dropped in every medium, never attached later. It hashes each block's
token ids itself (hash values only link parents, and may be bytes), keeping only the blocks
whose token ids are all there."""

DYNAMO = RouterProfile(
    name="dynamo",
    version="1.6.1",
    media={
        None: DEVICE,
        "GPU": DEVICE,
        "CPU": _DYNAMO_HOST,
        "CPU_PINNED": _DYNAMO_HOST,
        "STORAGE": _DYNAMO_DISK,
        "DISK": _DYNAMO_DISK,
        "EXTERNAL": _DYNAMO_DISK,
    },
    other_media=Effect.DROPS,
    localities=frozenset({None, "LOCAL"}),
    drops_ownership=True,
    groups=frozenset({None, 0}),
    int_hashes_only=True,
    block_size_setting="the block_size each worker is registered with",
    strict_parent_media=frozenset({None, "GPU"}),
    orphan_why="its device tree keeps a block only under a parent it holds there (its host "
    "and disk trees attach it when the parent comes)",
)
"""Dynamo's KV indexer and select service, ``ai-dynamo-runtime`` 1.6.1 (``tests/dynamo.py``,
``tests/routers.py``): device, host (``CPU``, ``CPU_PINNED``: 0.75) and disk (``STORAGE``,
``DISK``, ``EXTERNAL``: 0.25) trees; other media (lowercase ``cpu`` included), localities but
``LOCAL`` (or none), any ``ownership``, ``group_idx`` other than 0, placeholders and stores of
another block size than the worker's registered one dropped; a batch holding a bytes hash
fails to decode and is dropped whole; the device tree drops a block whose parent it does not
hold. It hashes each block's token ids itself, keeping only the blocks whose token ids are
all there; topics are not filtered."""

PROFILES: Mapping[str, RouterProfile] = {p.name: p for p in (VLLM_ROUTER, DYNAMO)}
"""Every known router by name."""


@attrs.frozen
class Finding:
    """One thing a router does with what kvhex publishes.

    Attributes:
        router: the router and release (``dynamo 1.6.1``).
        rule: which fact this is about.
        effect: drops, miscredits, or credits (at the weight :attr:`why` names).
        subject: what it applies to (``events``, ``stores``, ``batches``, ``every event``).
        field: the event field or stream property (``medium``, ``ZMQ topic``).
        value: the value, as shown (``'SHARED_STORAGE'``, ``32``).
        why: what the router reads instead (for ``CREDITS``: the weight and its setting).
        fix: what to change (``None``: nothing to change).
        key: the configuration key (or flag, or variable) the fix is at; ``None`` when no
            kvhex setting fixes it.
    """

    router: str
    rule: Rule
    effect: Effect
    subject: str
    field: str
    value: str
    why: str
    fix: str | None = None
    key: str | None = None

    @property
    def mismatch(self) -> bool:
        """The router drops or miscredits what this finding is about."""
        return self.effect is not Effect.CREDITS

    def line(self) -> str:
        """The finding in one line."""
        head = f"{self.router} {self.effect.value} {self.subject} with {self.field} {self.value}"
        if self.effect is Effect.CREDITS:
            return f"{head} at {self.why}"
        text = f"{head}: {self.why}"
        return text if self.fix is None else f"{text}; fix: {self.fix}"


def _shown(value: str | None) -> str:
    return "none" if value is None else repr(value)


def _names(values: Iterable[str | None], sep: str = ", ") -> str:
    """The values named, ``None`` as ``none``, in order (``None`` last)."""
    return sep.join(v or "none" for v in sorted(values, key=lambda v: (v is None, v or "")))


def check_medium(profile: RouterProfile, medium: str | None, *, key: str) -> Finding:
    """How ``profile`` credits events naming ``medium``; ``key`` is where a tier's medium is
    set (the fix of a medium it drops or miscredits)."""
    credit = profile.credit(medium)
    if credit is not None:
        why = f"{credit.weight!r} ({credit.setting})"
        return Finding(
            profile.label, Rule.MEDIUM, Effect.CREDITS, "events", "medium", _shown(medium), why
        )
    read = _names(m for m in profile.media if m is not None)
    if profile.other_media is Effect.MISCREDITS and profile.other_media_credit is not None:
        other = profile.other_media_credit
        why = f"it credits them {other.setting} ({other.weight!r}); it weighs only {read}"
    else:
        why = f"it reads only the media {read} (or none)"
    fix = f"set {key} to {_credited_name(profile, medium)!r}"
    return Finding(
        profile.label,
        Rule.MEDIUM,
        profile.other_media,
        "events",
        "medium",
        _shown(medium),
        why,
        fix,
        key,
    )


def _credited_name(profile: RouterProfile, medium: str | None) -> str:
    """The medium a tier named ``medium`` should announce instead: the same name in upper
    case where the router credits it, ``CPU`` for host memory, else ``STORAGE``."""
    upper = (medium or "").upper()
    if upper in profile.media and upper != "GPU":
        return upper
    return "CPU" if "CPU" in upper else "STORAGE"


def check_locality(profile: RouterProfile, locality: str | None, *, key: str) -> Finding | None:
    """A finding when ``profile`` drops events naming ``locality``."""
    if profile.localities is None or locality in profile.localities:
        return None
    read = _names(profile.localities, " or ")
    return Finding(
        profile.label,
        Rule.LOCALITY,
        Effect.DROPS,
        "events",
        "locality",
        _shown(locality),
        f"it reads only the locality {read}",
        f"set {key} to 'LOCAL' (only if every instance the router sends to can load from the tier)",
        key,
    )


def check_ownership(profile: RouterProfile, ownership: str | None, *, key: str) -> Finding | None:
    """A finding when ``profile`` drops, or credits at another weight, events naming
    ``ownership``."""
    if ownership is None or not (profile.drops_ownership or profile.ownership_credit):
        return None
    effect, why = Effect.DROPS, "it drops every event that names an ownership"
    if not profile.drops_ownership and profile.ownership_credit is not None:
        credit = profile.ownership_credit
        effect = Effect.MISCREDITS
        why = (
            f"it credits every event that names an ownership at {credit.weight!r} "
            f"({credit.setting}), whatever its medium"
        )
    return Finding(
        profile.label,
        Rule.OWNERSHIP,
        effect,
        "events",
        "ownership",
        _shown(ownership),
        why,
        f"set {key} to false",
        key,
    )


def check_group(profile: RouterProfile, group_idx: int | None) -> Finding | None:
    """A finding when ``profile`` does not credit events of KV group ``group_idx``."""
    if profile.groups is None or group_idx in profile.groups:
        return None
    return Finding(
        profile.label,
        Rule.GROUP,
        Effect.DROPS,
        "events",
        "group_idx",
        str(group_idx),
        "it credits KV group 0 only",
        "none in kvhex: the model's other KV groups (a hybrid model's) are not routed on",
    )


def check_residency(
    profile: RouterProfile,
    medium: str | None,
    locality: str | None,
    ownership: str | None,
    *,
    medium_key: str,
    locality_key: str,
    ownership_key: str,
) -> list[Finding]:
    """What ``profile`` does with events of one residency (medium, locality, ownership):
    each reason it drops or miscredits them, or else the one credit they get."""
    medium_finding = check_medium(profile, medium, key=medium_key)
    found = [
        f
        for f in (
            medium_finding,
            check_locality(profile, locality, key=locality_key),
            check_ownership(profile, ownership, key=ownership_key),
        )
        if f is not None and f.mismatch
    ]
    return found or [medium_finding]


def check_hash_form(profile: RouterProfile, *, key: str, value: str = "true") -> Finding | None:
    """A finding when ``profile`` drops batches holding bytes hashes (``key`` = ``value``
    publishes ints)."""
    if not profile.int_hashes_only:
        return None
    return Finding(
        profile.label,
        Rule.HASH_FORM,
        Effect.DROPS,
        "whole batches",
        "block hashes as",
        "bytes",
        "it decodes int hashes only (the low 64 bits, vLLM's default)",
        f"set {key} to {value}",
        key,
    )


def check_topic(profile: RouterProfile, topic: str, *, key: str) -> Finding | None:
    """A finding when ``profile`` drops messages published under ``topic``."""
    if not topic or not profile.empty_topic_only:
        return None
    return Finding(
        profile.label,
        Rule.TOPIC,
        Effect.DROPS,
        "every event",
        "ZMQ topic",
        repr(topic),
        f"it reads only the empty topic ({profile.version} has no topic setting)",
        f'set {key} to ""',
        key,
    )


def check_block_size(
    profile: RouterProfile, block_size: int, expected: int, *, key: str, told: str
) -> Finding | None:
    """A finding when ``profile``, reading block size ``expected`` (``told``: where that
    comes from), drops stores of ``block_size``; ``key`` is where kvhex is told the router's
    block size. Placeholders (``block_size`` 0) are :func:`check_store`'s."""
    if block_size in (expected, 0):
        return None
    return Finding(
        profile.label,
        Rule.BLOCK_SIZE,
        Effect.DROPS,
        "stores",
        "block_size",
        str(block_size),
        f"it reads block_size {expected} only ({told})",
        f"configure the router for block size {block_size} ({profile.block_size_setting}) "
        f"and set {key} to {block_size}, or serve with block size {expected}",
        key,
    )


def check_store(
    profile: RouterProfile, *, hashes: int, tokens: int, block_size: int
) -> Finding | None:
    """A finding when ``profile``, hashing token ids itself, drops a store of ``hashes``
    block hashes with ``tokens`` token ids of ``block_size`` per block (a placeholder: no
    token ids, or block size 0), or the blocks of it that ``tokens`` do not cover whole."""
    if not profile.hashes_tokens:
        return None
    if not tokens or block_size == 0:
        return Finding(
            profile.label,
            Rule.PLACEHOLDER,
            Effect.DROPS,
            "stores",
            "token_ids",
            "[] (placeholders, block_size 0)",
            "it hashes each block's token_ids itself",
            "none in kvhex: a placeholder is a block kvhex cannot describe (no provenance, a "
            "sliding-window or Mamba group, a token-mutating request; docs/events.md)",
        )
    if tokens < block_size * hashes:
        return Finding(
            profile.label,
            Rule.PARTIAL_BLOCK,
            Effect.DROPS,
            "the last blocks of stores",
            "token_ids",
            "short of block_size per hash",
            "it keeps only the blocks whose block_size token_ids are all there",
            "none in kvhex (it publishes block_size token ids per hash): the publisher "
            "must send whole blocks",
        )
    return None


def check_parent_first(profile: RouterProfile, medium: str | None) -> Finding | None:
    """A finding when ``profile`` drops a ``medium`` store whose parent it does not hold."""
    if not profile.strict_parent(medium):
        return None
    return Finding(
        profile.label,
        Rule.PARENT_FIRST,
        Effect.DROPS,
        f"{medium or 'device'} stores",
        "parent_block_hash",
        "not held yet",
        profile.orphan_why,
        "none in kvhex: the publisher must announce every parent first (kvhex does)",
    )
