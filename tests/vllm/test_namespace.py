"""Blocks are only ever shared where they are compatible.

Each field of the vLLM namespace (``namespace_of``) is changed alone, the way vLLM would
set it, on a real ``VllmConfig`` and ``KVCacheConfig`` (``OffloadingConfig`` built from them by
vLLM's own ``build_offloading_config``): the namespace records the change, its digest
differs, and a kvhex file tier opened with it on the root where the old namespace stored
blocks finds none of them. Equal configurations of two engines share; the digest is the
same in another process; the spec finds vLLM's configs through the real connector.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vLLM: make vllm-test runs this in .venv-vllm (0.33), make vllm32-test in "
    ".venv-vllm32 (0.32)",
)

import torch
from vllm.config import SpeculativeConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import LAYOUT_VERSION, namespace_digest
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.domain import JobKind
from kvhex.vllm import register, spec
from kvhex.vllm.spec import RANDOM_HASH_ROOT, KvhexOffloadingSpec, namespace_of
from tests.adapters.jobs import run
from tests.vllm.scheduler import (
    BLOCK,
    LAYER,
    kv_cache_config,
    scheduler_connector,
    vllm_config,
)

EXTRA = {"spec_name": "KvhexOffloadingSpec", "cpu_bytes_to_use": 1 << 20}


@dataclasses.dataclass
class Engine:
    """One engine's vLLM configs. ``edit`` changes an ``OffloadingConfig`` field vLLM derives
    from state a CPU test cannot set up (an MLA model over TP ranks, several KV groups);
    ``patch`` changes the environment and kvhex's per-version constants for one test."""

    vllm: Any
    kv_cache: Any
    patch: pytest.MonkeyPatch
    edit: Callable[[Any], Any] = lambda config: config

    def offloading(self) -> Any:
        return self.edit(build_offloading_config(self.vllm, self.kv_cache))

    def namespace(self) -> dict[str, Any]:
        config = self.offloading()
        kv_bytes = KvhexOffloadingSpec(config).kv_bytes_per_chunk
        return namespace_of(config, kv_bytes, (self.vllm, self.kv_cache))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("namespace") / "tiny-llama"


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Any:
    config = vllm_config(model_dir, dict(EXTRA), "OffloadingConnector")
    config.cache_config.kv_cache_layout = "LBNHC"  # vLLM resolves it before the scheduler
    return config


@pytest.fixture(autouse=True)
def _hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default: no PYTHONHASHSEED (the tests that want one set it)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def _engine(base: Any, patch: pytest.MonkeyPatch) -> Engine:
    return Engine(copy.deepcopy(base), kv_cache_config(), patch)


# -- one change per field ----------------------------------------------------------------

Change = Callable[[Engine], None]


def _set(path: str, value: Any) -> Change:
    """Set ``<path>`` (e.g. ``cache_config.cache_dtype``) on the engine's ``VllmConfig``."""
    return _set_other(path, value)


def _set_other(path: str, *values: Any) -> Change:
    """Set ``<path>`` to the first of ``values`` it does not hold already (what vLLM picks
    can depend on the CPU: its CPU platform resets the Mamba SSM state dtype to float32 where
    AVX-512 BF16 is supported), or to the last when it holds them all."""
    *parents, name = path.split(".")

    def change(e: Engine) -> None:
        target = e.vllm
        for parent in parents:
            target = getattr(target, parent)
        current = getattr(target, name)
        setattr(target, name, next((v for v in values if v != current), values[-1]))

    return change


def _extra(**keys: Any) -> Change:
    return lambda e: e.vllm.kv_transfer_config.kv_connector_extra_config.update(keys)


def _parallel(**sizes: int) -> Change:
    def change(e: Engine) -> None:
        parallel = e.vllm.parallel_config
        for name, size in sizes.items():
            setattr(parallel, name, size)
        parallel.world_size = (
            parallel.tensor_parallel_size
            * parallel.pipeline_parallel_size
            * parallel.prefill_context_parallel_size
        )

    return change


def _edit(part: str | None = None, **fields: Any) -> Change:
    """Replace ``fields`` of the ``OffloadingConfig`` (of its ``part``, e.g. ``cache``)."""

    def edit(config: Any) -> Any:
        if part is None:
            return dataclasses.replace(config, **fields)
        changed = dataclasses.replace(getattr(config, part), **fields)
        return dataclasses.replace(config, **{part: changed})

    def change(e: Engine) -> None:
        e.edit = edit

    return change


