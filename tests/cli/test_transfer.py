"""``kvhex run``'s transfer comes from the registry (``[run] transfer``, ``kvhex.transfers``),
exactly as its tiers do: another one registered is driven with the run's tensors and moves
its bytes; a name, an option or an object that is wrong is a ``ConfigError`` at the key to
correct, found before anything is built."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kvhex.adapters.torch import TensorHostBuffer, TorchBlockTransfer
from kvhex.cli._stack import Stack
from kvhex.config import load_config
from kvhex.config.model import KvhexConfig
from kvhex.domain import JobId, TransferJob, TransferResult
from kvhex.errors import ConfigError
from kvhex.plugins import TRANSFERS, Registry
from kvhex.sim.workload import synthetic_chat


class Recording:
    """The torch transfer, keeping the tensors it was given and the bytes it moved."""

    def __init__(
        self,
        host: TensorHostBuffer,
        kv_caches: Sequence[torch.Tensor],
        *,
        tensor_groups: Sequence[int],
        blocks_per_chunk: Sequence[int],
        label: str,
    ) -> None:
        self.inner = TorchBlockTransfer(
            host, kv_caches, tensor_groups=tensor_groups, blocks_per_chunk=blocks_per_chunk
        )
        self.given = (list(kv_caches), list(tensor_groups), list(blocks_per_chunk), label)
        self.moved = 0

    def submit_store(self, job: TransferJob) -> None:
        self.inner.submit_store(job)

    def submit_load(self, job: TransferJob) -> None:
        self.inner.submit_load(job)

    def poll(self) -> list[TransferResult]:
        results = self.inner.poll()
        self.moved += sum(r.nbytes for r in results)
        return results

    def wait(self, job_ids: Collection[JobId]) -> None:
        self.inner.wait(job_ids)

    def close(self) -> None:
        self.inner.close()


class NotATransfer:
    def close(self) -> None:
        pass


def not_a_transfer(host: Any, kv_caches: Any, **_: Any) -> NotATransfer:
    """A factory (so the registry cannot check its class) that builds no transfer."""
    return NotATransfer()


def config(tmp_path: Path, **run: Any) -> KvhexConfig:
    """A host tier and a file tier under ``tmp_path``, a two-layer model on the CPU."""
    tier = {"url": str(tmp_path / "tier"), "capacity_bytes": 1 << 24}
    return load_config(
        {
            "primary": {"capacity_bytes": 1 << 20},
            "tiers": [{"type": "fsspec", "options": tier}],
            "run": {"layers": 2, "page_bytes": 4096, "device_blocks": 512, "device": "cpu", **run},
        }
    )


def registry() -> Registry:
    found = Registry.discover()
    found.register(TRANSFERS, "recording", Recording)
    return found


def test_a_registered_transfer_is_driven_with_the_runs_tensors_and_moves_its_bytes(
    tmp_path: Path,
) -> None:
    chosen = config(tmp_path, transfer="recording", transfer_options={"label": "mine"})
    with Stack(chosen, registry=registry()) as stack:
        transfer = stack.transfer
        assert isinstance(transfer, Recording)
        assert transfer.given == (stack.kv, [0, 0], [4], "mine")
        requests = synthetic_chat(20, seed=0, tokens_per_chunk=16 * 4)
        report = stack.run(requests)
    assert report.blocks_checked > 0
    assert report.verdict == "intact"
    assert transfer.moved == report.device_store.nbytes + report.device_load.nbytes > 0


@pytest.mark.parametrize(
    ("run", "path", "said"),
    [
        (
            {"transfer": "floppy"},
            "$.run.transfer",
            "unknown transfer 'floppy'; available: memory, recording, torch",
        ),
        (
            {"transfer_options": {"blocks_per_chunk": [2]}},
            "$.run.transfer_options.blocks_per_chunk",
            "set by kvhex run from [run]",
        ),
    ],
    ids=["unknown-name", "option-the-run-sets"],
)
def test_a_bad_transfer_is_refused_before_anything_is_built(
    tmp_path: Path, run: dict[str, Any], path: str, said: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Stack(config(tmp_path, **run), registry=registry(), source="kvhex.toml")
    assert info.value.issues == ((path, info.value.issues[0][1]),)
    assert said in info.value.issues[0][1]
    assert info.value.source == "kvhex.toml"
    assert not (tmp_path / "tier").exists()  # the file tier was never opened


@pytest.mark.parametrize(
    ("run", "path", "said"),
    [
        (
            {"transfer_options": {"copy_thread": 2}},
            "$.run.transfer_options.copy_thread",
            "unexpected keyword argument 'copy_thread'",
        ),
        (
            {"transfer_options": {"copy_threads": 0}},
            "$.run.transfer_options.copy_threads",
            "copy_threads: must be > 0, got 0",
        ),
        (
            {"transfer": "recording"},
            "$.run.transfer",
            "missing 1 required keyword-only argument: 'label'",
        ),
        ({"transfer": "memory"}, "$.run.transfer", "'page_bytes'"),
        ({"transfer": "odd"}, "$.run.transfer", "built a NotATransfer, not a BlockTransfer"),
    ],
    ids=["unknown-option", "bad-value", "missing-option", "memory-takes-no-tensors", "not-one"],
)
def test_what_the_transfer_refuses_is_named_at_its_key(
    tmp_path: Path, run: dict[str, Any], path: str, said: str
) -> None:
    plugins = registry()
    plugins.register(TRANSFERS, "odd", not_a_transfer)
    with pytest.raises(ConfigError) as info:
        Stack(config(tmp_path, **run), registry=plugins)
    ((where, problem),) = info.value.issues
    assert where == path
    assert said in problem
