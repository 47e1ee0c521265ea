"""torch adapters: a host buffer (pinned, optionally in named shared memory) and a
``BlockTransfer`` between device KV caches and its slots, on CUDA or on the CPU.

Needs the ``torch`` extra (``pip install 'kvhex[torch]'``). See docs/transfers.md.
"""

from kvhex.adapters.torch.host import TorchHostBuffer, shm_path
from kvhex.adapters.torch.transfer import (
    DEFAULT_STAGING_BYTES,
    MAX_COPY_THREADS,
    TensorHostBuffer,
    TorchBlockTransfer,
)

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "MAX_COPY_THREADS",
    "TensorHostBuffer",
    "TorchBlockTransfer",
    "TorchHostBuffer",
    "shm_path",
]
