"""TorchHostBuffer: zero-copy slot views over one tensor, private or in named shared memory
seen from another process (spawned, as vLLM's workers are), owner-only files, cleanup."""

from __future__ import annotations

import multiprocessing
import os
import stat
import uuid
from pathlib import Path

import pytest
import torch

from kvhex.adapters.torch import TorchBlockTransfer, TorchHostBuffer, shm_path
from kvhex.domain import JobId, TransferJob, TransferKind

NO_CUDA = not torch.cuda.is_available()


def test_slot_views_and_tensor_share_the_same_bytes() -> None:
    with TorchHostBuffer(4, 32) as host:
        assert host.tensor.shape == (4, 32)
        assert host.tensor.dtype == torch.uint8
        assert host.pinned is (not NO_CUDA)
        view = host.slot_view(2)
        assert (len(view), view.readonly) == (32, False)
        view[:] = bytes(range(32))
        assert host.tensor[2].tolist() == list(range(32))
        host.tensor[3].fill_(9)
        assert bytes(host.slot_view(3)) == b"\x09" * 32
        with pytest.raises(IndexError, match=r"slot 4 outside 0\.\.3"):
            host.slot_view(4)
        with pytest.raises(IndexError):
            host.slot_view(-1)
    assert host.closed
    assert bytes(view[:4]) == b"\x00\x01\x02\x03"  # views handed out stay valid
    with pytest.raises(IndexError, match="closed"):
        host.slot_view(0)
    with pytest.raises(ValueError, match="closed"):
        _ = host.tensor
    host.close()  # idempotent


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="num_slots > 0 and slot_bytes > 0"):
        TorchHostBuffer(0, 8)
    with pytest.raises(ValueError, match="create=False attaches to a named buffer"):
        TorchHostBuffer(1, 8, create=False)
    with pytest.raises(ValueError, match="invalid shared-memory name"):
        TorchHostBuffer(1, 8, shm_name="..")


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without a CUDA device")
def test_pinning_without_cuda_is_refused_when_asked_and_skipped_by_default() -> None:
    with pytest.raises(ValueError, match="pin=True needs a CUDA device"):
        TorchHostBuffer(1, 8, pin=True)
    with TorchHostBuffer(1, 8) as host:
        assert host.pinned is False


def test_named_buffer_is_owner_only_shared_and_removed_by_its_creator(tmp_path: Path) -> None:
    path = tmp_path / "kv-host"
    owner = TorchHostBuffer(3, 16, shm_name=str(path))
    assert owner.owner
    assert owner.path == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == 48
    owner.slot_view(1)[:] = b"a" * 16
    guest = TorchHostBuffer(3, 16, shm_name=str(path), create=False)
    assert not guest.owner
    assert bytes(guest.slot_view(1)) == b"a" * 16
    guest.tensor[2].fill_(ord("b"))
    assert bytes(owner.slot_view(2)) == b"b" * 16
    guest.close()
    assert path.exists()  # a guest never removes the file
    owner.close()
    assert not path.exists()


def test_attaching_checks_size_owner_mode_and_existence(tmp_path: Path) -> None:
    path = tmp_path / "kv-host"
    with TorchHostBuffer(3, 16, shm_name=str(path)):
        with pytest.raises(ValueError, match=r"holds 48 bytes, but .* = 4 \* 16 = 64"):
            TorchHostBuffer(4, 16, shm_name=str(path), create=False)
        with pytest.raises(FileExistsError, match="already exists"):
            TorchHostBuffer(3, 16, shm_name=str(path))
    with pytest.raises(FileNotFoundError):
        TorchHostBuffer(3, 16, shm_name=str(path), create=False)
    loose = tmp_path / "loose"
    loose.write_bytes(b"\0" * 48)
    loose.chmod(0o644)
    with pytest.raises(PermissionError, match="owner-only"):
        TorchHostBuffer(3, 16, shm_name=str(loose), create=False)


