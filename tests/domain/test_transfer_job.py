"""TransferJob: vLLM's load/store spec pair as one value, with errors naming the field."""

from __future__ import annotations

import pytest

from kvhex.domain import JobId, TransferJob, TransferKind


def test_defaults_to_one_group_starting_at_block_zero() -> None:
    job = TransferJob(JobId(1), TransferKind.STORE, slots=[3, 4], block_ids=[10, 11, 12, 13])
    assert job.group_sizes == (4,)
    assert job.block_indices == (0,)
    assert job.slots == (3, 4)
    assert job.block_ids == (10, 11, 12, 13)


def test_group_major_fields_are_kept() -> None:
    job = TransferJob(
        JobId(2),
        TransferKind.LOAD,
        slots=[0, 1, 2],
        block_ids=[5, 6, 7],
        group_sizes=[2, 0, 1],
        block_indices=[4, 0, 2],
    )
    assert job.group_sizes == (2, 0, 1)
    assert job.block_indices == (4, 0, 2)
    assert "load" in repr(job)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_ids": [1, 2], "group_sizes": [1]}, "group_sizes"),
        ({"block_ids": [1, 2], "group_sizes": [1, 1], "block_indices": [0]}, "block_indices"),
        ({"block_ids": [1, -2]}, "block_ids"),
        ({"block_ids": [1], "slots": [-1]}, "slots"),
        ({"block_ids": [1], "block_indices": [-3]}, "block_indices"),
    ],
)
def test_inconsistent_jobs_name_the_field(kwargs: dict[str, list[int]], field: str) -> None:
    args = {"slots": [0], **kwargs}
    with pytest.raises(ValueError, match=field):
        TransferJob(JobId(9), TransferKind.STORE, **args)  # type: ignore[arg-type]
