"""``kvhex run`` publishing to a real KV-aware router's index: Dynamo's standalone KV indexer
(tests/dynamo.py) subscribed to the run's ZMQ events on loopback credits, at the end, every
prompt as the run's tiers really hold it (host memory as cpu, the file tier as disk).

What the tiers hold at the end comes from the tiers where it can: the file tier's own slot
tables, read from its directory (kvhex's fsck finds it clean); host memory is gone with the
process, so its blocks come from the run's JSONL event file, checked against the host tier's
resident-chunk gauge and, for the file tier, against its real contents.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

from kvhex.adapters.events.jsonl import read_batches
from kvhex.adapters.events.wire import BlockRemoved, BlockStored
from kvhex.adapters.storage.files._index import SLAB_DIR, read_table
from kvhex.adapters.storage.files.fsck import check_root
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.keys import make_offload_key
from kvhex.sim.workload import Request, context
from tests.cli.command import Lines, spawn
from tests.dynamo import Chains, Credit, DynamoIndexer, expected_credit, free_port

BLOCK = 16
PER_CHUNK = 4
CHUNK_TOKENS = BLOCK * PER_CHUNK
CHUNK_BYTES = 2 * 4096 * PER_CHUNK  # 2 layers of 4 KiB pages
HOST_CHUNKS = 4
FILE_CHUNKS = 8
GEOMETRY = KvGeometry((KvGroup(0, BLOCK, PER_CHUNK),), BLOCK)

CONFIG = f"""
[primary]
capacity_bytes = {HOST_CHUNKS * CHUNK_BYTES}

[run]
layers = 2
page_bytes = 4096
tokens_per_block = {BLOCK}
blocks_per_chunk = {PER_CHUNK}
device_blocks = 64
"""


def tokens(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


LEAD_IN = [tokens(100_000 + 100 * i, CHUNK_TOKENS) for i in range(600)]
"""One-chunk prompts first, which keep the run publishing for a while after its PUB socket is
bound: the indexer, registered then, connects within milliseconds and asks the replay socket
for what it missed when the next batch arrives (it asks only then)."""
SHARED = tokens(1000, 2 * CHUNK_TOKENS)
PROMPTS = [
    [*SHARED, *tokens(2000, CHUNK_TOKENS + 5)],
    tokens(3000, 3 * CHUNK_TOKENS),
    [*SHARED, *tokens(4000, CHUNK_TOKENS)],
    tokens(5000, 2 * CHUNK_TOKENS),
    tokens(6000, 3 * CHUNK_TOKENS),
    [*SHARED, *tokens(7000, CHUNK_TOKENS + 11)],
    tokens(8000, CHUNK_TOKENS),
]
WORKLOAD = [*LEAD_IN, *PROMPTS]


def file_tier_keys(root: Path) -> set[bytes]:
    """The chunk keys the file tier under ``root`` holds, from its slot tables (what a restart
    adopts), once kvhex's fsck found every block intact."""
    report = check_root(root)
    assert report.clean, report
    (namespace,) = report.namespaces
    keys: set[bytes] = set()
    for slab in sorted((Path(namespace.path) / SLAB_DIR).glob("*.slab")):
        fd = os.open(slab, os.O_RDONLY)
        try:
            _, records = read_table(fd)
        finally:
            os.close(fd)
        keys.update(bytes(key) for _, key, _ in records)
    assert len(keys) == namespace.blocks_ok
    return keys


def int64(block_hash: bytes | int) -> int:
    """A hash as vLLM's publisher sends it by default: the low 64 bits of its big-endian value
    (the form Dynamo decodes; a stream of raw bytes compares the same way)."""
    if isinstance(block_hash, int):
        return block_hash
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def replayed(events_file: Path) -> dict[str, set[int]]:
    """The block hashes each medium holds at the end of the run's JSONL event stream."""
    held: dict[str, set[int]] = {}
    for _, _, batch in read_batches(events_file):
        assert not isinstance(batch, str), batch
        for event in batch.events:
            if isinstance(event, BlockStored | BlockRemoved):
                hashes = {int64(h) for h in event.block_hashes}
                medium = held.setdefault(str(event.medium), set())
                if isinstance(event, BlockStored):
                    medium |= hashes
                else:
                    medium -= hashes
    return held


