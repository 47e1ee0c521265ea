"""``kvhex events --router``: everything a router would silently drop or miscredit, one line
each with its count, and a non-zero exit; for each rule, a stream that triggers it and one
that passes, for both routers; the ZMQ topic of live messages seen; kvhex's own stream read
whole by both."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvhex.adapters.events.jsonl import JsonlEventSink
from kvhex.adapters.events.zmq import ZmqEventSink
from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from tests.cli.command import Lines, kvhex, spawn
from tests.cli.workload import serve


def stored(
    hashes: list[bytes | int] | int | bytes,
    parent: bytes | int | None = None,
    medium: str = "CPU",
    *,
    tokens: int | None = None,
    block_size: int = 16,
    locality: str | None = None,
    ownership: str | None = None,
) -> BlockStored:
    """A store of ``hashes`` (one, or a list) with ``block_size`` token ids per hash unless
    ``tokens`` says otherwise."""
    listed = hashes if isinstance(hashes, list) else [hashes]
    count = block_size * len(listed) if tokens is None else tokens
    return BlockStored(
        listed,
        parent,
        list(range(count)),
        block_size,
        None,
        medium,
        None,
        locality=locality,
        ownership=ownership,
    )


def stored_in_group(h: int, group: int) -> BlockStored:
    return BlockStored([h], None, list(range(16)), 16, None, "GPU", None, group_idx=group)


def placeholder(h: int) -> BlockStored:
    return BlockStored([h], None, [], 0, None, "CPU", None)


def write(path: Path, *batches: list[Any]) -> Path:
    sink = JsonlEventSink(path)
    for i, events in enumerate(batches):
        sink.publish(EventBatch(float(i), list(events)))
    sink.close()
    return path


def judge(path: Path, router: str, *args: str) -> tuple[int, dict[str, Any], str]:
    """``kvhex events FILE --router ROUTER --json --quiet``: exit status, the summary's
    ``router`` object, stderr."""
    done = kvhex("events", str(path), "--router", router, "--json", "--quiet", *args)
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["type"] == "Summary", done.stdout
    return done.returncode, summary["router"], done.stderr


class Case(NamedTuple):
    """A stream, the router judging it, the flags, the rule found (``None``: nothing
    dropped or miscredited) and its effect, and the exit status."""

    id: str
    router: str
    batches: list[list[Any]]
    flags: list[str]
    rule: str | None
    effect: str | None
    status: int


CASES = [
    Case(
        "dynamo-medium", "dynamo", [[stored(1, medium="SHARED_STORAGE")]], [], "medium", "drops", 1
    ),
    Case("dynamo-medium-ok", "dynamo", [[stored(1, medium="CPU_PINNED")]], [], None, None, 0),
    Case(
        "vllm-router-medium",
        "vllm-router",
        [[stored(1, medium="CPU_PINNED")]],
        [],
        "medium",
        "miscredits",
        1,
    ),
    Case("vllm-router-medium-ok", "vllm-router", [[stored(1, medium="DISK")]], [], None, None, 0),
    Case(
        "dynamo-locality",
        "dynamo",
        [[stored(1, medium="STORAGE", locality="REMOTE")]],
        [],
        "locality",
        "drops",
        1,
    ),
    Case(
        "dynamo-locality-ok",
        "dynamo",
        [[stored(1, medium="STORAGE", locality="LOCAL")]],
        [],
        None,
        None,
        0,
    ),
    Case(
        "vllm-router-locality-ok",
        "vllm-router",
        [[stored(1, medium="STORAGE", locality="REMOTE")]],
        [],
        None,
        None,
        0,
    ),
    Case(
        "dynamo-ownership",
        "dynamo",
        [[stored(1, medium="STORAGE", ownership="files")]],
        [],
        "ownership",
        "drops",
        1,
    ),
    Case(
        "vllm-router-ownership",
        "vllm-router",
        [[stored(1, medium="STORAGE", ownership="files")]],
        [],
        "ownership",
        "miscredits",
        1,
    ),
    Case(
        "vllm-router-lowercase-cpu-ok",
        "vllm-router",
        [[stored(1, medium="cpu")]],
        [],
        None,
        None,
        0,
    ),
    Case("dynamo-lowercase-cpu", "dynamo", [[stored(1, medium="cpu")]], [], "medium", "drops", 1),
    Case("dynamo-hash-form", "dynamo", [[stored(b"\1" * 32)]], [], "hash_form", "drops", 1),
    Case("dynamo-hash-form-ok", "dynamo", [[stored(1)]], [], None, None, 0),
    Case("vllm-router-hash-form-ok", "vllm-router", [[stored(b"\1" * 32)]], [], None, None, 0),
    Case(
        "dynamo-block-size",
        "dynamo",
        [[stored(1, block_size=32)]],
        ["--router-block-size", "16"],
        "block_size",
        "drops",
        1,
    ),
    Case(
        "dynamo-block-size-first",
        "dynamo",
        [[stored(1), stored(2, block_size=32)]],
        [],
        "block_size",
        "drops",
        1,
    ),
    Case(
        "dynamo-block-size-ok",
        "dynamo",
        [[stored(1, block_size=32)]],
        ["--router-block-size", "32"],
        None,
        None,
        0,
    ),
    Case(
        "vllm-router-block-size-default",
        "vllm-router",
        [[stored(1, block_size=32)]],
        [],
        "block_size",
        "drops",
        1,
    ),
    Case("vllm-router-block-size-ok", "vllm-router", [[stored(1)]], [], None, None, 0),
    Case("dynamo-placeholder", "dynamo", [[placeholder(1)]], [], "placeholder", "drops", 1),
    Case(
        "vllm-router-placeholder",
        "vllm-router",
        [[placeholder(1)]],
        [],
        "placeholder",
        "drops",
        1,
    ),
    Case(
        "dynamo-partial",
        "dynamo",
        [[stored([1, 2], tokens=24)]],
        [],
        "partial_block",
        "drops",
        1,
    ),
    Case(
        "vllm-router-partial",
        "vllm-router",
        [[stored([1, 2], tokens=24)]],
        [],
        "partial_block",
        "drops",
        1,
    ),
    Case("both-whole-ok", "dynamo", [[stored([1, 2])], [stored(3, 2)]], [], None, None, 0),
    Case(  # token ids beyond block_size per hash are ignored, not a loss
        "vllm-router-more-tokens-ok",
        "vllm-router",
        [[stored([1, 2], tokens=40)]],
        [],
        None,
        None,
        0,
    ),
    Case("dynamo-group", "dynamo", [[stored_in_group(1, 1)]], [], "group", "drops", 1),
    Case("vllm-router-group", "vllm-router", [[stored_in_group(1, 1)]], [], "group", "drops", 1),
    Case("dynamo-group-ok", "dynamo", [[stored_in_group(1, 0)]], [], None, None, 0),
    Case(
        "dynamo-parent-first",
        "dynamo",
        [[stored(2, 1, medium="GPU")]],
        [],
        "parent_first",
        "drops",
        1,
    ),
    Case(
        "dynamo-parent-first-ok",
        "dynamo",
        [[stored(1, medium="GPU")], [stored(2, 1, medium="GPU")]],
        [],
        None,
        None,
        0,
    ),
    Case(  # its host tree attaches a child when the parent comes: no router finding
        "dynamo-host-child-first",
        "dynamo",
        [[stored(2, 1, medium="CPU")]],
        [],
        None,
        None,
        1,  # the stream itself is inconsistent (a store before its parent)
    ),
    Case(  # its device tree needs the parent there, not on the host
        "dynamo-device-child-of-host",
        "dynamo",
        [[stored(1, medium="CPU")], [stored(2, 1, medium="GPU")]],
        [],
        "parent_first",
        "drops",
        1,
    ),
    Case(
        "vllm-router-parent-first",
        "vllm-router",
        [[stored(2, 1, medium="CPU")]],
        [],
        "parent_first",
        "drops",
        1,
    ),
    Case(  # a parent in any medium
        "vllm-router-parent-first-ok",
        "vllm-router",
        [[stored(1, medium="GPU")], [stored(2, 1, medium="CPU")]],
        [],
        None,
        None,
        0,
    ),
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_each_rule_is_found_in_a_stream_that_triggers_it_and_not_in_one_that_passes(
    tmp_path: Path, case: Case
) -> None:
    path = write(tmp_path / "events.jsonl", *case.batches)
    code, report, err = judge(path, case.router, *case.flags)
    assert code == case.status, (report, err)
    mismatches = [row for row in report["findings"] if row["effect"] != "credits"]
    rule, effect = case.rule, case.effect
    if rule is None:
        assert mismatches == []
        assert report["verdict"] == "reads all"
        assert report["mismatched_events"] == 0
        return
    assert [(row["rule"], row["effect"], row["count"]) for row in mismatches] == [(rule, effect, 1)]
    assert report["verdict"] == "mismatch"
    assert report["mismatched_events"] == 1
    (row,) = mismatches
    assert row["line"].startswith(f"{report['router']} {report['version']} {effect} ")
    assert "; fix: " in row["line"]


def test_findings_are_one_line_each_with_their_counts(tmp_path: Path) -> None:
    path = write(
        tmp_path / "events.jsonl",
        [stored(1), stored(2, 1, medium="SHARED_STORAGE"), stored(3, 1, medium="SHARED_STORAGE")],
        [stored(4, 1, medium="STORAGE", locality="REMOTE"), placeholder(9)],
        [BlockRemoved([2, 3], "SHARED_STORAGE"), BlockRemoved([1], "CPU"), AllBlocksCleared()],
    )
    done = kvhex("events", str(path), "--router", "dynamo", "--router-block-size", "16", "-q")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    section = lines[lines.index("-- dynamo 1.6.1 (block size 16, --router-block-size)") :]
    assert section[1:] == [
        " events  what the router does",
        "      3  dynamo 1.6.1 drops events with medium 'SHARED_STORAGE': it reads only the "
        "media CPU, CPU_PINNED, DISK, EXTERNAL, GPU, STORAGE (or none); fix: set the "
        "publishing tier's medium ([[tiers]] options.medium; vLLM: "
        "secondary_tiers[i].kvhex.medium) to 'STORAGE'",
        "      1  dynamo 1.6.1 drops events with locality 'REMOTE': it reads only the locality "
        "LOCAL or none; fix: set the publishing tier's locality ([[tiers]] options.locality; "
        "vLLM: secondary_tiers[i].locality) to 'LOCAL' (only if every instance the router "
        "sends to can load from the tier)",
        "      1  dynamo 1.6.1 drops stores with token_ids [] (placeholders, block_size 0): it "
        "hashes each block's token_ids itself; fix: none in kvhex: a placeholder is a block "
        "kvhex cannot describe (no provenance, a sliding-window or Mamba group, a "
        "token-mutating request; docs/events.md)",
        "      2  dynamo 1.6.1 credits events with medium 'CPU' at 0.75 "
        "(DYN_ROUTER_HOST_CACHE_HIT_WEIGHT)",
        "ROUTER MISMATCH: dynamo 1.6.1 would drop or miscredit 5 of 8 events",
    ]
    assert "consistent" in lines  # the stream itself adds up: the router is what fails


@pytest.mark.parametrize("router", ["dynamo", "vllm-router"])
def test_kvhexs_own_stream_with_int_hashes_is_read_whole_by_both(
    tmp_path: Path, router: str
) -> None:
    path = tmp_path / "events.jsonl"
    jsonl = JsonlEventSink(path)
    for _ in serve([jsonl], int_hashes=True):
        pass
    jsonl.close()
    code, report, err = judge(path, router, "--router-block-size", "4")
    assert code == 0, (report, err)
    assert report["verdict"] == "reads all"
    assert report["events"] > 0
    credited = {row["value"] for row in report["findings"]}
    assert credited == {"'CPU'", "'STORAGE'"}  # the host tier's and the file-like tier's


def test_kvhexs_own_stream_with_bytes_hashes_is_dropped_by_dynamo_only(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    jsonl = JsonlEventSink(path)
    for _ in serve([jsonl], int_hashes=False):
        pass
    jsonl.close()
    code, report, _ = judge(path, "dynamo", "--router-block-size", "4")
    assert code == 1
    assert [row["rule"] for row in report["findings"]] == ["hash_form"]
    assert report["mismatched_events"] == report["events"]
    assert judge(path, "vllm-router", "--router-block-size", "4")[0] == 0


def watch_live(router: str, topic: str, batches: int) -> tuple[int, dict[str, Any]]:
    """``kvhex events --bind --router ROUTER`` fed by a ZMQ sink that connects and publishes
    under ``topic`` until the command has taken ``batches`` stores."""
    watcher = spawn(
        "events",
        "tcp://127.0.0.1:*",
        "--bind",
        "--router",
        router,
        "--count",
        str(batches),
        "--json",
        "--duration",
        "60",
    )
    out, err = Lines(watcher.stdout), Lines(watcher.stderr)
    try:
        (line,) = err.wait_for(lambda lines: any("listening on" in x for x in lines))
        sink = ZmqEventSink(line.rsplit(" ", 1)[-1], connect=True, topic=topic)
        try:
            # a connecting PUB drops what it sends before the subscription arrives: send until
            # the command has what it waits for (distinct roots: no parent to miss)
            seq = 0
            while watcher.poll() is None:
                sink.publish(EventBatch(float(seq), [stored(seq + 1)]))
                seq += 1
                time.sleep(0.05)
            watcher.wait(timeout=30)
        finally:
            sink.close()
    finally:
        watcher.kill()
    records = [json.loads(x) for x in out.text().splitlines()]
    assert records[-1]["type"] == "Summary", err.text()
    return watcher.returncode or 0, records[-1]["router"]


def test_a_live_topic_drops_every_event_for_vllm_router() -> None:
    code, report = watch_live("vllm-router", "kv", 3)
    assert code == 1
    assert report["topics"] == {"kv": 3}
    (row,) = [row for row in report["findings"] if row["effect"] != "credits"]
    assert row["rule"] == "topic"
    assert row["count"] == 3
    assert row["line"] == (
        "vllm-router 0.1.17 drops every event with ZMQ topic 'kv': it reads only the empty "
        "topic (0.1.17 has no topic setting); fix: set the publisher's topic (vLLM: "
        'kv_events_config.topic; kvhex: [[sinks]] options.topic) to ""'
    )


@pytest.mark.parametrize(("router", "topic"), [("vllm-router", ""), ("dynamo", "kv")])
def test_a_live_stream_a_router_reads_whole_passes(router: str, topic: str) -> None:
    code, report = watch_live(router, topic, 3)
    assert code == 0, report
    assert report["topics"] == {topic: 3}
    assert report["verdict"] == "reads all"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--router-block-size", "16"], "--router-block-size: applies to --router"),
        (["--router", "llm-d"], "--router"),
        (["--router", "dynamo", "--router-block-size", "0"], "--router-block-size"),
    ],
)
def test_bad_router_flags_exit_2_naming_the_flag(
    tmp_path: Path, args: list[str], says: str
) -> None:
    path = write(tmp_path / "events.jsonl", [stored(1)])
    done = kvhex("events", str(path), *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr


def test_without_router_nothing_changes(tmp_path: Path) -> None:
    path = write(tmp_path / "events.jsonl", [stored(1, medium="SHARED_STORAGE")])
    done = kvhex("events", str(path), "--json", "--quiet")
    assert done.returncode == 0
    assert "router" not in json.loads(done.stdout.splitlines()[-1])
