"""What a request says about the blocks it produced: the inputs of a full ``BlockStored``.

A ``Provenance`` holds *references* to the request's live token ids and block hashes (never
copies): the engine appends to them as the request runs, and the locator reads them only when
an event is translated. Per-chunk snapshots are never taken, so a request that finished long
ago costs only what the engine itself still holds for it, until its last event is translated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from kvhex.domain.geometry import KvGeometry


@attrs.frozen(slots=True)
class MmFeature:
    """A multimodal input placed in the prompt: ``length`` tokens from ``offset``."""

    identifier: str
    offset: int
    length: int


@attrs.define(slots=True, eq=False)
class Provenance:
    """The request-side facts a stored block's event is built from.

    Attributes:
        geometry: the model's KV-cache groups and hash block size.
        token_ids: the request's token ids, live (prompt then output).
        block_hashes: the request's block hashes at ``tokens_per_hash`` granularity, live.
        lora_id: the LoRA adapter id (vLLM's deprecated ``lora_id`` field), if any.
        lora_name: the LoRA adapter name, if any (an extra key of every block).
        mm_features: multimodal inputs, sorted by offset.
        cache_salt: the tenant salt (an extra key of the first block only).
        prompt_embeds_digest: digest of the prompt embeddings of tokens ``[start, end)``,
            when the prompt came as embeddings (an extra key of each block).
        session_id: the engine's session id, announced as is.
        mutates_tokens: the engine may rewrite tokens after hashing them (then events carry
            placeholders: tokens read at translation time could differ from those hashed).
        device_events: the engine announces this request's blocks on its device itself,
            before kvhex's events of the same step (vLLM's GPU events): a chunk whose parent
            no kvhex tier announced is announced at the end of its step, its parent being the
            device's, instead of waiting for a kvhex tier to announce the parent.
    """

    geometry: KvGeometry
    token_ids: Sequence[int]
    block_hashes: Sequence[bytes]
    lora_id: int | None = None
    lora_name: str | None = None
    mm_features: tuple[MmFeature, ...] = ()
    cache_salt: str | None = None
    prompt_embeds_digest: Callable[[int, int], bytes] | None = None
    session_id: str | None = None
    mutates_tokens: bool = False
    device_events: bool = False
    _hash_index: dict[bytes, int] = attrs.field(factory=dict, init=False, repr=False)
    _indexed: int = attrs.field(default=0, init=False, repr=False)
    _chunk_index: dict[int, tuple[dict[bytes, int], list[int]]] = attrs.field(
        factory=dict, init=False, repr=False
    )

    def hash_index(self) -> Mapping[bytes, int]:
        """Each of the request's block hashes -> its index in ``block_hashes``.

        Built lazily and extended incrementally as the live hash list grows.
        """
        hashes = self.block_hashes
        index = self._hash_index
        n = len(hashes)
        if self._indexed < n:
            # chained hashes do not repeat within a request; a repeat would map to its last
            index.update(zip(hashes[self._indexed : n], range(self._indexed, n), strict=True))
            self._indexed = n
        return index

    def chunk_index(self, hashes_per_chunk: int) -> Mapping[bytes, int]:
        """The hashes that end a chunk of ``hashes_per_chunk`` hash blocks -> their index in
        ``block_hashes``: where a chunk key is found without indexing every hash (a partial
        tail's is found by :meth:`hash_index`). Extended incrementally."""
        entry = self._chunk_index.get(hashes_per_chunk)
        if entry is None:
            entry = self._chunk_index[hashes_per_chunk] = ({}, [0])
        index, done = entry
        hashes = self.block_hashes
        n = len(hashes) // hashes_per_chunk * hashes_per_chunk
        if done[0] < n:
            ends = range(done[0] + hashes_per_chunk - 1, n, hashes_per_chunk)
            index.update(zip(hashes[ends.start : n : hashes_per_chunk], ends, strict=True))
            done[0] = n
        return index

    def hash_position(self, block_hash: bytes) -> int | None:
        """The end token of the hash block whose hash is ``block_hash``, or ``None``."""
        found = self.hash_index().get(block_hash)
        return None if found is None else (found + 1) * self.geometry.tokens_per_hash
