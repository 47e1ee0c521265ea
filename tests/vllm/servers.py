"""vLLM's OpenAI server (the CPU build) as the router tests run it: started on loopback in a
process group of its own (API server, engine core, worker), publishing its KV events on vLLM's
ZMQ publisher, and talked to over HTTP with the standard library.

vLLM's publisher binds its endpoints only for ``tcp://*:P`` (every interface of the machine,
for as long as the test runs; the streams hold only the test's blocks) or ``ipc://``; given
``tcp://127.0.0.1:P`` it would connect instead. The routers connect to ``tcp://127.0.0.1:P``.
``VLLM_SERVER_DEV_MODE=1`` adds ``POST /reset_prefix_cache``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.dynamo import MODEL, call, free_port
from tests.routers import _Service
from tests.vllm.engine import BLOCK, DEVICE_BLOCKS

__all__ = ["Answer", "VllmServer"]

SOURCES = ("device", "host", "disk")
"""``vllm:prompt_tokens_cached_by_source`` sources (kvhex names the tier that served a hit)."""


class Answer(dict[str, Any]):
    """A completion's JSON answer, with what the tests read of it."""

    @property
    def tokens(self) -> list[int]:
        ids: list[int] = self["choices"][0]["token_ids"]
        return ids

    @property
    def cached(self) -> int:
        details = self["usage"].get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)


class VllmServer(_Service):
    """``python -m vllm.entrypoints.openai.api_server`` with the tiny model on free loopback
    ports, serving it as ``tests.dynamo.MODEL``, with kvhex's connector and ``extra`` as its
    ``kv_connector_extra_config`` (``None``: no offloading), its events on
    :attr:`events` (replay :attr:`replay`).

    Args:
        model: the tiny model's directory.
        log_path: where the server's output goes.
        extra: kvhex's extra config, or ``None`` for a server without offloading.
        options: more command-line options.
        env: more environment variables.
    """

    NAME = "vLLM server"
    STARTUP_TIMEOUT_S = 300.0

    def __init__(
        self,
        model: Path,
        log_path: Path,
        extra: Mapping[str, Any] | None,
        *,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(log_path)
        self.events = self.replay = ""

        def attempt() -> list[str]:
            port, events, replay = free_port(), free_port(), free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.events = f"tcp://127.0.0.1:{events}"
            self.replay = f"tcp://127.0.0.1:{replay}"
            kv_events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{events}",
                "replay_endpoint": f"tcp://*:{replay}",
            }
            command = [
                *(sys.executable, "-m", "vllm.entrypoints.openai.api_server"),
                *("--model", str(model), "--served-model-name", MODEL),
                *("--host", "127.0.0.1", "--port", str(port)),
                *("--block-size", str(BLOCK), "--max-model-len", "512"),
                *("--num-gpu-blocks-override", str(DEVICE_BLOCKS)),
                *("--gpu-memory-utilization", "0.1", "--seed", "0"),
                *("--skip-tokenizer-init", "--enforce-eager", "--enable-prompt-tokens-details"),
                *("--kv-events-config", json.dumps(kv_events)),
                *options,
            ]
            if extra is not None:
                transfer = {
                    "kv_connector": "KvhexOffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"spec_name": "KvhexOffloadingSpec", **extra},
                }
                command += ["--kv-transfer-config", json.dumps(transfer)]
            return command

        server_env = {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            # one OpenMP thread per server: two servers share the machine's cores
            "OMP_NUM_THREADS": "1",
            # the same placement with a KV connector as without (bench/serve.py says why)
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            **(env or {}),
        }
        if "VLLM_CACHE_ROOT" not in os.environ:
            server_env["VLLM_CACHE_ROOT"] = str(log_path.parent / "vllm-cache")
        self._launch(attempt, server_env)

    def _ready(self) -> bool:
        return self.call("GET", "/health")[0] == 200

    def complete(self, prompt: Sequence[int], max_tokens: int = 16) -> Answer:
        """A greedy completion of the token ids ``prompt``, sent to this server."""
        body = {
            "model": MODEL,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        status, answer = self.call("POST", "/v1/completions", body)
        assert status == 200, f"completion answered {status}: {answer}{self.context()}"
        return Answer(answer)

    def reset_prefix_cache(self) -> None:
        """Empty the device's prefix cache (vLLM's device pool publishes
        ``AllBlocksCleared``); kvhex's tiers keep what they hold."""
        status, answer = self.call("POST", "/reset_prefix_cache")
        assert status == 200, f"reset answered {status}: {answer}{self.context()}"

    def cached_by_source(self) -> dict[str, float]:
        """Prompt tokens served from cache so far, per source (device, host, disk)."""
        status, text = call(f"{self.url}/metrics", "GET")
        assert status == 200, f"metrics answered {status}{self.context()}"
        found = dict.fromkeys(SOURCES, 0.0)
        for line in str(text).splitlines():
            if line.startswith("vllm:prompt_tokens_cached_by_source_total{"):
                labels, _, value = line.rpartition(" ")
                for source in SOURCES:
                    if f'source="{source}"' in labels:
                        found[source] += float(value)
        return found