def _attention(kv_spec: Any, layer: str = LAYER) -> Change:
    """The group's layer and cache spec, as vLLM's KV-cache config would name them."""

    def change(e: Engine) -> None:
        group = e.kv_cache.kv_cache_groups[0]
        e.kv_cache.kv_cache_groups[0] = dataclasses.replace(
            group, layer_names=[layer], kv_cache_spec=kv_spec
        )
        e.kv_cache.kv_cache_tensors[0].layers = [layer]

    return change


def _full(block_size: int = BLOCK) -> Any:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=4, head_size=16, dtype=torch.float16
    )


def _window(window: int) -> Any:
    return SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=4, head_size=16, dtype=torch.float16, sliding_window=window
    )


def _block_size(size: int) -> Change:
    def change(e: Engine) -> None:
        e.vllm.cache_config.block_size = size
        _attention(_full(size))(e)

    return change


def _hf(name: str, value: Any) -> Change:
    return lambda e: setattr(e.vllm.model_config.hf_config, name, value)


def _draft(method: str, model: bool) -> Change:
    """A speculative config: a draft model (this tiny model again) or n-gram lookup."""

    def change(e: Engine) -> None:
        target = e.vllm
        e.vllm.speculative_config = SpeculativeConfig(
            method=method,
            model=target.model_config.model if model else None,
            num_speculative_tokens=2,
            target_model_config=target.model_config,
            target_parallel_config=target.parallel_config,
        )

    return change


def _env(name: str, value: str) -> Change:
    return lambda e: e.patch.setenv(name, value)


def _constant(name: str, value: Any) -> Change:
    """One of kvhex's per-vLLM-version constants, as a new vLLM release would change it."""
    return lambda e: e.patch.setattr(spec, name, value)


def _both(first: Change, then: Change) -> Change:
    def change(e: Engine) -> None:
        first(e)
        then(e)

    return change


@dataclasses.dataclass(frozen=True)
class Field:
    """``key``: the namespace entry that records the field; ``change``: one change of it;
    ``setup``: applied to both engines first (a field that exists only in some setups)."""

    key: str
    change: Change
    setup: Change = lambda e: None


