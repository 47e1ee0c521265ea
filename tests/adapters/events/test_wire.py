"""kvhex's wire bytes equal vLLM 0.33's, byte for byte (golden bytes recorded from vLLM's own
classes by tests/fixtures/wire/make_golden.py), and decode both ways."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvhex.adapters.events import wire
from kvhex.domain import events as domain
from tests.fixtures.wire.cases import CASES

GOLDEN = json.loads((Path(__file__).parents[3] / "tests/fixtures/wire/golden.json").read_text())

KINDS: dict[str, Any] = {
    "BlockStored": domain.BlockStored,
    "BlockRemoved": domain.BlockRemoved,
    "AllBlocksCleared": domain.AllBlocksCleared,
}


def domain_batch(name: str) -> domain.EventBatch:
    ts, events, rank = CASES[name]
    return domain.EventBatch(ts, [KINDS[kind](**fields) for kind, fields in events], rank)


def test_golden_bytes_were_recorded_from_vllm_0_33() -> None:
    assert GOLDEN["vllm"] == "0.33.0"
    assert set(GOLDEN["cases"]) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoding_is_byte_identical_to_vllms(name: str) -> None:
    assert wire.encode_batch(domain_batch(name)).hex() == GOLDEN["cases"][name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllms_bytes_decode_into_the_same_events(name: str) -> None:
    decoded = wire.decode_batch(bytes.fromhex(GOLDEN["cases"][name]))
    ts, events, rank = CASES[name]
    assert (decoded.ts, decoded.data_parallel_rank) == (ts, rank)
    assert [type(e).__name__ for e in decoded.events] == [kind for kind, _ in events]
    for got, (_, fields) in zip(decoded.events, events, strict=True):
        for field, value in fields.items():
            # msgpack has no tuples: extra keys decode as nested lists
            assert _listify(getattr(got, field)) == _listify(value), field


def _listify(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_listify(v) for v in value]
    return value


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\x93\x01")


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM 0.33 is not installed in this environment; install vllm==0.33.0 as in "
    "shared/reference/environment.md (or run the vLLM integration environment) to decode "
    "kvhex's bytes with vLLM's own decoder",
)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # vLLM's and torch's imports
@pytest.mark.parametrize("name", sorted(CASES))
def test_vllms_own_decoder_reads_kvhex_bytes(name: str) -> None:  # pragma: no cover - needs vLLM
    from vllm.distributed import kv_events as v

    ours = wire.encode_batch(domain_batch(name))
    decoded = msgspec.msgpack.Decoder(v.KVEventBatch).decode(ours)
    ts, events, rank = CASES[name]
    expected = v.KVEventBatch(
        ts=ts,
        events=[getattr(v, kind)(**fields) for kind, fields in events],
        data_parallel_rank=rank,
    )
    assert msgspec.msgpack.encode(decoded) == msgspec.msgpack.encode(expected)


def test_domain_and_wire_structs_declare_the_same_fields_in_the_same_order() -> None:
    assert domain.BlockStored._fields == wire.BlockStored.__struct_fields__
    assert domain.BlockRemoved._fields == wire.BlockRemoved.__struct_fields__
    assert domain.EventBatch._fields == wire.EventBatch.__struct_fields__
