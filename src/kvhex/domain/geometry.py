"""KV-cache geometry: how a request's tokens map to hash blocks, cache blocks and chunks.

vLLM hashes a request's tokens in fixed groups of ``tokens_per_hash`` (its hash block size).
Each KV-cache group stores blocks of ``tokens_per_block`` tokens (a multiple of
``tokens_per_hash``) and offloads chunks of ``blocks_per_chunk`` blocks. A chunk's key is the
hash of its last hash block; a partial tail (a boundary that is a multiple of
``tokens_per_hash`` but not of the chunk size) is keyed by the hash just before the boundary.
"""

from __future__ import annotations

import enum

import attrs


class CacheKind(enum.Enum):
    """A KV-cache group's kind, with vLLM's ``KVCacheSpecKind`` values."""

    FULL_ATTENTION = "full_attention"
    MLA_ATTENTION = "mla_attention"
    SLIDING_WINDOW = "sliding_window"
    SLIDING_WINDOW_MLA = "sliding_window_mla"
    MAMBA = "mamba"
    CHUNKED_LOCAL_ATTENTION = "chunked_local_attention"
    SINK_FULL_ATTENTION = "sink_full_attention"
    ENCODER_ONLY_ATTENTION = "encoder_only_attention"
    CROSS_ATTENTION = "cross_attention"
    UNKNOWN = "unknown"

    @property
    def keeps_every_block(self) -> bool:
        """True when every block of the prefix stays valid, so a stored chunk can be described
        by its tokens and hashes (full attention and its MLA and sink variants)."""
        return self in _FULL_PAYLOAD_KINDS


_FULL_PAYLOAD_KINDS = frozenset(
    {CacheKind.FULL_ATTENTION, CacheKind.MLA_ATTENTION, CacheKind.SINK_FULL_ATTENTION}
)


def _positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(slots=True)
class KvGroup:
    """One KV-cache group.

    Attributes:
        group_idx: the group's index (the last four bytes of its offload keys).
        tokens_per_block: tokens per cache block (the ``block_size`` events announce).
        blocks_per_chunk: cache blocks per offloaded chunk.
        kind: the cache kind; only full-attention kinds get full event payloads.
        sliding_window: the window in tokens for sliding-window kinds.
    """

    group_idx: int = attrs.field(validator=attrs.validators.ge(0))
    tokens_per_block: int = attrs.field(validator=_positive)
    blocks_per_chunk: int = attrs.field(default=1, validator=_positive)
    kind: CacheKind = CacheKind.FULL_ATTENTION
    sliding_window: int | None = None
    # derived once: read per translated event, where enum property access shows up
    full_payload: bool = attrs.field(init=False, eq=False, repr=False)
    kind_name: str = attrs.field(init=False, eq=False, repr=False)

    @full_payload.default
    def _full_payload(self) -> bool:
        return self.kind.keeps_every_block

    @kind_name.default
    def _kind_name(self) -> str:
        return self.kind.value

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens in one full chunk."""
        return self.tokens_per_block * self.blocks_per_chunk


@attrs.frozen(slots=True)
class KvGeometry:
    """The groups of one model and the hash block size shared by all of them."""

    groups: tuple[KvGroup, ...]
    tokens_per_hash: int = attrs.field(validator=_positive)
    _by_idx: dict[int, KvGroup] = attrs.field(init=False, eq=False, repr=False)

    @_by_idx.default
    def _index_groups(self) -> dict[int, KvGroup]:
        return {g.group_idx: g for g in self.groups}

    def __attrs_post_init__(self) -> None:
        seen = set()
        for group in self.groups:
            if group.group_idx in seen:
                raise ValueError(f"group index {group.group_idx} appears twice")
            seen.add(group.group_idx)
            if group.tokens_per_block % self.tokens_per_hash:
                raise ValueError(
                    f"group {group.group_idx}: tokens_per_block {group.tokens_per_block} is "
                    f"not a multiple of tokens_per_hash {self.tokens_per_hash}"
                )

    def group(self, group_idx: int) -> KvGroup | None:
        """The group with this index, or ``None``."""
        return self._by_idx.get(group_idx)
