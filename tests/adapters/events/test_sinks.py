"""Event sinks, each for real: ZMQ over loopback TCP with a plain pyzmq subscriber and a
replay request, a JSONL file read back, structlog output, memory; and the pipeline."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import pytest
import structlog
import zmq

from kvhex.adapters.events.jsonl import JsonlEventSink, read_batches
from kvhex.adapters.events.log import StructlogEventSink
from kvhex.adapters.events.wire import decode_batch
from kvhex.adapters.events.zmq import ZmqEventSink, offset_endpoint
from kvhex.adapters.memory import MemoryEventSink
from kvhex.domain import Medium, TierIdentity
from kvhex.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Removed
from kvhex.errors import ConfigError
from kvhex.service import EventPipeline


def batch(i: int, rank: int | None = None) -> EventBatch:
    stored = BlockStored([bytes([i]) * 32], None, [i, i + 1], 2, None, "CPU", None, group_idx=0)
    return EventBatch(1000.0 + i, [stored, BlockRemoved([bytes([i]) * 32], "CPU", 0)], rank)


def recv(sub: zmq.Socket[bytes], timeout_ms: int = 5000) -> list[bytes]:
    assert sub.poll(timeout_ms), "nothing received"
    return sub.recv_multipart()


def test_zmq_subscriber_receives_vllm_framed_batches_and_replays_missed_ones() -> None:
    sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_steps=8)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(sink.endpoint)
    try:
        # PUB drops messages until the subscription propagates: publish until one arrives
        deadline = time.monotonic() + 10
        first = None
        i = 0
        while first is None and time.monotonic() < deadline:
            sink.publish(batch(i))
            i += 1
            if sub.poll(50):
                first = sub.recv_multipart()
        assert first is not None
        topic, seq, payload = first
        assert topic == b"kv"
        assert len(seq) == 8
        decoded = decode_batch(payload)
        assert decoded.data_parallel_rank == 0
        assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockRemoved"]
        sink.publish(batch(50))
        _, seq2, payload2 = recv(sub)
        assert int.from_bytes(seq2, "big") > int.from_bytes(seq, "big")
        assert decode_batch(payload2).ts == 1050.0

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(sink.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            frames = recv(dealer)
            assert frames[0] == b""
            if frames[2] == (-1).to_bytes(8, "big", signed=True):
                assert frames[1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
                break
            replayed.append(int.from_bytes(frames[2], "big"))
        assert replayed == sorted(replayed)
        assert replayed[-1] == int.from_bytes(seq2, "big")
        assert len(replayed) <= 8  # the ring keeps buffer_steps batches
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        sink.close()
    sink.close()
    with pytest.raises(RuntimeError, match="closed"):
        sink.publish(batch(1))


def test_zmq_ports_are_offset_by_data_parallel_rank() -> None:
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("tcp://*:0", 2) == "tcp://*:0"
    assert offset_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    with pytest.raises(ValueError, match="tcp:// or inproc://"):
        offset_endpoint("udp://x:1", 1)
    sink = ZmqEventSink("inproc://kvhex-test", data_parallel_rank=3)
    try:
        assert sink.endpoint == "inproc://kvhex-test_dp3"
    finally:
        sink.close()


def test_jsonl_sink_writes_one_owner_only_line_per_batch(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlEventSink(path, data_parallel_rank=3)
    sink.publish(batch(1, rank=2))
    sink.publish(EventBatch(5.0, [AllBlocksCleared()]))
    sink.close()
    sink.close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["seq"] for line in lines] == [0, 1]
    assert lines[0]["data_parallel_rank"] == 2
    assert lines[1]["data_parallel_rank"] == 3  # the sink's own, as on ZMQ
    assert lines[0]["events"][0]["type"] == "BlockStored"
    assert lines[0]["events"][0]["block_hashes"] == ["01" * 32]
    assert lines[1]["events"] == [{"type": "AllBlocksCleared"}]
    with pytest.raises(RuntimeError, match="closed"):
        sink.publish(batch(2))


def test_jsonl_sink_replaces_the_file_unless_told_to_append(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"old": "line"}\n' * 5)
    first = JsonlEventSink(path)
    first.publish(batch(1))
    first.close()
    assert [json.loads(line)["seq"] for line in path.read_text().splitlines()] == [0]
    second = JsonlEventSink(path, append=True)
    second.publish(batch(2))
    second.publish(batch(3))
    second.close()
    # each writer numbers from 0: a reader of an appended file sees where each began
    assert [json.loads(line)["seq"] for line in path.read_text().splitlines()] == [0, 0, 1]


def test_jsonl_and_zmq_stamp_the_same_data_parallel_rank(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    jsonl = JsonlEventSink(path, data_parallel_rank=2)
    zmq_sink = ZmqEventSink("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", data_parallel_rank=2)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for sink in (jsonl, zmq_sink):
            sink.publish(batch(1))  # no rank: the sink's
            sink.publish(batch(2, rank=0))  # its own, kept
        jsonl.close()
        dealer.connect(str(zmq_sink.replay_endpoint))
        deadline = time.monotonic() + 10
        wired: list[int | None] = []
        while len(wired) < 2:
            assert time.monotonic() < deadline, "the replay never held both batches"
            wired = []
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                frames = recv(dealer)
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                wired.append(decode_batch(frames[3]).data_parallel_rank)
    finally:
        dealer.close(linger=0)
        zmq_sink.close()
    written = [json.loads(line)["data_parallel_rank"] for line in path.read_text().splitlines()]
    assert written == wired == [2, 0]
    read = [b.data_parallel_rank for _, _, b in read_batches(path) if not isinstance(b, str)]
    assert read == [2, 0]


def test_jsonl_lines_read_back_as_wire_batches(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    sink = JsonlEventSink(path)
    sink.publish(batch(7, rank=1))
    sink.close()
    with path.open("a") as more:
        more.write("\n{broken\n")
    (number, seq, first), (bad_number, bad_seq, bad) = read_batches(path)
    assert (number, seq) == (1, 0)
    assert not isinstance(first, str)
    assert first.ts == 1007.0
    stored, removed = first.events
    assert stored.block_hashes == [bytes([7]) * 32]  # hex back to bytes
    assert stored.token_ids == [7, 8]
    assert removed.block_hashes == [bytes([7]) * 32]
    assert (bad_number, bad_seq) == (3, 1)
    assert isinstance(bad, str)


def test_jsonl_sink_refuses_an_unwritable_path(tmp_path: Path) -> None:
    missing = tmp_path / "missing-dir" / "events.jsonl"
    with pytest.raises(ConfigError, match="cannot write it: No such file") as caught:
        JsonlEventSink(missing)
    assert str(missing) in str(caught.value)


def test_log_sink_summarizes_without_token_ids() -> None:
    sink = StructlogEventSink()
    quiet = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            sink.publish(batch(3))
    finally:
        structlog.configure(wrapper_class=quiet)
    (entry,) = logs
    assert entry["event"] == "kv_events_published"
    assert entry["BlockStored:CPU"] == 1
    assert entry["BlockRemoved:CPU"] == 1
    assert "token_ids" not in entry


class BrokenSink(MemoryEventSink):
    def publish(self, batch: EventBatch) -> None:
        raise OSError("network down")


def test_pipeline_isolates_a_failing_sink_and_publishes_one_batch_per_step() -> None:
    good, bad = MemoryEventSink(), BrokenSink()
    pipeline = EventPipeline(sinks=[bad, good], clock=lambda: 42.0, data_parallel_rank=1)
    tier = TierIdentity(Medium.CPU)
    out = pipeline.process([Removed((b"k" * 36,), tier)])
    assert len(out) == 1
    assert pipeline.process([]) == []
    assert [(b.ts, b.data_parallel_rank, len(b.events)) for b in good.batches] == [(42.0, 1, 1)]
    assert (pipeline.batches_published, pipeline.publish_failures) == (1, 1)
    pipeline.close()
    assert good.closed
