"""The shared SQLite index of a local file tier: which slab slot holds which key.

One table, ``blocks (key, slab, slot, stored)``, keyed by (key, slab): every live instance on
a root publishes the blocks of the slabs it owns there, and finds other instances' blocks
through it. What the slab IO keeps true in every crash state (so a restart or fsck never
finds a row whose slot holds something else): a row is inserted only after its block is
written, and deleted before its slot is overwritten or unmarked.

Also here: the names a local namespace directory holds (:data:`INDEX`, :data:`SLAB_DIR`,
:data:`KNOWN_ENTRIES`, :func:`is_slab_id`), which the slab IO and ``kvhex fsck`` share.

Threads: one connection, used under one lock; SQLite itself serializes writers across
processes (WAL mode).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Sequence

from kvhex.adapters.storage.format import CONFIG
from kvhex.domain.keys import OffloadKey

__all__ = ["INDEX", "KNOWN_ENTRIES", "SLAB_DIR", "Row", "SlabIndex", "is_slab_id", "read_rows"]

INDEX = "index.sqlite"
SLAB_DIR = "slabs"
KNOWN_ENTRIES = frozenset({CONFIG, INDEX, INDEX + "-wal", INDEX + "-shm", SLAB_DIR})
"""What a local namespace directory holds; anything else in it is foreign."""
_SQL_VARS = 500  # keys per ``IN (...)`` query, under SQLite's variable limit
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS blocks (key BLOB NOT NULL, slab TEXT NOT NULL, "
    "slot INTEGER NOT NULL, stored REAL NOT NULL, PRIMARY KEY (key, slab)) WITHOUT ROWID"
)

Row = tuple[OffloadKey, str, int, float]
"""One block: key, slab id, slot, the time it was stored."""


def is_slab_id(stem: str) -> bool:
    """True for a slab file's name stem: 32 lower-case hex digits."""
    return len(stem) == 32 and all(c in "0123456789abcdef" for c in stem)


def read_rows(db: sqlite3.Connection) -> list[Row]:
    """Every row of an index, oldest first.

    Raises:
        sqlite3.DatabaseError: the index is unreadable.
    """
    rows = db.execute("SELECT key, slab, slot, stored FROM blocks ORDER BY stored").fetchall()
    return [(OffloadKey(bytes(k)), str(slab), int(slot), float(t)) for k, slab, slot, t in rows]


class SlabIndex:
    """The index of one namespace directory ``root``, opened (created ``0600``) at
    construction. An unreadable index (a power loss without ``fsync``, a damaged disk) is
    replaced by an empty one and ``rebuilt`` is set: the caller recovers its blocks from the
    slab headers.

    Raises:
        sqlite3.Error, OSError: the index cannot be created.
    """

    def __init__(self, root: str, *, fsync: bool) -> None:
        self.path = os.path.join(root, INDEX)
        self.fsync = fsync
        self._lock = threading.Lock()
        self.rebuilt = False
        try:
            self._db = self._open()
        except sqlite3.DatabaseError:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path + suffix)
            self._db = self._open()
            self.rebuilt = True

    def _open(self) -> sqlite3.Connection:
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))  # SQLite's files inherit it
        db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # without fsync, SQLite need not sync either: a process crash keeps every committed
            # transaction (the WAL is in the page cache); a power loss may cost the index, which
            # is then rebuilt from the slab headers
            db.execute(f"PRAGMA synchronous={'NORMAL' if self.fsync else 'OFF'}")
            db.execute(_SCHEMA)
            db.execute("SELECT count(*) FROM blocks").fetchall()  # reads every page header
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def rows(self) -> list[Row]:
        """Every row, oldest first (start-up)."""
        with self._lock:
            return read_rows(self._db)

    def commit(
        self, deletes: Sequence[tuple[OffloadKey, str]], inserts: Sequence[Row] = ()
    ) -> None:
        """Delete the (key, slab) rows ``deletes`` and insert ``inserts``, in one transaction.

        Raises:
            sqlite3.Error: the transaction failed; nothing of it is published.
        """
        if not deletes and not inserts:
            return
        with self._lock:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                if deletes:
                    db.executemany("DELETE FROM blocks WHERE key = ? AND slab = ?", deletes)
                if inserts:
                    db.executemany("INSERT OR REPLACE INTO blocks VALUES (?, ?, ?, ?)", inserts)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def lookup(self, keys: Sequence[OffloadKey]) -> dict[OffloadKey, tuple[str, int]]:
        """Where instances hold ``keys`` (one place each)."""
        found: dict[OffloadKey, tuple[str, int]] = {}
        for start in range(0, len(keys), _SQL_VARS):
            batch = keys[start : start + _SQL_VARS]
            marks = ",".join("?" * len(batch))
            sql = f"SELECT key, slab, slot FROM blocks WHERE key IN ({marks})"
            with self._lock:
                rows = self._db.execute(sql, batch).fetchall()
            for key, slab, slot in rows:
                found.setdefault(OffloadKey(bytes(key)), (str(slab), int(slot)))
        return found

    def close(self) -> None:
        """Close the connection. Idempotent."""
        with self._lock:
            self._db.close()