def host_resident_chunks(metrics_url: str) -> int:
    """The run's ``kvhex_tier_resident_blocks`` gauge of host memory (chunks)."""
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with no_proxy.open(metrics_url, timeout=10) as response:
        text = response.read().decode()
    (value,) = re.findall(
        r'^kvhex_tier_resident_blocks\{[^}]*tier="host"[^}]*\} (\S+)$', text, re.M
    )
    return int(float(value))


def test_the_indexer_credits_what_the_runs_tiers_hold_at_the_end(
    dynamo_indexer: DynamoIndexer, tmp_path: Path
) -> None:
    indexer = dynamo_indexer
    config = tmp_path / "kvhex.toml"
    config.write_text(CONFIG)
    workload = tmp_path / "workload.jsonl"
    workload.write_text("".join(json.dumps({"tokens": p}) + "\n" for p in WORKLOAD))
    root, events = tmp_path / "tier", tmp_path / "events.jsonl"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    run = spawn(
        "run",
        "--config",
        str(config),
        "--workload",
        str(workload),
        "--requests",
        str(len(WORKLOAD)),  # all of it ([run].requests defaults to 240)
        "--tier",
        str(root),
        "--tier-capacity",
        str(FILE_CHUNKS * CHUNK_BYTES),
        "--events",
        endpoint,
        "--events-replay",
        replay,
        "--events",
        str(events),
        "--metrics-addr",
        "127.0.0.1:0",
        "--metrics-hold",
        "600",  # the publisher and its replay socket stay up until the test ends the run
        "--json",
        "--no-progress",
    )
    out, err = Lines(run.stdout), Lines(run.stderr)
    try:
        # the metrics line comes once the engine is built, its PUB socket bound
        started = err.wait_for(lambda ls: any("metrics at" in line for line in ls))
        (url,) = re.findall(r"metrics at (\S+)", "\n".join(started))
        indexer.register(1, endpoint, replay, BLOCK)
        lines = out.wait_for(lambda ls: "}" in ls)  # the summary: the run holds from here
        summary = json.loads("\n".join(lines))
        assert summary["requests"] == len(WORKLOAD), summary

        chains = Chains(BLOCK)
        blocks_of: dict[bytes, list[int]] = {}
        for i, prompt in enumerate(WORKLOAD):
            ctx = context(Request(f"req-{i + 1}", tuple(prompt)), GEOMETRY)
            assert ctx.provenance is not None
            raw = list(ctx.provenance.block_hashes)
            hashes = [int64(h) for h in raw]
            chains.add(prompt, hashes)
            for c in range(len(hashes) // PER_CHUNK):
                key = bytes(make_offload_key(raw[(c + 1) * PER_CHUNK - 1], 0))
                blocks_of[key] = hashes[c * PER_CHUNK : (c + 1) * PER_CHUNK]
        in_files = file_tier_keys(root)
        disk_blocks = {h for key in in_files for h in blocks_of[key]}
        stream = replayed(events)
        assert stream.get("STORAGE", set()) == disk_blocks  # the stream matches the files
        host_blocks = stream.get("CPU", set())
        assert len(host_blocks) == host_resident_chunks(url) * PER_CHUNK
        cpu, disk = chains.held(host_blocks), chains.held(disk_blocks)
        want = {i: expected_credit(p, BLOCK, cpu=cpu, disk=disk) for i, p in enumerate(WORKLOAD)}
        last = {i - len(LEAD_IN): want[i] for i in range(len(LEAD_IN), len(WORKLOAD))}
        assert any(c.cpu >= len(SHARED) for c in last.values()), last
        assert any(c.disk > c.cpu for c in last.values()), last  # the file tier adds
        assert Credit(0, 0, 0) in last.values(), last  # evicted from both tiers

        def observe() -> dict[int, Credit]:
            return {i: indexer.credit(p) for i, p in enumerate(WORKLOAD)}

        got = indexer.settle(observe, want)
        wrong = {i: (got[i], want[i]) for i in want if got[i] != want[i]}
        assert not wrong, f"(indexer, expected) of {len(wrong)} prompts: {wrong}" + (
            indexer.context()
        )
        run.send_signal(signal.SIGTERM)  # as a service manager stops it: tiers closed
        assert run.wait(timeout=60) == 128 + signal.SIGTERM, err.text()
        assert file_tier_keys(root) == in_files  # what was read during the hold was final
    finally:
        if run.poll() is None:  # a failed check: end it as cleanly, its scratch removed
            run.send_signal(signal.SIGTERM)
            try:
                run.wait(timeout=30)
            except subprocess.TimeoutExpired:
                run.kill()
                run.wait(timeout=30)
