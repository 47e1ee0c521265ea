"""A JSON-lines event sink: one line per batch, appended to an owner-only file.

Each line is ``{"ts": ..., "data_parallel_rank": ..., "events": [...]}`` with every event as an
object of vLLM's field names plus ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``); byte hashes and digests are hex strings, tuples become arrays.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

from kvhex.domain.events import EventBatch, PublicEvent
from kvhex.errors import ConfigError

__all__ = ["JsonlEventSink", "event_to_json"]


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def event_to_json(event: PublicEvent) -> dict[str, Any]:
    """A JSON-ready dict of one public event."""
    fields = {name: _plain(value) for name, value in event._asdict().items()}
    return {"type": type(event).__name__, **fields}


class JsonlEventSink:
    """Appends batches to ``path`` (created ``0600`` if missing), one JSON line each, flushed
    per batch so a reader (``tail -f``, ``kvhex events``) sees every step."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ConfigError(
                [("$.events.path", f"cannot open {self.path} for writing: {exc.strerror}")]
            ) from exc
        self._file: IO[str] | None = os.fdopen(fd, "a", encoding="utf-8")

    def publish(self, batch: EventBatch) -> None:
        """Write one line."""
        if self._file is None:
            raise RuntimeError("JSONL event sink is closed")
        line = {
            "ts": batch.ts,
            "data_parallel_rank": batch.data_parallel_rank,
            "events": [event_to_json(e) for e in batch.events],
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None