def test_a_bare_name_lives_in_dev_shm_and_is_removed_at_close() -> None:
    name = f"kvhex-test-{uuid.uuid4().hex}"
    path = shm_path(name)
    assert path.name == name
    if Path("/dev/shm").is_dir():
        assert path.parent == Path("/dev/shm")
    with TorchHostBuffer(2, 8, shm_name=name) as host:
        assert host.path == path
        assert path.exists()
    assert not path.exists()


def test_a_creator_that_is_never_closed_still_removes_its_file(tmp_path: Path) -> None:
    path = tmp_path / "dropped"
    TorchHostBuffer(1, 8, shm_name=str(path))  # dropped at once: the finalizer unlinks
    assert not path.exists()


# -- a second process (spawned, like vLLM's workers) ----------------------------------------


def _guest_reads_then_writes(path: str, num_slots: int, slot_bytes: int) -> int:
    with TorchHostBuffer(num_slots, slot_bytes, shm_name=path, create=False) as host:
        total = int(host.tensor[0].sum())
        host.slot_view(1)[:] = bytes(255 - (i % 256) for i in range(slot_bytes))
        return total


def _worker_stores(path: str, num_slots: int, slot_bytes: int, seed: int) -> None:
    """What a vLLM worker does: attach to the scheduler's buffer and copy KV blocks into it."""
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=gen) for _ in range(2)]
    with TorchHostBuffer(num_slots, slot_bytes, shm_name=path, create=False) as host:
        transfer = TorchBlockTransfer(host, caches, tensor_groups=[0, 1], blocks_per_chunk=[2, 1])
        job = TransferJob(
            JobId(1),
            TransferKind.STORE,
            slots=[3, 0, 2],
            block_ids=[5, 6, 7, 8],
            group_sizes=[3, 1],
            block_indices=[0, 0],
        )
        transfer.submit_store(job)
        transfer.wait([JobId(1)])
        [result] = transfer.poll()
        assert result.success, result.error
        transfer.close()


def test_a_spawned_process_sees_and_writes_the_same_bytes(tmp_path: Path) -> None:
    path = str(tmp_path / "shared")
    with TorchHostBuffer(2, 4096, shm_name=path) as host:
        host.tensor[0].copy_(torch.arange(4096) % 256)
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            total = pool.apply(_guest_reads_then_writes, (path, 2, 4096))
        assert total == int((torch.arange(4096) % 256).sum())
        assert bytes(host.slot_view(1)) == bytes(255 - (i % 256) for i in range(4096))


def test_a_spawned_worker_stores_blocks_the_scheduler_reads(tmp_path: Path) -> None:
    path = str(tmp_path / "kv")
    slot_bytes = 2 * 32 + 1 * 32
    with TorchHostBuffer(4, slot_bytes, shm_name=path) as host:
        ctx = multiprocessing.get_context("spawn")
        process = ctx.Process(target=_worker_stores, args=(path, 4, slot_bytes, 3))
        process.start()
        process.join(timeout=120)
        assert process.exitcode == 0
        gen = torch.Generator().manual_seed(3)
        caches = [
            torch.randint(0, 256, (16, 32), dtype=torch.uint8, generator=gen) for _ in range(2)
        ]
        # group 0 (tensor 0, 2 blocks per slot): blocks 5, 6 -> slot 3, block 7 -> slot 0
        assert bytes(host.slot_view(3)[:64]) == bytes(caches[0][5:7].flatten().tolist())
        assert bytes(host.slot_view(0)[:32]) == bytes(caches[0][7].tolist())
        # group 1 (tensor 1, 1 block per slot): block 8 -> slot 2, in tensor 1's region
        assert bytes(host.slot_view(2)[64:96]) == bytes(caches[1][8].tolist())
        assert bytes(host.slot_view(1)) == b"\0" * slot_bytes
    assert not os.path.exists(path)
