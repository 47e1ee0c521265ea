"""Requests for a replay: a synthetic multi-turn chat with shared prefixes, or a JSONL file.

Tokens are hashed as an engine hashes them: in blocks of ``tokens_per_hash``, each hash
chained to its parent and covering the block's extra keys (LoRA, the cache salt on the first
block, multimodal inputs), with SHA-256 over a canonical encoding.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from kvhex.domain.extra_keys import block_extra_keys
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.provenance import MmFeature, Provenance
from kvhex.domain.request import ReqContext
from kvhex.errors import ConfigError, ConfigIssue

__all__ = ["Request", "context", "read_workload", "synthetic_chat"]

VOCAB = 32_000
_ROOT = b"\0" * 32
_KNOWN = frozenset(
    {"id", "tokens", "length", "prefix_group", "prefix_length", "lora", "cache_salt", "mm"}
)


@attrs.frozen
class Request:
    """One request of a workload: its prompt tokens and what else goes into its hashes."""

    req_id: str
    tokens: tuple[int, ...]
    lora: str | None = None
    cache_salt: str | None = None
    mm: tuple[MmFeature, ...] = ()


def context(request: Request, geometry: KvGeometry) -> ReqContext:
    """A request context whose provenance holds the request's tokens and block hashes."""
    tokens = list(request.tokens)
    hashes: list[bytes] = []
    prov = Provenance(
        geometry=geometry,
        token_ids=tokens,
        block_hashes=hashes,
        lora_name=request.lora,
        mm_features=request.mm,
        cache_salt=request.cache_salt,
    )
    step = geometry.tokens_per_hash
    parent = _ROOT
    for start in range(0, len(tokens) - step + 1, step):
        extra = block_extra_keys(prov, start, start + step)
        digest = hashlib.sha256(parent)
        digest.update(struct.pack(f"<{step}I", *tokens[start : start + step]))
        if extra is not None:
            digest.update(repr(extra).encode())
        parent = digest.digest()
        hashes.append(parent)
    return ReqContext(request.req_id, provenance=prov)


def synthetic_chat(requests: int, *, seed: int, tokens_per_chunk: int) -> list[Request]:
    """A multi-turn chat workload: conversations that share one of three system prompts, run
    by two tenants (cache salts), some through a LoRA adapter and some with an image; each
    turn's prompt is the whole conversation so far plus a new user message. Conversations
    interleave, so older context leaves the host tier before it is needed again."""
    rng = random.Random(seed)
    systems = [_tokens(rng, 8 * tokens_per_chunk) for _ in range(3)]
    n_conv = max(1, requests // 6)
    convs: list[dict[str, Any]] = []
    for c in range(n_conv):
        convs.append(
            {
                "tokens": list(systems[c % 3]),
                "salt": f"tenant-{c % 2}",
                "lora": "support-adapter" if c % 4 == 3 else None,
                "mm": (),
                "turn": 0,
            }
        )
    out: list[Request] = []
    while len(out) < requests:
        conv = convs[rng.randrange(n_conv)]
        c = convs.index(conv)
        conv["tokens"] += _tokens(rng, rng.randint(2, 4) * tokens_per_chunk + rng.randrange(16))
        if conv["turn"] == 1 and c % 5 == 2:  # an image in the second user message
            offset = len(conv["tokens"]) - tokens_per_chunk
            conv["mm"] = (MmFeature(f"img-{c}", offset, tokens_per_chunk // 2),)
        out.append(
            Request(
                f"chat-{c}-turn-{conv['turn']}",
                tuple(conv["tokens"]),
                conv["lora"],
                conv["salt"],
                conv["mm"],
            )
        )
        conv["tokens"] += _tokens(rng, rng.randint(1, 3) * tokens_per_chunk)  # the reply
        conv["turn"] += 1
    return out


def read_workload(path: str | Path, *, seed: int, limit: int | None = None) -> list[Request]:
    """Requests from a JSONL file, one JSON object per line (blank lines skipped):

    * ``tokens``: the prompt's token ids; or ``length``: how many tokens, with an optional
      ``prefix_group`` (a name) and ``prefix_length``: the first ``prefix_length`` tokens are
      equal for every line of the group;
    * optional ``id``, ``lora`` (adapter name), ``cache_salt`` (tenant), ``mm`` (a list of
      ``{"id": str, "offset": int, "length": int}``).

    Raises:
        ConfigError: naming the file, line and key of every bad line.
    """
    source = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError([("$", f"cannot read workload: {exc.strerror or exc}")], source) from exc
    rng = random.Random(seed)
    out: list[Request] = []
    issues: list[ConfigIssue] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            issues.append((where, f"not valid JSON: {exc.msg}"))
            continue
        if not isinstance(item, dict):
            issues.append((where, f"expected an object, got {type(item).__name__}"))
            continue
        found = list(_line_issues(item, where))
        if found:
            issues.extend(found)
            continue
        if "tokens" in item:
            tokens = list(item["tokens"])
        else:
            length = item["length"]
            group = item.get("prefix_group")
            shared: list[int] = []
            if group is not None:  # the same seed draws the same leading tokens for the group
                want = min(item.get("prefix_length", length), length)
                shared = _tokens(random.Random(f"{seed}:{group}"), want)
            tokens = shared + _tokens(rng, length - len(shared))
        mm = tuple(MmFeature(m["id"], m["offset"], m["length"]) for m in item.get("mm", ()))
        out.append(
            Request(
                str(item.get("id", f"req-{number}")),
                tuple(tokens),
                item.get("lora"),
                item.get("cache_salt"),
                tuple(sorted(mm, key=lambda f: f.offset)),
            )
        )
        if limit is not None and len(out) >= limit:
            break
    if issues:
        raise ConfigError(issues, source)
    if not out:
        raise ConfigError([("$", "the workload holds no request")], source)
    return out


def _line_issues(item: dict[str, Any], where: str) -> Iterator[ConfigIssue]:
    for key in sorted(set(item) - _KNOWN):
        yield (f"{where}.{key}", f"unknown key; known keys: {', '.join(sorted(_KNOWN))}")
    if ("tokens" in item) == ("length" in item):
        yield (where, "needs exactly one of 'tokens' and 'length'")
    tokens = item.get("tokens")
    if tokens is not None and not (
        isinstance(tokens, list) and tokens and all(_is_int(t) and t >= 0 for t in tokens)
    ):
        yield (f"{where}.tokens", "expected a non-empty list of non-negative integers")
    for key in ("length", "prefix_length"):
        value = item.get(key)
        if value is not None and not (_is_int(value) and value > 0):
            yield (f"{where}.{key}", f"expected a positive integer, got {value!r}")
    if "prefix_length" in item and "prefix_group" not in item:
        yield (f"{where}.prefix_length", "needs a 'prefix_group'")
    for key in ("id", "prefix_group", "lora", "cache_salt"):
        value = item.get(key)
        if value is not None and not (isinstance(value, str) and value):
            yield (f"{where}.{key}", f"expected a non-empty string, got {value!r}")
    mm = item.get("mm", [])
    if not isinstance(mm, list):
        yield (f"{where}.mm", "expected a list of {id, offset, length} objects")
        return
    for i, feature in enumerate(mm):
        ok = (
            isinstance(feature, dict)
            and set(feature) == {"id", "offset", "length"}
            and isinstance(feature["id"], str)
            and _is_int(feature["offset"])
            and feature["offset"] >= 0
            and _is_int(feature["length"])
            and feature["length"] > 0
        )
        if not ok:
            yield (f"{where}.mm[{i}]", "expected {id: str, offset: int >= 0, length: int > 0}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]