FIELDS: dict[str, Field] = {
    "model name": Field("model", _set("model_config.model", "org/other-model")),
    "model weights URI": Field("model_weights", _set("model_config.model_weights", "s3://b/m")),
    "model revision": Field("revision", _set("model_config.revision", "0123abcd")),
    "code revision": Field("code_revision", _set("model_config.code_revision", "4567ef01")),
    "model dtype": Field("model_dtype", _set("model_config.dtype", torch.bfloat16)),
    "model dtype under an fp8 KV cache": Field(
        "model_dtype",
        _set("model_config.dtype", torch.bfloat16),
        setup=_set("cache_config.cache_dtype", "fp8_e4m3"),
    ),
    "KV-cache dtype": Field("kv_cache_dtype", _set("cache_config.cache_dtype", "fp8_e4m3")),
    "layers skipped by KV quantization": Field(
        "kv_cache_dtype_skip_layers", _set("cache_config.kv_cache_dtype_skip_layers", ["0"])
    ),
    "Mamba state dtype": Field(
        "mamba_cache_dtypes",
        _set_other("cache_config.mamba_ssm_cache_dtype", "float32", "float16"),
    ),
    "quantization": Field("quantization", _set("model_config.quantization", "fp8")),
    "online quantization config": Field(
        "quantization_config",
        _set("model_config.quantization_config", {"linear": {"method": "fp8"}}),
    ),
    "HF config: rope scaling": Field(
        "hf_config",
        _hf("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
    ),
    "HF config: head size": Field("hf_config", _hf("head_dim", 32)),
    "HF config: KV heads": Field("hf_config", _hf("num_key_value_heads", 2)),
    "sliding window disabled": Field(
        "disable_sliding_window", _set("model_config.disable_sliding_window", True)
    ),
    "draft model": Field("draft_model", _draft("draft_model", model=True)),
    "hash algorithm": Field(
        "hash_algo", _set("cache_config.prefix_caching_hash_algo", "sha256_cbor")
    ),
    "hash seed: PYTHONHASHSEED set": Field("hash_root", _env("PYTHONHASHSEED", "4242")),
    "hash seed: another PYTHONHASHSEED": Field(
        "hash_root", _env("PYTHONHASHSEED", "4243"), setup=_env("PYTHONHASHSEED", "4242")
    ),
    "hash seed under xxhash": Field(
        "hash_root",
        _env("PYTHONHASHSEED", "4243"),
        setup=_both(
            _set("cache_config.prefix_caching_hash_algo", "xxhash"),
            _env("PYTHONHASHSEED", "4242"),
        ),
    ),
    "hash scheme version": Field("hash_scheme", _constant("HASH_SCHEME", "vllm-2")),
    "hash lookahead tokens": Field(
        "hash_lookahead_tokens", _constant("hash_lookahead_tokens", lambda config: 1)
    ),
    "tokens per hash": Field("tokens_per_hash", _edit("cache", tokens_per_hash=8)),
    "tokens per block": Field("groups", _block_size(32)),
    "blocks per chunk": Field("blocks_per_chunk", _extra(blocks_per_chunk=2)),
    "layer names": Field("groups", _attention(_full(), layer="model.layers.1.self_attn.attn")),
    "attention kind": Field("groups", _attention(_window(64))),
    "sliding window size": Field("groups", _attention(_window(128)), setup=_attention(_window(64))),
    "tensor-parallel size": Field("tp_pp_pcp_dcp", _parallel(tensor_parallel_size=2)),
    "pipeline-parallel size": Field("tp_pp_pcp_dcp", _parallel(pipeline_parallel_size=2)),
    "prefill context-parallel size": Field(
        "tp_pp_pcp_dcp", _parallel(prefill_context_parallel_size=2)
    ),
    "decode context-parallel size": Field(
        "tp_pp_pcp_dcp", _parallel(decode_context_parallel_size=2)
    ),
    "world size": Field("world_size", _edit("parallel", world_size=2)),
    "context-parallel interleave": Field(
        "cp_interleave", _set("parallel_config.cp_kv_cache_interleave_size", 16)
    ),
    "replicated layout": Field("replicated_layout", _edit(replicated_layout=True)),
    "canonical layout": Field("canonical_layout", _extra(canonical_layout=True)),
    "canonical format": Field(
        "canonical_format",
        _set("cache_config.kv_cache_layout", "LBHNC"),
        setup=_extra(canonical_layout=True),
    ),
    "KV-cache layout": Field("kv_cache_layout", _set("cache_config.kv_cache_layout", "LBHNC")),
    "KV bytes per chunk": Field("kv_bytes_per_chunk", _edit(worker_kv_bytes_per_block=8192)),
    "host slot layout version": Field("host_layout", _constant("HOST_LAYOUT", "vllm-region-2")),
}


@pytest.fixture(params=sorted(FIELDS))
def field(request: pytest.FixtureRequest) -> Field:
    return FIELDS[request.param]


def _pair(base: Any, patch: pytest.MonkeyPatch, field: Field) -> tuple[Any, Any]:
    """The namespaces of two engines equal but for ``field``."""
    a, b = _engine(base, patch), _engine(base, patch)
    field.setup(a)
    ns_a = a.namespace()
    field.setup(b)
    field.change(b)
    return ns_a, b.namespace()


def test_each_field_gives_a_fresh_namespace(
    base: Any, monkeypatch: pytest.MonkeyPatch, field: Field
) -> None:
    ns_a, ns_b = _pair(base, monkeypatch, field)
    assert ns_a[field.key] != ns_b[field.key]
    assert namespace_digest(ns_a) != namespace_digest(ns_b)


def test_a_tier_opened_with_another_namespace_finds_none_of_the_old_blocks(
    base: Any, monkeypatch: pytest.MonkeyPatch, field: Field, tmp_path: Path
) -> None:
    ns_a, ns_b = _pair(base, monkeypatch, field)
    host = MemoryHostBuffer(4, 4096)
    for slot in range(4):
        host.slot_view(slot)[:] = bytes([slot + 1]) * 4096
    old = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=ns_a)
    new = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=ns_b)
    try:
        assert run(old, JobKind.PUT, [1, 2]).success
        assert run(old, JobKind.PROBE, [1, 2]).found == frozenset(old.keys())
        assert new.keys() == []
        assert run(new, JobKind.PROBE, [1, 2]).found == frozenset()
        assert not run(new, JobKind.GET, [1, 2], [2, 3]).success
        assert bytes(host.slot_view(2)) == bytes([3]) * 4096  # nothing was loaded
    finally:
        old.close()
        new.close()


