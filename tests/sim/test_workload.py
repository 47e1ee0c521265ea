"""Workloads are made as they are taken: the synthetic chat stays the same size however
long it runs, a workload file is checked whole up front and then read one line at a time."""

from __future__ import annotations

import itertools
import json
import tracemalloc
from pathlib import Path

import pytest

from kvhex.errors import ConfigError
from kvhex.sim.workload import (
    CONVERSATIONS,
    DeviceCache,
    read_workload,
    synthetic_chat,
    synthetic_max_tokens,
)

TOKENS_PER_CHUNK = 64


def test_the_synthetic_chat_is_lazy_and_flat_whatever_is_asked() -> None:
    tracemalloc.start()
    try:
        huge = synthetic_chat(10**22, seed=1, tokens_per_chunk=TOKENS_PER_CHUNK)
        taken = [(r.req_id, len(r.tokens)) for r in itertools.islice(huge, 3000)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(taken) == 3000
    # what is open at once: 64 conversations of at most ~4,400 tokens (the old list of every
    # request asked for never returned)
    assert peak < 64 * 2**20
    assert max(n for _, n in taken) <= synthetic_max_tokens(TOKENS_PER_CHUNK)
    conversations = [req_id.split("-turn-")[0] for req_id, _ in taken]
    assert len(set(conversations[:100])) <= CONVERSATIONS
    assert len(set(conversations)) > CONVERSATIONS  # finished ones were replaced


def test_the_synthetic_chat_is_the_same_for_a_seed_and_endless_without_a_count() -> None:
    def taken(requests: int | None, seed: int) -> list[tuple[str, int]]:
        chat = synthetic_chat(requests, seed=seed, tokens_per_chunk=TOKENS_PER_CHUNK)
        return [(r.req_id, hash(r.tokens)) for r in itertools.islice(chat, 300)]

    assert taken(None, 3) == taken(None, 3)
    assert taken(None, 3) != taken(None, 4)
    assert len(taken(None, 3)) == 300
    assert len(list(synthetic_chat(7, seed=3, tokens_per_chunk=TOKENS_PER_CHUNK))) == 7


def test_a_workload_file_is_checked_whole_then_read_as_taken(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        "\n".join(json.dumps({"length": 100 + i, "prefix_group": "a"}) for i in range(5)) + "\n"
    )
    requests = read_workload(path, seed=0, limit=3)
    path.write_text("")  # the file is read again as the requests are taken
    with pytest.raises(StopIteration):
        next(requests)
    path.write_text(
        "\n".join(json.dumps({"length": 100 + i, "prefix_group": "a"}) for i in range(5)) + "\n"
    )
    got = list(read_workload(path, seed=0, limit=3))
    assert [len(r.tokens) for r in got] == [100, 101, 102]
    assert got[0].tokens[:100] == got[1].tokens[:100]  # the group's shared prefix


def test_every_bad_line_is_named_before_any_request_is_made(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    lines = [
        '{"length": 10, "prefix_group": "a", "prefix_length": 11}',
        '{"length": 1000}',
        '{"tokens": [1, 2, 3]}',
        "[1, 2]",
        "{not json",
    ]
    path.write_text("\n".join(lines) + "\n")
    device = DeviceCache(tokens_per_chunk=64, blocks_per_chunk=4, device_blocks=32)
    with pytest.raises(ConfigError) as caught:
        read_workload(path, seed=0, device=device)
    assert caught.value.source == str(path)
    issues = dict(caught.value.issues)
    assert issues["line 1.prefix_length"] == (
        "11 is longer than the prompt (length 10): at most 10"
    )
    assert (
        "1000 tokens need 60 device blocks, more than [run].device_blocks = 32"
        in (issues["line 2.length"])
    )
    assert "raise [run].device_blocks to at least 60" in issues["line 2.length"]
    assert "line 3" not in str(caught.value)
    assert issues["line 4"] == "expected an object, got list"
    assert issues["line 5"].startswith("not valid JSON")


def test_a_device_cache_that_holds_the_request(tmp_path: Path) -> None:
    device = DeviceCache(tokens_per_chunk=64, blocks_per_chunk=4, device_blocks=60)
    assert device.problem(1000) is None  # 15 full chunks: 60 blocks
    assert device.problem(1024) is not None
    path = tmp_path / "w.jsonl"
    path.write_text('{"length": 1000}\n')
    assert len(list(read_workload(path, seed=0, device=device))) == 1


def test_an_empty_or_unreadable_workload_names_the_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no request"):
        read_workload(empty, seed=0)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="not a UTF-8 text file"):
        read_workload(binary, seed=0)
    with pytest.raises(ConfigError, match="cannot read workload"):
        read_workload(tmp_path / "missing.jsonl", seed=0)
