"""The stack ``kvhex run`` drives: host buffer, device KV cache, transfer and engine, built
from a ``KvhexConfig`` and closed in reverse order.

The transfer is the ``kvhex.transfers`` entry point ``[run] transfer`` (``torch`` by
default), found through the registry exactly like a tier: a third party's is installed and
named the same way. ``kvhex run``'s device KV cache is torch tensors, so a transfer it drives
takes them: it is called as ``factory(host, kv_caches, tensor_groups=..., blocks_per_chunk=...,
**[run] transfer_options)`` with a ``TensorHostBuffer`` (``TorchHostBuffer``) and one uint8
``(device_blocks, page_bytes)`` tensor per layer, all in KV group 0 (``TorchBlockTransfer``'s
signature). kvhex's ``memory`` transfer copies between ``bytearray`` caches, not tensors, and
is refused at ``$.run.transfer``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

import attrs
import structlog
import torch

from kvhex.adapters.torch import TorchHostBuffer
from kvhex.bootstrap import build_engine
from kvhex.bootstrap.entries import EntryPaths, Plan
from kvhex.config.model import KvhexConfig, RunConfig
from kvhex.domain.geometry import KvGeometry, KvGroup
from kvhex.domain.slot_layout import SlotLayout
from kvhex.errors import ConfigError, PluginError, TransferError
from kvhex.plugins import TRANSFERS, Registry
from kvhex.ports.transfer import BlockTransfer
from kvhex.sim.driver import Replay, RunReport, run_all
from kvhex.sim.workload import Request

log = structlog.get_logger(__name__)

RUN_HASH_SCHEME = "kvhex-sim-1"
"""What goes into the block hashes of ``kvhex run``'s requests (``sim.workload.context``):
SHA-256 chained from a zero root (no seed) over each hash block's token ids (32-bit
little-endian) and the ``repr`` of its extra keys (LoRA name, cache salt on the first block,
multimodal inputs). Bump it when that changes: the old blocks are then never met."""

RUN_HOST_LAYOUT = "kvhex-slot-1"
"""How ``kvhex run`` lays a chunk into a host slot (``SlotLayout``, torch transfer): one region
per layer in layer order, each the chunk's ``blocks_per_chunk`` pages back to back."""


def run_namespace(run: RunConfig) -> dict[str, Any]:
    """What makes ``kvhex run``'s stored blocks interchangeable (kvhex tiers share blocks only
    between equal namespaces), under the vLLM adapter's names where the concept is shared
    (``kvhex.vllm.spec.namespace_of``). A block's key is its tokens hashed
    ``tokens_per_block`` at a time; its bytes come from ``seed`` (each layer's base page), its
    layer, its place in the chunk and the page size (``sim.driver``). The request count,
    device blocks, device and transfer change neither (every transfer lays a chunk into its
    slot by ``SlotLayout``: ``RUN_HOST_LAYOUT``)."""
    layers = [f"layer.{i}" for i in range(run.layers)]
    return {
        "engine": "kvhex-run",
        "hash_scheme": RUN_HASH_SCHEME,
        "hash_algo": "sha256",
        "model": "kvhex-run-synthetic",
        "seed": run.seed,
        "kv_cache_dtype": "uint8",
        "tokens_per_hash": run.tokens_per_block,
        "blocks_per_chunk": run.blocks_per_chunk,
        "groups": [[0, run.tokens_per_block, layers, "full_attention", None]],
        "page_bytes": run.page_bytes,
        "world_size": 1,
        "host_layout": RUN_HOST_LAYOUT,
        "kv_bytes_per_chunk": run.layers * run.page_bytes * run.blocks_per_chunk,
    }


_TRANSFER_PATHS = EntryPaths(
    "$.run.transfer",
    "$.run.transfer",
    "$.run.transfer_options",
    keys={"tensor_groups": "$.run.layers", "blocks_per_chunk": "$.run.blocks_per_chunk"},
)
"""Where the run's transfer is configured, for the errors naming it (what the run passes the
factory itself comes from ``[run]``'s geometry)."""

_GIVEN = ("tensor_groups", "blocks_per_chunk")
"""Keyword arguments the run passes the transfer's factory itself."""


def _transfer_plan(run: RunConfig, registry: Registry, *, source: str | None = None) -> Plan:
    """The transfer ``run.transfer`` resolved and its options checked, nothing built: its
    host buffer and KV tensors are added by ``_build_transfer``.

    Raises:
        ConfigError: at ``$.run.transfer``: an unknown name (listing the installed ones) or
            an entry point that cannot be loaded (with its install hint); at
            ``$.run.transfer_options.<key>``: an option the run passes itself.
    """
    paths = _TRANSFER_PATHS
    names = registry.names(TRANSFERS)
    if run.transfer not in names:
        available = ", ".join(names) or "none installed"
        problem = f"unknown transfer {run.transfer!r}; available: {available}"
        raise ConfigError([(paths.plugin, problem)], source)
    taken = [
        (f"{paths.options}.{key}", "set by kvhex run from [run] (layers, blocks_per_chunk)")
        for key in run.transfer_options
        if key in _GIVEN
    ]
    if taken:
        raise ConfigError(taken, source)
    try:
        factory = registry.load(TRANSFERS, run.transfer)
    except PluginError as exc:
        raise ConfigError([(paths.plugin, str(exc))], source) from exc
    given = {"tensor_groups": [0] * run.layers, "blocks_per_chunk": [run.blocks_per_chunk]}
    kwargs = {**given, **run.transfer_options}
    return Plan("transfer", run.transfer, BlockTransfer, factory, (), kwargs, paths, ())


