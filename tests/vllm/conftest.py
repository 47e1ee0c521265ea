"""vLLM's modules import once, here, with their import-time deprecation warnings silenced.

kvhex's tests turn every warning into an error; vLLM 0.33 and torch emit a few while their
modules load (torch.jit deprecations, compile decorators). Importing the modules these tests
use once up front keeps that noise out of the tests, which still fail on any warning they
cause themselves. Without vLLM installed nothing is imported and the tests skip.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

# the S3 server with users and credentials (test_settings' obj tier) is the storage tests' own;
# the example transfer, installed as a user would, the plugin tests' own
from tests.adapters.conftest import s3_auth_server  # noqa: F401
from tests.plugins.conftest import counting_site  # noqa: F401

# a private vLLM cache: another vLLM version sharing ~/.cache/vllm breaks model inspection
if "VLLM_CACHE_ROOT" not in os.environ:
    os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="kvhex-vllm-cache-")
    atexit.register(functools.partial(shutil.rmtree, os.environ["VLLM_CACHE_ROOT"], True))

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.distributed.kv_events
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
        import vllm.v1.kv_offload.cpu.manager
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama of the engine tests (tests/vllm/engine.py), made once."""
    from tests.vllm.engine import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine core in this process: it loads in seconds and its state is inspectable."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="session")
def baseline(model: Path) -> dict[int, list[int]]:
    """Greedy tokens of the engine tests' turn prompts (``engine.prompt(t)``, t in 0..3),
    recomputed from scratch: no offloading and no prefix cache."""
    from tests.vllm.engine import generate, offline_engine, prompt

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with offline_engine(model, enable_prefix_caching=False) as llm:
            return {t: generate(llm, prompt(t))[0] for t in range(4)}
