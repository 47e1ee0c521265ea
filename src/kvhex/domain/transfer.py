"""Device <-> host transfer jobs: which device blocks go to (or come from) which host slots.

Mirrors vLLM's ``GPULoadStoreSpec`` / ``CPULoadStoreSpec`` pair so the vLLM adapter passes
them through without reshaping:

* ``block_ids`` are device block indices, group-major: the first ``group_sizes[0]`` belong to
  KV group 0 of the job, and so on (zero-size groups allowed).
* ``block_indices[g]`` is the logical index (within the request) of group ``g``'s first block.
  A chunk holds ``blocks_per_chunk`` blocks, so the first ``block_indices[g] % blocks_per_chunk``
  blocks of that group's first chunk are not part of the job (already offloaded, or not
  needed): the transfer skips them in the slot.
* ``slots`` are host slots, one per chunk, group-major in the same order: group ``g`` covers
  ``ceil((skip_g + group_sizes[g]) / blocks_per_chunk_g)`` of them.

A job is immutable by contract and compared by identity; results come back per job id,
in submission order per direction.

Where a job's blocks live inside its slots is :mod:`kvhex.domain.slot_layout`'s.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from kvhex.domain.jobs import JobId
from kvhex.errors import TransferError


class TransferKind(enum.Enum):
    """A transfer's direction."""

    STORE = "store"
    """Device blocks -> host slots (offload)."""
    LOAD = "load"
    """Host slots -> device blocks (a hit served back to the engine)."""


class TransferJob:
    """One batched device <-> host copy. See the module docstring for the field semantics.

    Raises:
        ValueError: naming the field, when ``group_sizes`` does not add up to the number of
            block ids, ``block_indices`` and ``group_sizes`` differ in length, or any id or
            index is negative.
    """

    __slots__ = ("block_ids", "block_indices", "group_sizes", "job_id", "kind", "slots")

    def __init__(
        self,
        job_id: JobId,
        kind: TransferKind,
        slots: Sequence[int],
        block_ids: Sequence[int],
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        sizes = tuple(group_sizes) if group_sizes is not None else (len(block_ids),)
        indices = tuple(block_indices) if block_indices is not None else (0,) * len(sizes)
        if sum(sizes) != len(block_ids):
            raise ValueError(
                f"transfer {job_id}: group_sizes {sizes} add up to {sum(sizes)}, "
                f"but block_ids has {len(block_ids)}"
            )
        if len(indices) != len(sizes):
            raise ValueError(
                f"transfer {job_id}: block_indices has {len(indices)} entries, "
                f"group_sizes {len(sizes)}"
            )
        for name, values in (
            ("slots", slots),
            ("block_ids", block_ids),
            ("group_sizes", sizes),
            ("block_indices", indices),
        ):
            if any(v < 0 for v in values):
                raise ValueError(f"transfer {job_id}: {name} holds a negative value")
        self.job_id = job_id
        self.kind = kind
        self.slots = tuple(slots)
        self.block_ids = tuple(block_ids)
        self.group_sizes = sizes
        self.block_indices = indices

    def __repr__(self) -> str:
        return (
            f"TransferJob(job_id={self.job_id}, kind={self.kind.value}, slots={len(self.slots)}, "
            f"blocks={self.group_sizes})"
        )


class TransferResult(NamedTuple):
    """What a transfer reports for one finished job.

    Attributes:
        job_id: the job this answers.
        success: every block was copied.
        nbytes: bytes copied.
        seconds: time the copy took (device-measured where the device can measure it).
        error: a short description of the failure.
    """

    job_id: JobId
    success: bool
    nbytes: int = 0
    seconds: float | None = None
    error: str | None = None


def check_submission(job: TransferJob, kind: TransferKind, *, closed: bool) -> None:
    """What every ``BlockTransfer`` checks first: it is open, and ``job`` goes ``kind``.

    Raises:
        TransferError: naming the job (and ``field="kind"`` for a job of the other direction).
    """
    if closed:
        raise TransferError("the transfer is closed", job_id=job.job_id)
    if job.kind is not kind:
        raise TransferError(
            f"a {job.kind.value} job submitted as a {kind.value}", job_id=job.job_id, field="kind"
        )
