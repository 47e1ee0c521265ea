"""vLLM's OpenAI-compatible server on the CPU with kvhex, as docs/vllm.md starts it.

The server runs in its own processes (API server and engine core, vLLM's defaults) on
loopback, with the tiny model, host memory and a file tier; requests go over real HTTP. Two
requests share a 320-token prefix, with an unrelated one between them that evicts the prefix
from the 16-block device cache: the second is served from kvhex's tiers, with the tokens of a
run without offloading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.engine import (
    BLOCK,
    CHUNK_BYTES,
    DEVICE_BLOCKS,
    ENGINE_SKIP,
    MAX_TOKENS,
    PREFIX,
    flush,
    free_port,
    prompt,
)

pytestmark = [
    pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or ""),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

START_S = 240.0


def server_command(model: Path, port: int, root: Path) -> list[str]:
    """docs/vllm.md's command line for vLLM's CPU build (its ``vllm`` script looks for a
    distribution named ``vllm`` and fails, so the server module is run directly)."""
    transfer = {
        "kv_connector": "KvhexOffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvhexOffloadingSpec",
            "cpu_bytes_to_use": 12 * CHUNK_BYTES,
            "secondary_tiers": [
                {"type": "fs", "root_dir": str(root), "kvhex": {"capacity_bytes": 64 << 20}}
            ],
        },
    }
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        "512",
        "--enforce-eager",
        "--num-gpu-blocks-override",
        str(DEVICE_BLOCKS),
        "--gpu-memory-utilization",
        "0.1",
        "--seed",
        "0",
        "--enable-prompt-tokens-details",
        "--kv-transfer-config",
        json.dumps(transfer),
    ]


@pytest.fixture
def server(model: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    proc = subprocess.Popen(
        server_command(model, port, tmp_path / "kv"),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_S
        while True:
            if proc.poll() is not None:
                log.flush()
                tail = (tmp_path / "server.log").read_text(errors="replace")[-4000:]
                pytest.fail(f"the server exited with {proc.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                assert time.monotonic() < deadline, f"the server was not up in {START_S} s"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def complete(url: str, model: Path, tokens: list[int]) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.load(response)
        return answer


def external_hits(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    )


def test_the_openai_server_serves_a_shared_prefix_from_kvhex(
    server: str, model: Path, baseline: dict[int, list[int]]
) -> None:
    first = complete(server, model, prompt(0))
    complete(server, model, flush(0))
    before = external_hits(server)
    second = complete(server, model, prompt(1))
    assert [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]] == [
        baseline[0],
        baseline[1],
    ]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PREFIX)
    # all but the first block, which the device cache kept, came from kvhex
    assert external_hits(server) - before >= len(PREFIX) - BLOCK
