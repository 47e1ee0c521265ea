"""``kvhex events`` reads vLLM 0.33's own ZMQ publisher: its framing, its replay socket and its
batches, decoded with kvhex's wire structs."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM 0.33 (make test runs this in .venv-vllm)")

from vllm.distributed import kv_events as vev

from tests.vllm.engine import free_port


def test_vllms_publisher_is_replayed_decoded_and_checked() -> None:
    pub, replay = free_port(), free_port()
    publisher = vev.ZmqEventPublisher(
        0, endpoint=f"tcp://*:{pub}", replay_endpoint=f"tcp://*:{replay}"
    )
    try:
        gpu = vev.BlockStored(
            block_hashes=[11, 12],  # vLLM's int hashes
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name="adapter-a",
        )
        root = vev.BlockStored(
            block_hashes=[b"\x0b" * 32],
            parent_block_hash=None,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        cpu = vev.BlockStored(
            block_hashes=[b"\x0c" * 32],
            parent_block_hash=b"\x0b" * 32,
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )
        publisher.publish(vev.KVEventBatch(ts=time.time(), events=[gpu, root, cpu]))
        publisher.publish(
            vev.KVEventBatch(ts=time.time(), events=[vev.BlockRemoved([12], medium="GPU")])
        )
        time.sleep(0.5)  # the publisher thread sends and buffers them
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvhex",
                "events",
                f"tcp://127.0.0.1:{pub}",
                "--replay",
                f"tcp://127.0.0.1:{replay}",
                "--count",
                "4",
                "--duration",
                "30",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        publisher.shutdown()
    assert done.returncode == 0, done.stdout + done.stderr
    *events, summary = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["seq"], e["type"], e["medium"]) for e in events] == [
        (0, "BlockStored", "GPU"),
        (0, "BlockStored", "CPU"),
        (0, "BlockStored", "CPU"),
        (1, "BlockRemoved", "GPU"),
    ]
    assert events[0]["block_hashes"] == [11, 12]
    assert events[0]["lora_name"] == "adapter-a"
    assert events[2]["parent_block_hash"] == "0b" * 32
    assert summary["consistent"] is True
    assert summary["blocks"] == {"CPU": 2, "GPU": 1}
