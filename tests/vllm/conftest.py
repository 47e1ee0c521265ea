"""vLLM's modules import once, here, with their import-time deprecation warnings silenced.

kvhex's tests turn every warning into an error; vLLM 0.33 and torch emit a few while their
modules load (torch.jit deprecations, compile decorators). Importing the modules these tests
use once up front keeps that noise out of the tests, which still fail on any warning they
cause themselves. Without vLLM installed nothing is imported and the tests skip.
"""

from __future__ import annotations

import importlib.util
import warnings

if importlib.util.find_spec("vllm") is not None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.distributed.kv_events
        import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector
        import vllm.v1.kv_offload.cpu.manager
        import vllm.v1.kv_offload.tiering.spec  # noqa: F401