def test_equal_configurations_share_one_namespace_and_its_blocks(
    model_dir: Path, base: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    other = vllm_config(model_dir, dict(EXTRA), "OffloadingConnector")  # another engine
    other.cache_config.kv_cache_layout = "LBNHC"
    mine, theirs = _engine(base, monkeypatch), Engine(other, kv_cache_config(), monkeypatch)
    assert mine.offloading().engine_id != theirs.offloading().engine_id
    assert mine.namespace() == theirs.namespace()
    host = MemoryHostBuffer(4, 4096)
    host.slot_view(0)[:] = b"\x07" * 4096
    first = FsspecTierStore(host, str(tmp_path), capacity_bytes=1 << 20, namespace=mine.namespace())
    second = FsspecTierStore(
        host, str(tmp_path), capacity_bytes=1 << 20, namespace=theirs.namespace()
    )
    try:
        assert run(first, JobKind.PUT, [1], [0]).success
        assert run(second, JobKind.PROBE, [1]).found == frozenset(first.keys())
        assert run(second, JobKind.GET, [1], [3]).success
        assert bytes(host.slot_view(3)) == b"\x07" * 4096
    finally:
        first.close()
        second.close()


_DIGEST_IN_A_PROCESS = """
import sys, warnings
warnings.simplefilter("ignore")
from pathlib import Path
from tests.vllm.test_namespace import EXTRA, Engine
from tests.vllm.scheduler import kv_cache_config, vllm_config
from kvhex.adapters.storage.format import namespace_digest
config = vllm_config(Path(sys.argv[1]), dict(EXTRA), "OffloadingConnector")
config.cache_config.kv_cache_layout = "LBNHC"
print(namespace_digest(Engine(config, kv_cache_config(), None).namespace()))
"""


def test_the_digest_is_the_same_in_another_process(
    model_dir: Path, base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the child's str hashing is seeded at random (no PYTHONHASHSEED), unlike this process's
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    child = subprocess.run(
        [sys.executable, "-c", _DIGEST_IN_A_PROCESS, str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    digest = child.stdout.strip().splitlines()[-1]
    assert digest == namespace_digest(_engine(base, monkeypatch).namespace())


def test_a_seed_drawn_per_process_gives_one_namespace_that_no_process_can_hit(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, again = _engine(base, monkeypatch), _engine(base, monkeypatch)
    for e in (first, again):
        e.vllm.cache_config.prefix_caching_hash_algo = "xxhash"
    assert first.namespace()["hash_root"] == RANDOM_HASH_ROOT
    assert first.namespace() == again.namespace()  # one directory, however often it restarts
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    assert again.namespace()["hash_root"] != RANDOM_HASH_ROOT


def test_n_gram_drafting_owns_no_kv_and_keeps_the_namespace(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, drafting = _engine(base, monkeypatch), _engine(base, monkeypatch)
    _draft("ngram", model=False)(drafting)
    assert drafting.namespace() == plain.namespace()


def test_what_the_namespace_records_reads_as_intended(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = _engine(base, monkeypatch).namespace()
    assert ns["engine"] == "vllm"
    assert ns["hash_algo"] == "sha256"
    assert ns["groups"] == [[0, BLOCK, [LAYER], "full_attention", None]]
    assert ns["tp_pp_pcp_dcp"] == [1, 1, 1, 1]
    assert ns["kv_cache_dtype"] == ns["model_dtype"] == "float16"
    assert "unshared" not in ns
    json.dumps(ns)  # config.json records it as it is


# -- through vLLM's connector --------------------------------------------------------------


def _tier_configs(root: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(root.glob("*/config.json"))]


@pytest.mark.parametrize("spec_name", ["KvhexOffloadingSpec", "TieringOffloadingSpec"])
def test_the_spec_and_the_secondary_tier_find_the_connectors_configs(
    spec_name: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    register()
    root = tmp_path / "tier"
    tier: dict[str, Any] = (
        {"type": "fs", "root_dir": str(root)}
        if spec_name == "KvhexOffloadingSpec"
        else {
            "type": "KvhexSecondaryTier",
            "tier": "fsspec",
            "url": str(root),
            "capacity_bytes": 1 << 24,
        }
    )
    extra = {"spec_name": spec_name, "cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}
    connector = scheduler_connector(model_dir, copy.deepcopy(extra), "OffloadingConnector")
    try:
        (recorded,) = _tier_configs(root)
    finally:
        connector.shutdown()
    expected = Engine(
        vllm_config(model_dir, copy.deepcopy(extra), "OffloadingConnector"),
        kv_cache_config(),
        monkeypatch,
    )
    namespace = expected.namespace()
    assert "unshared" not in recorded
    assert recorded == {
        **namespace,
        "slot_bytes": namespace["kv_bytes_per_chunk"],
        "layout_version": LAYOUT_VERSION,
    }


def test_without_a_connector_the_namespace_is_this_processs_own(
    base: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = _engine(base, monkeypatch)
    config = e.offloading()
    alone = namespace_of(config, 4096)
    assert alone["unshared"] == namespace_of(config, 4096)["unshared"]
    assert namespace_digest(alone) != namespace_digest(e.namespace())
