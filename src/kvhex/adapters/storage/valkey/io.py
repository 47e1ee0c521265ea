"""``ValkeyIo``: one Valkey key per block, the
:class:`~kvhex.adapters.storage.block_io.BlockIo` of the Valkey tier.

Keys, under the tier's prefix and the namespace digest (what makes blocks compatible)::

    PREFIX/<namespace digest>/config.json   the namespace's configuration, recorded
    PREFIX/<namespace digest>/<key hex>     a whole block: header area, then payload

Values are kvhex's block format (:mod:`kvhex.adapters.storage.format`): every read checks
the header names the key and the payload's XXH3 checksum, so a damaged or foreign value is
never served. No key carries a hash tag: a namespace's blocks spread over every slot of a
cluster, and every command names one key (no cross-slot ``MGET``/``DEL``); a job's commands
go out as one non-transactional pipeline, which valkey-py's cluster client splits per node.
A block's ``SET`` sends its header, made (checksum included) as it goes out, then the host
slot itself, never copied; its ``GET`` is received into one buffer, whose payload is copied
into the slot and verified (:mod:`._client`).

The server, not this instance, is the truth about what exists: other instances share the
namespace, and a server with a ``maxmemory-policy`` evicts on its own, so ``exclusive`` is
false and the tier checks what its index lists against the server (a get or probe that
finds a block gone drops and announces it). A namespace whose ``config.json`` key vanished
with every block (a ``FLUSHALL``, a server replaced empty) raises
:class:`~kvhex.adapters.storage.block_io.StoreLost`: the tier announces every block gone. One
whose ``config.json`` alone went (a server evicting it as any key, a node of a cluster
replaced empty) gets it back, and the tier drops what a listing of the namespace lacks
(:class:`~kvhex.adapters.storage.block_io.NamespaceRecord`).

Threads: every method runs on the tier's IO threads, several at once; valkey-py's clients
take a connection from their pool per command or pipeline.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Sequence
from typing import Any

from kvhex.adapters.storage.block_io import (
    Inventory,
    Located,
    NamespaceConflict,
    NamespaceRecord,
    Records,
)
from kvhex.adapters.storage.format import (
    CONFIG,
    HEADER_AREA,
    Verdict,
    holds_key,
    pack_header,
    verify,
)
from kvhex.adapters.storage.records import RecordOpener, header_record
from kvhex.adapters.storage.valkey._client import Parts, safe_text
from kvhex.domain.keys import OffloadKey
from kvhex.domain.locator import ChunkRecord

_GLOB_SPECIAL = frozenset("*?[]\\")


class ValkeyError(OSError):
    """A Valkey command failed at run time (a node down, a timeout, a server error); the
    message names the cause, never a credential."""


def _glob_escaped(text: str) -> str:
    return "".join(f"\\{c}" if c in _GLOB_SPECIAL else c for c in text)


class ValkeyIo:
    """Blocks of one namespace under ``base`` (``PREFIX/<digest>``) of a Valkey server or
    cluster. ``config.json`` is written or compared and the namespace listed at construction.

    Args:
        client: a connected valkey-py client (``Valkey`` or ``ValkeyCluster``).
        base: the namespace's key prefix.
        config: what ``config.json`` must record.
        where: the servers, named in errors (no credentials).

    Raises:
        NamespaceConflict: ``config.json`` records another configuration.
        Exception: what the client raised (the tier names it).
    """

    exclusive = False
    """Other instances and the server's own eviction remove blocks: the server is the truth."""
    records_by_request = True
    """A block's chunk record costs a ``GETRANGE``."""

    def __init__(
        self,
        client: Any,
        base: str,
        *,
        config: bytes,
        where: str,
        records_opener: RecordOpener | None = None,
    ) -> None:
        self.client = client
        self._open_record = records_opener
        self.base = base
        self.where = where
        self.config = config
        self._config_key = f"{base}/{CONFIG}".encode()
        self._record = NamespaceRecord(
            self._namespace_intact, self._listed_checked, f"{where}/{base}"
        )
        self._prefix = f"{base}/".encode()
        recorded = self._write_config()
        if recorded is not None and recorded != config:
            raise NamespaceConflict(recorded)
        self._inventory = Inventory(self._listed(), 0)

    def name(self, key: OffloadKey) -> bytes:
        """The Valkey key of ``key``'s block."""
        return self._prefix + key.hex().encode()

    # -- start-up ------------------------------------------------------------------------
    def _write_config(self) -> bytes | None:
        """Record the configuration unless one is there (``SET NX``): the one there, or
        ``None`` when this instance wrote it."""
        if self.client.set(self._config_key, self.config, nx=True):
            return None
        recorded = self.client.get(self._config_key)
        return None if recorded is None else bytes(recorded)

    def _listed(self) -> list[OffloadKey]:
        return [k for k in (self.key_of(n) for n in self._scan()) if k is not None]

    def _scan(self) -> Iterable[bytes]:
        match = _glob_escaped(self._prefix.decode()) + "*"
        yield from self.client.scan_iter(match=match, count=1000)

    @property
    def prefix(self) -> bytes:
        """What every Valkey key of the namespace starts with (``PREFIX/<digest>/``)."""
        return self._prefix

    def key_of(self, name: bytes) -> OffloadKey | None:
        """The block key a Valkey key ``name`` of the namespace names; ``None`` for
        ``config.json`` or a foreign key."""
        stem = name[len(self._prefix) :]
        try:
            key = bytes.fromhex(stem.decode())
        except (UnicodeDecodeError, ValueError):
            return None  # config.json, or a foreign key
        return OffloadKey(key) if len(key) > 4 and key.hex().encode() == stem else None

    def inventory(self) -> Inventory:
        """The blocks listed at start-up (in the server's scan order: Valkey keeps no write
        time to sort by)."""
        return self._inventory

    # -- BlockIo -------------------------------------------------------------------------
    def write_many(
        self,
        items: Sequence[tuple[OffloadKey, memoryview]],
        evict: Sequence[OffloadKey] = (),
        records: Records | None = None,
    ) -> list[str | None]:
        """Delete the victims and ``SET`` each block, in one pipeline; per item ``None`` or
        why it was not stored (a failed item's key is deleted where the server still
        answers)."""
        pipe = self.client.pipeline(transaction=False)
        for key in evict:
            pipe.delete(self.name(key))
        for key, view in items:
            record = records.get(key, b"") if records else b""
            # one value: the header, made as it is sent, then the slot itself (_client.Parts)
            head = functools.partial(pack_header, key, view, None, record)
            pipe.set(self.name(key), Parts(HEADER_AREA, head, view))
        try:
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            error = self._error(exc)
            self._forget([k for k, _ in items])
            return [str(error)] * len(items)
        errors = [
            None if not isinstance(r, BaseException) else f"{type(r).__name__}: {safe_text(r)}"
            for r in replies[len(evict) :]
        ]
        failed = [k for (k, _), e in zip(items, errors, strict=True) if e is not None]
        if failed:
            self._forget(failed)
            self._record.check()
        return errors

    def read_many(
        self, items: Sequence[tuple[OffloadKey, memoryview]], *, up_to: bool = False
    ) -> list[Verdict]:
        """``GET`` every block in one pipeline, copy each payload into its view and verify
        it.

        Raises:
            StoreLost: the namespace is gone.
            ValkeyError: the server failed; the message names the cause.
        """
        if not items:
            return []
        values = self._run([("get", self.name(k)) for k, _ in items])
        verdicts = []
        for (key, view), value in zip(items, values, strict=True):
            if value is None:
                verdicts.append(Verdict.MISSING)
                continue
            size = len(value) - HEADER_AREA
            if size != len(view) and not (up_to and 0 < size < len(view)):
                verdicts.append(
                    Verdict.CORRUPT if holds_key(value[:HEADER_AREA], key) else Verdict.MISSING
                )
                continue
            payload = memoryview(value)[HEADER_AREA:]
            view[:size] = payload
            verdicts.append(verify(value[:HEADER_AREA], key, payload))
        if Verdict.MISSING in verdicts:
            self._record.check()
        return verdicts

    def exists_many(self, keys: Sequence[OffloadKey]) -> set[OffloadKey]:
        """Which of ``keys`` have a block (one ``EXISTS`` per key, one pipeline).

        Raises:
            StoreLost: the namespace is gone.
            ValkeyError: the server failed.
        """
        if not keys:
            return set()
        found = self._run([("exists", self.name(k)) for k in keys])
        there = {k for k, n in zip(keys, found, strict=True) if n}
        if len(there) < len(keys):
            self._record.check()
        return there

    def remove_many(self, keys: Sequence[OffloadKey]) -> None:
        """``DEL`` each key's block (one pipeline; absent ones are ignored).

        Raises:
            ValkeyError: the server failed.
        """
        if keys:
            self._run([("delete", self.name(k)) for k in keys])

    def read_records(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, ChunkRecord | None]:
        """The chunk record in each key's block: a ``GETRANGE`` of its header area per key,
        one pipeline. Keys without a block (or whose value is not theirs) are left out.

        Raises:
            ValkeyError: the server failed.
        """
        if not keys:
            return {}
        headers = self._run([("getrange", self.name(k), 0, HEADER_AREA - 1) for k in keys])
        return {
            key: header_record(header, key, self._open_record)
            for key, header in zip(keys, headers, strict=True)
            if header and holds_key(header, key)
        }

    def peer_keys(self) -> set[OffloadKey]:
        """Every block key under the namespace now (a ``SCAN`` of every primary).

        Raises:
            ValkeyError: the server failed.
        """
        try:
            return set(self._listed())
        except Exception as exc:
            raise self._error(exc) from exc

    def location(self, key: OffloadKey) -> Located:
        """The Valkey key of ``key``'s block; its header is at offset 0."""
        return self.name(key).decode(), 0

    def close(self) -> None:
        """Close the client's connections."""
        self.client.close()

    # -- helpers -------------------------------------------------------------------------
    def _run(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` (method name, arguments) as one pipeline; every reply, or the
        first failure raised.

        Raises:
            ValkeyError: a command or the connection failed.
        """
        pipe = self.client.pipeline(transaction=False)
        for name, *args in commands:
            getattr(pipe, name)(*args)
        try:
            replies: list[Any] = pipe.execute(raise_on_error=True)
        except Exception as exc:
            raise self._error(exc) from exc
        return replies

    def _forget(self, keys: Sequence[OffloadKey]) -> None:
        """Best effort: delete the blocks of failed writes (one that landed after all must
        not be found); where the server does not answer, nothing more can be done now."""
        with contextlib.suppress(ValkeyError):
            self._run([("delete", self.name(k)) for k in keys])

    def take_listings(self) -> list[frozenset[OffloadKey]]:
        """(Scheduler thread.) Listings taken after ``config.json`` alone had gone
        (:class:`~kvhex.adapters.storage.block_io.Relisting`)."""
        return self._record.take_listings()

    def _listed_checked(self) -> list[OffloadKey]:
        try:
            return self._listed()
        except Exception as exc:
            raise self._error(exc) from exc

    def _namespace_intact(self) -> bool:
        """Whether ``config.json`` is still there; a namespace found emptied gets it back,
        so later puts land in a valid namespace.

        Raises:
            ValkeyError: the server failed.
        """
        try:
            return not self.client.set(self._config_key, self.config, nx=True)
        except Exception as exc:
            raise self._error(exc) from exc

    def _error(self, exc: BaseException) -> ValkeyError:
        return ValkeyError(f"valkey {self.where}: {type(exc).__name__}: {safe_text(exc)}")