def _build_transfer(
    plan: Plan, host: TorchHostBuffer, kv_caches: list[torch.Tensor], *, source: str | None
) -> BlockTransfer:
    """``plan``'s factory called with ``host`` and ``kv_caches`` first.

    Raises:
        ConfigError: what the factory refuses, at the option its error names
            (``$.run.transfer_options.<key>``, or ``[run]``'s geometry for what the run
            passes), else at ``$.run.transfer``; an object that is not a ``BlockTransfer``.
    """
    plan = attrs.evolve(plan, args=(host, kv_caches))
    try:
        transfer: BlockTransfer = plan.build(source)
    except TransferError as exc:  # a transfer's own check of its arguments
        field = exc.field
        where = plan.paths.entry if field not in plan.kwargs else plan.paths.option(str(field))
        raise ConfigError([(where, f"rejected by transfer {plan.name!r}: {exc}")], source) from exc
    return transfer


class Stack:
    """Everything one run needs, as a context manager.

    Args:
        config: what to build and run.
        source: where ``config`` came from, named by its errors.
        registry: where tiers, sinks, policies and the transfer are found (default: the
            installed entry points).

    Raises:
        ConfigError: at the key to correct, before anything is left built.
    """

    def __init__(
        self,
        config: KvhexConfig,
        *,
        source: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        run = config.run
        self.config = config
        registry = Registry.discover() if registry is None else registry
        plan = _transfer_plan(run, registry, source=source)  # before anything is built
        if run.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError(
                [("$.run.device", "cuda requested but no CUDA device is available")], source
            )
        if run.page_bytes % 8:
            raise ConfigError(
                [("$.run.page_bytes", f"must be a multiple of 8, got {run.page_bytes}")], source
            )
        use_cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
        self.device = "cuda" if use_cuda else "cpu"
        group = KvGroup(0, run.tokens_per_block, run.blocks_per_chunk)
        self.geometry = KvGeometry((group,), run.tokens_per_block)
        layout = SlotLayout([run.page_bytes] * run.layers, [0] * run.layers, [run.blocks_per_chunk])
        slots = config.primary.capacity_bytes // layout.slot_bytes
        if slots == 0:
            raise ConfigError(
                [
                    (
                        "$.primary.capacity_bytes",
                        f"{config.primary.capacity_bytes} bytes hold no chunk of "
                        f"{layout.slot_bytes} bytes ({run.layers} layers x {run.page_bytes} "
                        f"bytes x {run.blocks_per_chunk} blocks)",
                    )
                ],
                source,
            )
        namespace = run_namespace(run)
        self._closers: list[Callable[[], None]] = []
        try:
            self.host = TorchHostBuffer(slots, layout.slot_bytes)
            self._closers.append(self.host.close)
            self.engine, stores = build_engine(
                config,
                self.host,
                registry,
                geometry=self.geometry,
                namespace=namespace,
                source=source,
            )
            self._closers.append(self.engine.shutdown)
            self.tier_labels = [
                f"{t.name or t.type} ({s.identity.medium})"
                for t, s in zip(config.tiers, stores, strict=True)
            ]
            self.kv = [
                torch.zeros(
                    (run.device_blocks, run.page_bytes), dtype=torch.uint8, device=self.device
                )
                for _ in range(run.layers)
            ]
            self.transfer = _build_transfer(plan, self.host, self.kv, source=source)
            self._closers.append(self.transfer.close)
        except BaseException:
            self.close()
            raise
        self.replay = Replay(
            self.engine,
            self.transfer,
            self.kv,
            self.geometry,
            seed=run.seed,
            tier_names=[t.name or t.type for t in config.tiers],
        )

    def run(
        self,
        requests: Iterable[Request],
        *,
        duration_s: float | None = None,
        total: int | None = None,
        progress: Callable[[Replay, int, int | None], None] | None = None,
    ) -> RunReport:
        """Replay ``requests``, taking each when its turn comes, and report (``total``: what
        ``progress`` is told the run aims at, ``None`` when it runs until ``duration_s``)."""
        return run_all(self.replay, requests, duration_s=duration_s, total=total, progress=progress)

    def close(self) -> None:
        """Close what was built, last first; keeps going past failures."""
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()
            except Exception as exc:
                log.warning("close_failed", error=repr(exc))

    def __enter__(self) -> Stack:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()
