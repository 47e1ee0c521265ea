"""Optional abilities a port's implementation may have, checked by capability (``isinstance``),
never by ``getattr``: a class has one by having its members, with no base class to inherit.

* ``Closeable``: releases what it holds (a host buffer's memory, once every tier closed).
* ``TierHealth``: a ``TierStore`` that counts the damage it found (corrupt and lost blocks,
  IO errors), so operators see it in the tier's stats and metrics.
* ``TenantRefusals``: a ``TierStore`` whose keyed codec refused blocks to requests of
  another tenant (or master key): counted, as a router or an operator would want to know.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Closeable(Protocol):
    """Holds something to release: a ``HostBuffer`` whose memory goes back when the engine
    that borrowed it shut down cleanly."""

    def close(self) -> None:
        """Release what is held. Called once by the owner (the tiering manager, after every
        tier closed) on the scheduler thread; may block briefly. Idempotent. Raises nothing
        a caller could handle (a failure is a bug of the implementation)."""
        ...


@runtime_checkable
class TierHealth(Protocol):
    """Optional for a ``TierStore``: cumulative counts of the damage it met. Read on the
    scheduler thread (stats) or a metrics scrape: plain attribute reads, never IO. Each
    count only grows; the blocks counted are also announced ``Removed`` by the tier."""

    @property
    def corrupt_blocks(self) -> int:
        """Blocks a get found damaged (failed integrity check, truncated) and dropped."""
        ...

    @property
    def lost_blocks(self) -> int:
        """Blocks dropped as unreadable other than by eviction or delete: missing or damaged
        at a get (the corrupt ones are counted here too), missing at a probe, not written by
        a put that had their room, or gone with the whole storage."""
        ...

    @property
    def io_errors(self) -> int:
        """Storage operations that failed (a write, a removal) outside a job's per-block
        outcome."""
        ...


@runtime_checkable
class TenantRefusals(Protocol):
    """Optional for a ``TierStore`` with a keyed codec (``aes-gcm``): how many blocks a get
    found sealed for another tenant than the asking request's (or another master key) and
    refused. Such a block is a miss for that request and stays; many of them mean tenants
    whose keys collide, or instances configured with different master keys. A plain
    attribute read on the scheduler thread or a metrics scrape; it only grows."""

    @property
    def refused_blocks(self) -> int:
        """Blocks refused to a request, since start-up."""
        ...
