"""Per-block extra keys exactly as vLLM's GPU prefix cache publishes them.

vLLM hashes each block with tagged extra keys (``("lora", name, path)``, ``("mm", identifier,
offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``) and publishes them in
``BlockStored.extra_keys`` untagged, in that order: the bare LoRA name, ``(identifier,
offset)`` pairs with the offset relative to the block start, the bare cache salt (first block
only), the bare prompt-embeddings digest. A block without any is ``None``.
"""

from __future__ import annotations

from typing import Any

from kvhex.domain.provenance import Provenance


def chunk_extra_keys(
    prov: Provenance, start: int, end: int, step: int
) -> list[tuple[Any, ...] | None] | None:
    """The published extra keys of each block of ``step`` tokens in ``[start, end)``, or
    ``None`` when no block has any (vLLM publishes ``extra_keys=None`` then)."""
    n = (end - start) // step
    lora = prov.lora_name
    salt = prov.cache_salt if start == 0 else None
    embeds = prov.prompt_embeds_digest
    features = [f for f in prov.mm_features if f.offset < end and f.offset + f.length > start]
    base: tuple[Any, ...] | None = (lora,) if lora else None
    if not features and not salt and embeds is None:
        # the common case: every block carries the same keys (the LoRA name, or nothing)
        return [base] * n if base else None
    blocks: list[list[Any] | None] = [None] * n  # only blocks with more than the base
    for f in features:
        first = (max(f.offset, start) - start) // step
        last = (min(f.offset + f.length, end) - 1 - start) // step
        for i in range(first, last + 1):
            keys = blocks[i]
            if keys is None:
                keys = blocks[i] = [lora] if lora else []
            keys.append((f.identifier, f.offset - (start + i * step)))
    if salt:
        keys = blocks[0]
        if keys is None:
            keys = blocks[0] = [lora] if lora else []
        keys.append(salt)
    if embeds is not None:
        for i in range(n):
            keys = blocks[i]
            if keys is None:
                keys = blocks[i] = [lora] if lora else []
            block_start = start + i * step
            keys.append(embeds(block_start, block_start + step))
    return [base if keys is None else tuple(keys) for keys in blocks]


def block_extra_keys(prov: Provenance, start: int, end: int) -> tuple[Any, ...] | None:
    """The published extra keys of the one block covering tokens ``[start, end)``."""
    keys = chunk_extra_keys(prov, start, end, end - start)
    return None if keys is None else keys[0]
