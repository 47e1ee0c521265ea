"""How ``kvhex events`` prints a stream: one text line or JSON object per event, then the
ledger's summary and its verdict."""

from __future__ import annotations

import datetime
import json
from typing import Any, TextIO

SHORT_HASH = 16
"""Hex digits of a hash shown in text lines (``--json`` shows them whole)."""


def _hash(value: bytes | int | None, *, short: bool) -> str | int | None:
    if value is None:
        return None
    if isinstance(value, int):
        return value if not short else f"{value & 0xFFFF_FFFF_FFFF_FFFF:016x}"
    text = value.hex()
    return text[:SHORT_HASH] if short else text


def _plain(value: Any) -> Any:
    """JSON-ready builtins of an event field (bytes as hex)."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class EventPrinter:
    """Prints events as text lines or JSON objects."""

    def __init__(self, out: TextIO, *, as_json: bool, quiet: bool) -> None:
        self.out = out
        self.as_json = as_json
        self.quiet = quiet

    def event(self, seq: int, ts: float, rank: int | None, event: Any, replayed: bool) -> None:
        if self.quiet:
            return
        import msgspec

        kind = type(event).__name__
        if self.as_json:
            fields = {k: _plain(v) for k, v in msgspec.structs.asdict(event).items()}
            record = {"seq": seq, "ts": ts, "data_parallel_rank": rank, "replayed": replayed}
            self.out.write(json.dumps({**record, "type": kind, **fields}) + "\n")
            return
        from kvhex.cli._ledger import residency_label

        when = datetime.datetime.fromtimestamp(ts, datetime.UTC)
        parts = [f"{seq:>6}", when.isoformat(timespec="milliseconds"), f"{kind:<16}"]
        hashes = getattr(event, "block_hashes", None)
        if hashes is not None:
            medium = residency_label(event.medium, event.locality, event.ownership)
            first = _hash(hashes[0], short=True) if hashes else "-"
            parts += [f"{medium:<20}", f"blocks={len(hashes)}", f"first={first}"]
        if kind == "BlockStored":
            lora = event.lora_name or (event.lora_id if event.lora_id is not None else "-")
            parts += [
                f"parent={_hash(event.parent_block_hash, short=True) or '-'}",
                f"block_size={event.block_size}",
                f"lora={lora}",
                f"tokens={len(event.token_ids)}",
            ]
        if replayed:
            parts.append("(replayed)")
        self.out.write(" ".join(parts) + "\n")

    def bad(self, seq: int, error: str) -> None:
        if self.quiet:
            return
        if self.as_json:
            self.out.write(json.dumps({"seq": seq, "type": "Undecodable", "error": error}) + "\n")
        else:
            self.out.write(f"{seq:>6} undecodable batch: {error}\n")

    def summary(self, summary: dict[str, Any]) -> None:
        if self.as_json:
            self.out.write(json.dumps({"type": "Summary", **summary}) + "\n")
            return
        lines = ["--"]
        seqs = f" (seq {summary['first_seq']}-{summary['last_seq']})" if summary["batches"] else ""
        counted = ", ".join(f"{n} {kind}" for kind, n in summary["events"].items()) or "none"
        lines.append(f"batches {summary['batches']}{seqs}; events: {counted}")
        gaps = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in summary["gaps"])
        lines.append(f"sequence gaps: {f'missing {gaps}' if gaps else 'none'}")
        if summary["cleared_gaps"]:
            cleared = ", ".join(
                f"{a}" if a == b else f"{a}-{b}" for a, b in summary["cleared_gaps"]
            )
            lines.append(f"batches skipped by a clear (a replay's snapshot): {cleared}")
        if summary["sequence_regressions"]:
            went = ", ".join(f"{a}->{b}" for a, b in summary["sequence_regressions"])
            lines.append(f"sequence went back: {went}")
        if summary["undecodable"]:
            lines.append(f"undecodable batches: {summary['undecodable']}")
        unknown = _per_medium(summary["unknown_removals"])
        if summary["joined_late"] and summary["unknown_removals"]:
            unknown += " (joined at a later sequence without --replay: not counted)"
        lines.append(f"removals of hashes not stored: {unknown}")
        dups = _per_medium(summary["duplicate_stores"])
        lines.append(f"duplicate stores without removal: {dups}")
        orphans = _per_medium(summary["orphan_stores"])
        if summary["joined_late"] and summary["orphan_stores"]:
            orphans += " (joined at a later sequence without --replay: not counted)"
        lines.append(f"stores before their parent: {orphans}")
        lines.append(f"AllBlocksCleared: {summary['all_blocks_cleared']}")
        lines.append(f"blocks held at the end: {_per_medium(summary['blocks'])}")
        if summary["verdict"] == "inconsistent":
            lines.append("INCONSISTENT: " + "; ".join(summary["problems"]))
        elif summary["verdict"] == "nothing received":
            lines.append("NOTHING RECEIVED: no verdict")
        else:
            lines.append("consistent")
        if "router" in summary:
            lines += _router_lines(summary["router"])
        self.out.write("\n".join(lines) + "\n")


def _router_lines(router: dict[str, Any]) -> list[str]:
    """``--router``'s section: what the router does with the events, one line per finding
    with its count (drops and miscredits first), then its verdict."""
    label = f"{router['router']} {router['version']}"
    size = router["block_size"]
    told = f"block size {size}, {router['block_size_from']}" if size else "no full store"
    lines = [f"-- {label} ({told})"]
    if router["topics"]:
        topics = ", ".join(f"{t or '(empty)'} {n}" for t, n in router["topics"].items())
        lines.append(f"ZMQ topics of live messages (events): {topics}")
    if router["findings"]:
        lines.append(" events  what the router does")
    for row in router["findings"]:
        late = "" if row["counted"] else " (joined at a later sequence: not counted)"
        lines.append(f"{row['count']:>7}  {row['line']}{late}")
    if router["verdict"] == "mismatch":
        lines.append(
            f"ROUTER MISMATCH: {label} would drop or miscredit {router['mismatched_events']} "
            f"of {router['events']} events"
        )
    else:
        lines.append(f"{label} reads all {router['events']} events")
    return lines


def _per_medium(counts: dict[str, int]) -> str:
    return ", ".join(f"{medium} {n}" for medium, n in counts.items()) or "none"
