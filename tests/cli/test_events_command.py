"""``kvhex events`` against a real ZmqEventSink on loopback: the engine's real batches decoded,
printed and found consistent, through a replay and live; inconsistent streams reported with a
non-zero exit; bad flags and endpoints."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvhex.adapters.events.jsonl import JsonlEventSink
from kvhex.adapters.events.wire import encode_batch
from kvhex.adapters.events.zmq import ZmqEventSink
from kvhex.adapters.memory import MemoryEventSink
from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from tests.cli.command import Lines, kvhex, spawn
from tests.cli.workload import CHUNKS, REQUESTS, serve


def published(memory: MemoryEventSink) -> list[object]:
    return [e for b in memory.batches for e in b.events]


@pytest.fixture
def sink() -> object:
    sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    yield sink
    sink.close()


def sent(sink: ZmqEventSink, batches: int) -> None:
    """Wait until the sink's thread has published ``batches`` batches (replayable)."""
    deadline = time.monotonic() + 10
    while sink.batches_sent < batches:  # what went out on the wire (and is replayable)
        assert time.monotonic() < deadline, "the sink did not publish"
        time.sleep(0.01)


def test_the_engines_batches_replayed_are_printed_and_consistent(sink: ZmqEventSink) -> None:
    memory = MemoryEventSink()
    *_, tier = serve([sink, memory])
    events = published(memory)
    sent(sink, len(memory.batches))
    done = kvhex(
        "events",
        sink.endpoint,
        "--replay",
        str(sink.replay_endpoint),
        "--count",
        str(len(events)),
        "--duration",
        "30",
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    shown = [line for line in lines if "(replayed)" in line]
    assert len(shown) == len(events)
    for line, event in zip(shown, events, strict=True):
        assert type(event).__name__ in line
        if isinstance(event, BlockStored):
            assert f"first={event.block_hashes[0].hex()[:16]}" in line
            assert f"block_size={event.block_size}" in line
            assert f"tokens={len(event.token_ids)}" in line
    summary = "\n".join(lines[lines.index("--") :])
    locality = tier.identity.locality
    storage = f"STORAGE({locality.value if locality else '-'},-)"  # no ownership announced
    held = REQUESTS * CHUNKS * 2  # the secondary tier keeps every chunk; reset empties CPU
    assert f"blocks held at the end: CPU 0, {storage} {held}" in summary
    assert "sequence gaps: none" in summary
    assert "removals of hashes not stored: none" in summary
    assert summary.endswith("consistent")


def test_a_live_stream_is_followed_and_gaps_are_filled_from_the_replay(
    sink: ZmqEventSink,
) -> None:
    memory = MemoryEventSink()
    steps = serve([sink, memory])
    next(steps)  # published before the command subscribes: only the replay has it
    sent(sink, 1)
    total = 14  # what the workload publishes (checked below)
    watcher = spawn(
        "events",
        sink.endpoint,
        "--replay",
        str(sink.replay_endpoint),
        "--count",
        str(total),
        "--json",
        "--duration",
        "60",
    )
    out, err = Lines(watcher.stdout), Lines(watcher.stderr)
    try:
        # its first line is the replayed step 0: it has subscribed and the replay answered,
        # so what follows is seen live (a batch still missed live is a gap, fetched again)
        out.wait_for(lambda lines: len(lines) >= 1)
        for _ in steps:
            time.sleep(0.05)  # paced: the subscriber sees them live
        watcher.wait(timeout=60)
    finally:
        watcher.kill()
    assert len(published(memory)) == total
    assert watcher.returncode == 0, out.text() + err.text()
    records = [json.loads(line) for line in out.text().splitlines()]
    events, summary = records[:-1], records[-1]
    assert len(events) == total
    seqs = [e["seq"] for e in events]
    assert seqs == sorted(seqs)
    assert seqs[0] == 0
    assert events[0]["replayed"] is True
    assert events[-1]["replayed"] is False
    assert [e["type"] for e in events] == [type(e).__name__ for e in published(memory)]
    first = published(memory)[0]
    assert isinstance(first, BlockStored)
    assert events[0]["block_hashes"] == [h.hex() for h in first.block_hashes]
    assert events[0]["token_ids"] == first.token_ids
    assert summary["type"] == "Summary"
    assert summary["consistent"] is True
    assert summary["gaps"] == []
    assert summary["batches"] == len(memory.batches)


class Publisher:
    """A hand-driven publisher with vLLM's framing, where what goes out live and what the
    replay socket holds are chosen separately (a message lost on the way, a bad payload)."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []  # start sequences asked for
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def send(self, seq: int, payload: bytes, *, live: bool = True) -> None:
        with self._lock:
            self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(20):
                continue
            client, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                self.requests.append(first)
                held = [(s, p) for s, p in self.buffer if s >= first]
            for seq, payload in held:
                self.router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), payload))
            self.router.send_multipart(
                (client, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    publisher = Publisher()
    yield publisher
    publisher.close()


def wire(*events: object, ts: float = 1.0) -> bytes:
    return encode_batch(EventBatch(ts, list(events)))


def test_a_batch_lost_on_the_live_stream_is_fetched_from_the_replay(
    publisher: Publisher,
) -> None:
    stored = BlockStored([b"\1" * 32], None, [1, 2, 3, 4], 4, None, "CPU", None)
    watcher = spawn(
        "events",
        publisher.endpoint,
        "--replay",
        publisher.replay_endpoint,
        "--count",
        "3",
        "--json",
        "--duration",
        "60",
    )
    try:
        deadline = time.monotonic() + 30
        while not publisher.requests:  # its first replay: it has subscribed by now
            assert time.monotonic() < deadline, "the command never asked for a replay"
            time.sleep(0.01)
        time.sleep(0.3)
        publisher.send(0, wire(stored))
        publisher.send(1, wire(BlockRemoved([b"\1" * 32], "CPU")), live=False)  # lost
        publisher.send(2, wire(stored))
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, out + err
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["seq"], r["type"]) for r in records[:-1]] == [
        (0, "BlockStored"),
        (1, "BlockRemoved"),
        (2, "BlockStored"),
    ]
    assert records[1]["replayed"] is True
    assert records[2]["replayed"] is False
    assert len(publisher.requests) >= 2  # the initial replay, then the one for the gap
    assert publisher.requests[-1] <= 1
    assert records[-1]["consistent"] is True
    assert records[-1]["blocks"] == {"CPU": 1}


def test_an_undecodable_batch_is_shown_and_inconsistent(publisher: Publisher) -> None:
    publisher.send(0, wire(AllBlocksCleared()))
    publisher.send(1, b"not msgpack at all")
    publisher.send(2, wire(AllBlocksCleared()))
    done = kvhex(
        "events",
        publisher.endpoint,
        "--replay",
        publisher.replay_endpoint,
        "--count",
        "2",
        "--duration",
        "30",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "     1 undecodable batch:" in done.stdout
    assert "undecodable batches: 1" in done.stdout
    assert "sequence gaps: none" in done.stdout


def test_a_removal_of_an_unknown_hash_is_inconsistent(sink: ZmqEventSink) -> None:
    stored = BlockStored([b"\1" * 32, b"\2" * 32], None, list(range(8)), 4, None, "CPU", None)
    sink.publish(EventBatch(1.0, [stored]))
    sink.publish(EventBatch(2.0, [BlockRemoved([b"\2" * 32, b"\x09" * 32], "CPU")]))
    sink.publish(EventBatch(3.0, [stored, stored, AllBlocksCleared()]))
    sent(sink, 3)
    done = kvhex(
        "events",
        sink.endpoint,
        "--replay",
        str(sink.replay_endpoint),
        "--count",
        "5",
        "--duration",
        "30",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "removals of hashes not stored: CPU 1" in done.stdout
    assert "duplicate stores without removal: CPU 3" in done.stdout  # \1 again, then twice
    assert "AllBlocksCleared: 1" in done.stdout
    assert "blocks held at the end: none" in done.stdout
    assert "INCONSISTENT: 1 removal(s) of hashes not stored" in done.stdout


def test_batches_older_than_the_replay_buffer_come_back_as_a_snapshot() -> None:
    a, b, c = (bytes([n]) * 32 for n in (1, 2, 3))

    def stored(h: bytes, parent: bytes | None) -> BlockStored:
        return BlockStored([h], parent, [1, 2, 3, 4], 4, None, "CPU", None)

    sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
    steps = [
        [stored(a, None)],
        [stored(b, a)],
        [BlockRemoved([b], "CPU")],
        [stored(c, a)],
        [BlockRemoved([a], "CPU")],
    ]
    try:
        for i, events in enumerate(steps):
            sink.publish(EventBatch(float(i), list(events)))
        sent(sink, len(steps))
        done = kvhex(
            "events",
            sink.endpoint,
            "--replay",
            str(sink.replay_endpoint),
            "--count",
            "4",  # the snapshot's clear and its one store (a), then c, then a's removal
            "--duration",
            "30",
            "--json",
        )
    finally:
        sink.close()
    assert done.returncode == 0, done.stdout + done.stderr
    *events, summary = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["seq"], e["type"]) for e in events] == [
        (2, "AllBlocksCleared"),
        (2, "BlockStored"),
        (3, "BlockStored"),
        (4, "BlockRemoved"),
    ]
    assert summary["gaps"] == []
    assert summary["cleared_gaps"] == [[0, 1]]
    assert summary["blocks"] == {"CPU": 1}  # c: what the whole stream holds
    assert summary["consistent"] is True


def test_a_silent_replay_socket_is_reported(sink: ZmqEventSink) -> None:
    done = kvhex(
        "events",
        sink.endpoint,
        "--replay",
        "tcp://127.0.0.1:9",
        "--replay-timeout",
        "0.3",
        "--duration",
        "0.5",
    )
    assert done.returncode == 1
    assert "did not answer" in done.stdout


def test_a_publisher_that_sent_nothing_exits_3_saying_so(sink: ZmqEventSink) -> None:
    done = kvhex("events", sink.endpoint, "--duration", "0.5", "--quiet")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "batches 0; events: none" in done.stdout
    assert done.stdout.splitlines()[-1] == "NOTHING RECEIVED: no verdict"
    assert f"a publisher was connected to {sink.endpoint} but sent nothing within 0.5 s" in (
        done.stderr
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_no_publisher_within_the_duration_exits_3_saying_so() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    done = kvhex("events", endpoint, "--duration", "0.3")
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"no publisher at {endpoint} within 0.3 s" in done.stderr
    assert "kvhex run --events binds" in done.stderr
    assert "Traceback" not in done.stderr


def test_bind_waits_for_a_publisher_that_connects() -> None:
    watcher = spawn("events", "tcp://127.0.0.1:*", "--bind", "--count", "2", "--json")
    out, err = Lines(watcher.stdout), Lines(watcher.stderr)
    try:
        (line,) = err.wait_for(lambda lines: any("listening on" in x for x in lines))
        endpoint = line.rsplit(" ", 1)[-1]
        sink = ZmqEventSink(endpoint, connect=True)
        try:
            assert sink.endpoint == endpoint
            # a connecting PUB drops what it sends before the subscription arrives: send
            # until the command has printed what it was waiting for
            seq = 0
            while len(out.lines) < 2 and watcher.poll() is None:
                sink.publish(EventBatch(float(seq), [AllBlocksCleared()]))
                seq += 1
                time.sleep(0.05)
            watcher.wait(timeout=30)
        finally:
            sink.close()
    finally:
        watcher.kill()
    assert watcher.returncode in (0, 1), out.text() + err.text()  # joined late: a gap is fine
    records = [json.loads(x) for x in out.text().splitlines()]
    assert [r["type"] for r in records] == ["AllBlocksCleared", "AllBlocksCleared", "Summary"]
    assert records[0]["data_parallel_rank"] == 0


def test_a_jsonl_file_gets_the_same_ledger_and_verdict(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    memory = MemoryEventSink()
    jsonl = JsonlEventSink(path)
    *_, tier = serve([jsonl, memory])
    jsonl.close()
    done = kvhex("events", str(path), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    events, summary = records[:-1], records[-1]
    assert [e["type"] for e in events] == [type(e).__name__ for e in published(memory)]
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert events[0]["seq"] == 0
    stored = next(e for e in published(memory) if isinstance(e, BlockStored))
    assert events[0]["block_hashes"] == [h.hex() for h in stored.block_hashes]
    assert events[0]["token_ids"] == stored.token_ids
    assert summary["consistent"] is True
    assert summary["batches"] == len(memory.batches)
    locality = tier.identity.locality
    storage = f"STORAGE({locality.value if locality else '-'},-)"  # no ownership announced
    assert summary["blocks"] == {"CPU": 0, storage: REQUESTS * CHUNKS * 2}


def test_a_jsonl_file_with_a_missing_batch_and_a_bad_line_is_inconsistent(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    jsonl = JsonlEventSink(path)
    for i in range(4):  # a placeholder store each (not a clear: a gap before one loses nothing)
        placeholder = BlockStored([bytes([i]) * 32], None, [], 0, None, "CPU", None)
        jsonl.publish(EventBatch(float(i), [placeholder]))
    jsonl.close()
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[2], "{not json", lines[3]]) + "\n")
    done = kvhex("events", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "sequence gaps: missing 1" in done.stdout
    assert "line 3: " in done.stdout
    assert "undecodable batches: 1" in done.stdout
    assert "INCONSISTENT" in done.stdout


def test_an_empty_jsonl_file_exits_3(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("")
    done = kvhex("events", str(path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert f"FILE {path} holds no batch" in done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["events"], "ENDPOINT"),
        (["events", "tcp://127.0.0.1:1", "--count", "0"], "--count"),
        (["events", "tcp://127.0.0.1:1", "--duration", "soon"], "--duration"),
        (["events", "tcp://127.0.0.1:1", "--from-seq", "-1"], "--from-seq"),
        (["events", "tcp://127.0.0.1:1", "--bogus"], "--bogus"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = kvhex(*args)
    assert done.returncode == 2
    assert named in done.stderr


def test_an_unusable_endpoint_exits_2_naming_it() -> None:
    done = kvhex("events", "nonsense", "--duration", "0.1")
    assert done.returncode == 2
    assert "ENDPOINT nonsense: neither a ZMQ endpoint" in done.stderr
    assert "no such file" in done.stderr
