"""Every name a public module exports exists, and importing kvhex does no work."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC = [
    "kvhex",
    "kvhex.errors",
    "kvhex.domain",
    "kvhex.domain.keys",
    "kvhex.domain.tiers",
    "kvhex.domain.request",
    "kvhex.domain.events",
    "kvhex.domain.primary",
    "kvhex.domain.policies",
    "kvhex.config",
    "kvhex.plugins",
    "kvhex.bootstrap",
    "kvhex.testing",
    "kvhex.ports",
    "kvhex.service",
    "kvhex.domain.translate",
    "kvhex.domain.locator",
    "kvhex.domain.geometry",
    "kvhex.domain.slot_layout",
    "kvhex.domain.provenance",
    "kvhex.domain.residency",
    "kvhex.adapters.memory",
    "kvhex.adapters.memory.host",
    "kvhex.adapters.memory.tier",
    "kvhex.adapters.memory.transfer",
    "kvhex.adapters.memory.sink",
    "kvhex.adapters.events.wire",
    "kvhex.adapters.events.jsonl",
    "kvhex.adapters.events.log",
    "kvhex.adapters.events.zmq",
    "kvhex.adapters.storage.format",
    "kvhex.adapters.storage.fsspec",
    "kvhex.adapters.storage.tier",
    "kvhex.adapters.storage.block_io",
    "kvhex.adapters.storage.namespace",
    "kvhex.adapters.storage.files.posix",
    "kvhex.adapters.storage.objects.io",
    "kvhex.adapters.storage.files.slabs",
    "kvhex.adapters.storage.files.fsck",
    "kvhex.adapters.storage.nixl",
    "kvhex.adapters.torch",
    "kvhex.adapters.torch.direct",
    "kvhex.adapters.torch.workers",
    "kvhex.adapters.torch.host",
    "kvhex.adapters.torch.staging",
    "kvhex.adapters.torch.transfer",
    "kvhex.vllm.settings",
    "kvhex.vllm.compose",
    "kvhex.vllm.plugin",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_all_names_exist_once(name: str) -> None:
    module = importlib.import_module(name)
    exported = module.__all__
    assert len(set(exported)) == len(exported)
    missing = [n for n in exported if not hasattr(module, n)]
    assert missing == []


def test_importing_kvhex_loads_no_heavy_module_and_no_plugin() -> None:
    code = (
        "import sys, kvhex, kvhex.domain, kvhex.plugins, kvhex.config;"
        "heavy = [m for m in ('torch','numpy','fsspec','zmq','msgspec','vllm','structlog')"
        " if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
