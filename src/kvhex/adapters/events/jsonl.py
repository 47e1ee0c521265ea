"""A JSON-lines event sink, and the reader ``kvhex events FILE`` uses to judge what it wrote.

Each line is one batch: ``{"seq": ..., "ts": ..., "data_parallel_rank": ..., "events": [...]}``
with every event as an object of vLLM's field names plus ``"type"`` (``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``); byte hashes and digests are hex strings, tuples become
arrays. ``seq`` counts the sink's batches from 0, as the ZMQ sink numbers its messages, and the
data-parallel rank is stamped the same way (the sink's own on batches that carry none).

The file is replaced when the sink opens it (one file, one stream: ``kvhex events FILE`` can
then judge it whole); ``append=True`` keeps what is there and adds to it, and a reader then sees
the sequence start again at 0 where each later writer began.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kvhex.domain.events import EventBatch, PublicEvent
from kvhex.errors import ConfigError


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
    """Writes batches to ``path`` (created ``0600``), one JSON line each, flushed per batch so a
    reader (``tail -f``, ``kvhex events``) sees every step.

    Args:
        path: the file; replaced unless ``append``.
        append: add to the file instead of replacing it.
        data_parallel_rank: stamped on batches that carry none (as the ZMQ sink does).

    Raises:
        ConfigError: the file cannot be opened for writing (the message names it and why).
    """

    def __init__(
        self, path: str | os.PathLike[str], *, append: bool = False, data_parallel_rank: int = 0
    ) -> None:
        self.path = Path(path)
        self.data_parallel_rank = data_parallel_rank
        self._seq = 0
        mode = os.O_APPEND if append else os.O_TRUNC
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
        except OSError as exc:
            why = exc.strerror or str(exc)
            raise ConfigError(
                [("path", f"path {str(self.path)!r}: cannot write it: {why}")]
            ) from exc
        self._file: IO[str] | None = os.fdopen(fd, "a", encoding="utf-8")

    def publish(self, batch: EventBatch) -> None:
        """Write one line."""
        if self._file is None:
            raise RuntimeError("JSONL event sink is closed")
        rank = batch.data_parallel_rank
        line = {
            "seq": self._seq,
            "ts": batch.ts,
            "data_parallel_rank": self.data_parallel_rank if rank is None else rank,
            "events": [event_to_json(e) for e in batch.events],
        }
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()
        self._seq += 1

    def close(self) -> None:
        """Close the file. Idempotent."""
        if self._file is not None:
            self._file.close()
            self._file = None


_HASH_FIELDS = ("block_hashes", "parent_block_hash")


def read_batches(path: str | os.PathLike[str]) -> Iterator[tuple[int, int, Any]]:
    """The batches of a file this sink wrote, one at a time: ``(line number, seq, batch)``
    where ``batch`` is the wire module's ``KVEventBatch`` (hashes back to bytes) or, for a line
    that does not decode, the reason as a string. ``seq`` is the line's own, or its index
    among the batches when it has none (files written before lines carried one).

    Needs msgspec (``kvhex[zmq]``). Raises ``OSError`` when the file cannot be read.
    """
    import msgspec

    from kvhex.adapters.events import wire

    kinds = {"BlockStored": wire.BlockStored, "BlockRemoved": wire.BlockRemoved}
    index = 0
    with open(path, encoding="utf-8") as lines:
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            seq = index
            index += 1
            try:
                raw = json.loads(text)
                if not isinstance(raw, dict) or not isinstance(raw.get("events"), list):
                    raise ValueError("expected an object with an 'events' list")
                if isinstance(raw.get("seq"), int):
                    seq = raw["seq"]
                events = [_event(e, kinds, msgspec) for e in raw["events"]]
                batch = wire.KVEventBatch(
                    ts=float(raw.get("ts", 0.0)),
                    events=events,
                    data_parallel_rank=raw.get("data_parallel_rank"),
                )
            except (ValueError, TypeError, msgspec.ValidationError) as exc:
                yield number, seq, str(exc)
                continue
            yield number, seq, batch


def _event(raw: Any, kinds: dict[str, Any], msgspec: Any) -> Any:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ValueError("an event is not an object with a 'type'")
    fields = {k: v for k, v in raw.items() if k != "type"}
    kind = raw["type"]
    if kind == "AllBlocksCleared":
        from kvhex.adapters.events.wire import AllBlocksCleared

        return AllBlocksCleared()
    if kind not in kinds:
        raise ValueError(f"unknown event type {kind!r}")
    for name in _HASH_FIELDS:
        value = fields.get(name)
        if isinstance(value, list):
            fields[name] = [_hash(v) for v in value]
        elif value is not None:
            fields[name] = _hash(value)
    return msgspec.convert(fields, kinds[kind])


def _hash(value: Any) -> Any:
    return bytes.fromhex(value) if isinstance(value, str) else value
