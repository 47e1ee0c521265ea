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

__all__ = ["block_extra_keys"]


def block_extra_keys(prov: Provenance, start: int, end: int) -> tuple[Any, ...] | None:
    """The published extra keys of the block covering tokens ``[start, end)``."""
    keys: list[Any] = []
    if prov.lora_name:
        keys.append(prov.lora_name)
    for feature in prov.mm_features:
        if feature.offset >= end:
            break
        if feature.offset + feature.length > start:
            keys.append((feature.identifier, feature.offset - start))
    if start == 0 and prov.cache_salt:
        keys.append(prov.cache_salt)
    if prov.prompt_embeds_digest is not None:
        keys.append(prov.prompt_embeds_digest(start, end))
    return tuple(keys) if keys else None
