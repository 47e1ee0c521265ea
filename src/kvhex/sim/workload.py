"""Requests for a replay: a synthetic multi-turn chat with shared prefixes, or a JSONL file.

Tokens are hashed as an engine hashes them: in blocks of ``tokens_per_hash``, each hash
chained to its parent and covering the block's extra keys (LoRA, the cache salt on the first
block, multimodal inputs), with SHA-256 over a canonical encoding.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import attrs

from kvhex.domain.extra_keys import block_extra_keys
from kvhex.domain.geometry import KvGeometry
from kvhex.domain.provenance import MmFeature, Provenance
from kvhex.domain.request import ReqContext
from kvhex.errors import ConfigError, ConfigIssue

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


CONVERSATIONS = 64
"""At most this many conversations of the synthetic chat are open at once (fewer for short
runs: one per six requests), so its working set stays the same however long it runs."""
MAX_TURNS = 12
"""A synthetic conversation ends after 2 to this many turns and a new one takes its place."""
_MAX_USER = 4
_MAX_REPLY = 3
_ODD = 16


class DeviceCache(NamedTuple):
    """The device KV cache one request must fit in (``[run]``'s ``tokens_per_block`` x
    ``blocks_per_chunk`` tokens per chunk, ``device_blocks`` blocks)."""

    tokens_per_chunk: int
    blocks_per_chunk: int
    device_blocks: int

    def blocks(self, tokens: int) -> int:
        """Device blocks a prompt of ``tokens`` takes (its full chunks)."""
        return tokens // self.tokens_per_chunk * self.blocks_per_chunk

    def problem(self, tokens: int) -> str | None:
        """Why a prompt of ``tokens`` does not fit, or ``None``."""
        need = self.blocks(tokens)
        if need <= self.device_blocks:
            return None
        return (
            f"{tokens} tokens need {need} device blocks, more than [run].device_blocks = "
            f"{self.device_blocks}: raise [run].device_blocks to at least {need} or shorten "
            "the request"
        )


def synthetic_max_tokens(tokens_per_chunk: int) -> int:
    """The longest prompt :func:`synthetic_chat` can make: the system prompt, then every turn
    but the last with its longest user message and reply, then the longest user message."""
    user = _MAX_USER * tokens_per_chunk + _ODD - 1
    turn = user + _MAX_REPLY * tokens_per_chunk
    return 8 * tokens_per_chunk + (MAX_TURNS - 1) * turn + user


class _Conversation:
    __slots__ = ("ident", "lora", "mm", "salt", "tokens", "turn", "turns")

    def __init__(self, ident: int, system: list[int], turns: int) -> None:
        self.ident = ident
        self.tokens = list(system)
        self.salt = f"tenant-{ident % 2}"
        self.lora = "support-adapter" if ident % 4 == 3 else None
        self.mm: tuple[MmFeature, ...] = ()
        self.turn = 0
        self.turns = turns


def synthetic_chat(requests: int | None, *, seed: int, tokens_per_chunk: int) -> Iterator[Request]:
    """A multi-turn chat workload of ``requests`` requests (``None``: endless), made one
    request at a time, so memory stays flat however many are asked for: conversations that
    share one of three system prompts, run by two tenants (cache salts), some through a LoRA
    adapter and some with an image; each turn's prompt is the whole conversation so far plus
    a new user message. Up to :data:`CONVERSATIONS`
    conversations interleave, so older context leaves the host tier before it is needed
    again; each ends after 2 to :data:`MAX_TURNS` turns and a new one opens in its place."""
    rng = random.Random(seed)
    systems = [_tokens(rng, 8 * tokens_per_chunk) for _ in range(3)]
    wanted = CONVERSATIONS * 6 if requests is None else requests
    open_at_once = max(1, min(wanted // 6, CONVERSATIONS))
    convs = [
        _Conversation(c, systems[c % 3], rng.randint(2, MAX_TURNS)) for c in range(open_at_once)
    ]
    opened = open_at_once
    for _ in itertools.count() if requests is None else range(requests):  # lazy, any size
        place = rng.randrange(open_at_once)
        conv = convs[place]
        user = rng.randint(2, _MAX_USER) * tokens_per_chunk + rng.randrange(_ODD)
        conv.tokens += _tokens(rng, user)
        if conv.turn == 1 and conv.ident % 5 == 2:  # an image in the second user message
            offset = len(conv.tokens) - tokens_per_chunk
            conv.mm = (MmFeature(f"img-{conv.ident}", offset, tokens_per_chunk // 2),)
        yield Request(
            f"chat-{conv.ident}-turn-{conv.turn}",
            tuple(conv.tokens),
            conv.lora,
            conv.salt,
            conv.mm,
        )
        conv.turn += 1
        if conv.turn >= conv.turns:
            convs[place] = _Conversation(opened, systems[opened % 3], rng.randint(2, MAX_TURNS))
            opened += 1
        else:
            conv.tokens += _tokens(rng, rng.randint(1, _MAX_REPLY) * tokens_per_chunk)  # reply


def read_workload(
    path: str | Path,
    *,
    seed: int,
    limit: int | None = None,
    device: DeviceCache | None = None,
) -> Iterator[Request]:
    """Requests from a JSONL file, one JSON object per line (blank lines skipped):

    * ``tokens``: the prompt's token ids; or ``length``: how many tokens, with an optional
      ``prefix_group`` (a name) and ``prefix_length`` (at most ``length``): the first
      ``prefix_length`` tokens are equal for every line of the group;
    * optional ``id``, ``lora`` (adapter name), ``cache_salt`` (tenant), ``mm`` (a list of
      ``{"id": str, "offset": int, "length": int}``).

    The file is checked whole (up to ``limit`` requests) before this returns; the requests
    are then made as they are iterated, so memory does not grow with the file.

    Raises:
        ConfigError: naming the file, line and key of every bad line (a request longer than
            ``device`` holds names ``[run].device_blocks``).
    """
    source = str(path)
    issues: list[ConfigIssue] = []
    count = 0
    try:
        for number, item in _lines(path):
            where = f"line {number}"
            if isinstance(item, str):
                issues.append((where, item))
                continue
            found = list(_line_issues(item, where, device))
            issues.extend(found)
            count += not found
            if limit is not None and count >= limit:
                break
    except OSError as exc:
        raise ConfigError([("$", f"cannot read workload: {exc.strerror or exc}")], source) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([("$", f"not a UTF-8 text file: {exc.reason}")], source) from exc
    if issues:
        raise ConfigError(issues, source)
    if not count:
        raise ConfigError([("$", "the workload holds no request")], source)
    return _requests(path, seed, count)


def _lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Each non-blank line's number and object, or what is wrong with it (a string)."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                yield number, f"not valid JSON: {exc.msg}"
                continue
            if not isinstance(item, dict):
                yield number, f"expected an object, got {type(item).__name__}"
                continue
            yield number, item


def _requests(path: str | Path, seed: int, count: int) -> Iterator[Request]:
    """The first ``count`` requests of a checked file, made one at a time."""
    rng = random.Random(seed)
    for number, item in itertools.islice(_lines(path), count):
        where = f"line {number}"
        changed = (
            [(where, item)] if isinstance(item, str) else list(_line_issues(item, where, None))
        )
        if changed or isinstance(item, str):
            raise ConfigError(
                [(key, f"changed while the run read the file: {why}") for key, why in changed],
                str(path),
            )
        if "tokens" in item:
            tokens = list(item["tokens"])
        else:
            length = item["length"]
            group = item.get("prefix_group")
            shared: list[int] = []
            if group is not None:  # the same seed draws the same leading tokens for the group
                want = item.get("prefix_length", length)
                shared = _tokens(random.Random(f"{seed}:{group}"), want)
            tokens = shared + _tokens(rng, length - len(shared))
        mm = tuple(MmFeature(m["id"], m["offset"], m["length"]) for m in item.get("mm", ()))
        yield Request(
            str(item.get("id", f"req-{number}")),
            tuple(tokens),
            item.get("lora"),
            item.get("cache_salt"),
            tuple(sorted(mm, key=lambda f: f.offset)),
        )


def _line_issues(
    item: dict[str, Any], where: str, device: DeviceCache | None
) -> Iterator[ConfigIssue]:
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
    length, prefix = item.get("length"), item.get("prefix_length")
    if isinstance(length, int) and isinstance(prefix, int) and prefix > length > 0:
        yield (
            f"{where}.prefix_length",
            f"{prefix} is longer than the prompt (length {length}): at most {length}",
        )
    size = len(tokens) if isinstance(tokens, list) else length
    if device is not None and isinstance(size, int):
        problem = device.problem(size)
        if problem is not None:
            yield (f"{where}.{'tokens' if 'tokens' in item else 'length'}", problem)
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
