"""``kvhex events ENDPOINT``: watch a KV-event stream and check that it adds up.

Subscribes to a ZMQ KV-event publisher, kvhex's ``ZmqEventSink`` or vLLM's
``ZmqEventPublisher`` (same framing: ``(topic, sequence as 8-byte big-endian, msgpack
batch)``), decodes each batch with kvhex's wire structs and prints every event on one line
(or as one JSON object with ``--json``). With ``--replay`` it first asks the publisher's
replay socket for every batch it still buffers from ``--from-seq`` on, as vLLM's replay
protocol does, and asks again when the live stream skips a sequence; batches seen twice are
shown once. It stops after ``--count`` events or ``--duration`` seconds (or on Ctrl-C) and
prints what a consumer replaying the stream ends up with (``kvhex.cli._ledger``); the exit
status is 1 when the stream is inconsistent, 2 when it cannot be watched at all.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from typing import Any, TextIO

from kvhex.cli._args import positive

__all__ = ["add_parser", "main"]

EXIT_INCONSISTENT = 1
EXIT_USAGE = 2
SHORT_HASH = 16
"""Hex digits of a hash shown in text lines (``--json`` shows them whole)."""


def _sequence(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a sequence number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Register ``kvhex events`` and its flags."""
    parser = subparsers.add_parser(
        "events",
        help="watch a KV-event stream (kvhex's or vLLM's ZMQ publisher) and check it adds up",
        description="Subscribe to a ZMQ KV-event publisher (kvhex's or vLLM's), print each "
        "event, and report at the end whether the stream is consistent: sequence gaps, "
        "removals of blocks never stored, duplicate stores, AllBlocksCleared, and the "
        "blocks each medium holds. Exit 1 when inconsistent.",
    )
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="the publisher's PUB address, e.g. tcp://127.0.0.1:5557 (for a publisher that "
        "connects instead of binding, add --bind)",
    )
    parser.add_argument(
        "--replay",
        metavar="ROUTER_ENDPOINT",
        help="the publisher's replay address: fetch what it published before this command "
        "subscribed, and batches the live stream skips",
    )
    parser.add_argument(
        "--from-seq",
        metavar="SEQ",
        type=_sequence,
        default=0,
        help="first sequence to ask the replay socket for (default 0)",
    )
    parser.add_argument("--count", metavar="N", type=positive(int), help="stop after N events")
    parser.add_argument(
        "--duration", metavar="S", type=positive(float), help="stop after S seconds"
    )
    parser.add_argument(
        "--replay-timeout",
        metavar="S",
        type=positive(float),
        default=5.0,
        help="how long to wait for each replay message (default 5)",
    )
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to (default all)")
    parser.add_argument(
        "--bind", action="store_true", help="bind ENDPOINT instead of connecting to it"
    )
    parser.add_argument(
        "--json", action="store_true", help="one JSON object per event, then one summary object"
    )
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print only the summary, not each event"
    )
    return parser


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


class _Printer:
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

        when = datetime.datetime.fromtimestamp(ts, datetime.timezone.utc)
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
        lines.append(f"AllBlocksCleared: {summary['all_blocks_cleared']}")
        lines.append(f"blocks held at the end: {_per_medium(summary['blocks'])}")
        if summary["consistent"]:
            lines.append("consistent")
        else:
            lines.append("INCONSISTENT: " + "; ".join(summary["problems"]))
        self.out.write("\n".join(lines) + "\n")


def _per_medium(counts: dict[str, int]) -> str:
    return ", ".join(f"{medium} {n}" for medium, n in counts.items()) or "none"


class _Watch:
    """One subscription: replays, live batches, de-duplication and limits."""

    def __init__(self, args: argparse.Namespace, sub: Any, dealer: Any, printer: _Printer) -> None:
        from kvhex.cli._ledger import StreamLedger

        self.sub = sub
        self.dealer = dealer
        self.printer = printer
        self.topic = args.topic.encode()
        self.count: int | None = args.count
        self.deadline = time.monotonic() + args.duration if args.duration else None
        self.replay_timeout_ms = int(args.replay_timeout * 1000)
        self.ledger = StreamLedger(expected_first=args.from_seq if dealer is not None else None)
        self.from_seq: int = args.from_seq
        self.seen = 0
        self.last: int | None = None

    def done(self) -> bool:
        if self.count is not None and self.seen >= self.count:
            return True
        return self.deadline is not None and time.monotonic() >= self.deadline

    def run(self) -> None:
        if self.dealer is not None:
            self.replay(self.from_seq, None)
        while not self.done():
            timeout_ms = 100
            if self.deadline is not None:
                timeout_ms = max(1, min(100, int((self.deadline - time.monotonic()) * 1000)))
            if not self.sub.poll(timeout_ms):
                continue
            frames = self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.ledger.problems.append(f"a message of {len(frames)} frames, not 3")
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self.dealer is not None:
                floor = self.from_seq - 1 if self.last is None else self.last
                if seq <= floor:
                    continue  # already seen through a replay, or before --from-seq
                if seq > floor + 1:  # missed: a slow subscription, or a dropped message
                    self.replay(floor + 1, seq)
            self.handle(seq, payload, replayed=False)

    def replay(self, start: int, stop: int | None) -> None:
        """Ask for every buffered batch from ``start`` (below ``stop``) and handle it."""
        self.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            if not self.dealer.poll(self.replay_timeout_ms):
                self.ledger.problems.append(
                    f"the replay socket did not answer within {self.replay_timeout_ms / 1000:g} s"
                )
                self.dealer.close(linger=0)
                self.dealer = None
                return
            frames = self.dealer.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]  # the DEALER's empty delimiter
            if len(frames) != 3 or len(frames[1]) != 8:
                self.ledger.problems.append(f"a replay message of {len(frames)} frames, not 3")
                continue
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return
            if self.done() or not topic.startswith(self.topic):
                continue
            if (self.last is not None and seq <= self.last) or (stop is not None and seq >= stop):
                continue
            self.handle(seq, payload, replayed=True)

    def handle(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        import msgspec

        from kvhex.adapters.events.wire import decode_batch

        self.last = seq
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self.ledger.bad_batch(seq)
            self.printer.bad(seq, str(exc))
            return
        self.ledger.batch(seq)
        for event in batch.events:
            if self.count is not None and self.seen >= self.count:
                break
            self.ledger.event(event)
            self.printer.event(seq, batch.ts, batch.data_parallel_rank, event, replayed)
            self.seen += 1
        self.printer.out.flush()


def main(args: argparse.Namespace) -> int:
    """Watch the stream, print it and its consistency; 0 consistent, 1 not, 2 unwatchable."""
    try:
        import msgspec  # noqa: F401
        import zmq
    except ImportError as exc:
        print(
            f"kvhex events: needs pyzmq and msgspec ({exc.name} is missing): "
            "pip install 'kvhex[zmq]'",
            file=sys.stderr,
        )
        return EXIT_USAGE
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    dealer = None
    watch: _Watch | None = None
    try:
        try:
            (sub.bind if args.bind else sub.connect)(args.endpoint)
        except zmq.ZMQError as exc:
            print(f"kvhex events: ENDPOINT {args.endpoint}: {exc}", file=sys.stderr)
            return EXIT_USAGE
        if args.replay is not None:
            dealer = ctx.socket(zmq.DEALER)
            try:
                dealer.connect(args.replay)
            except zmq.ZMQError as exc:
                print(f"kvhex events: --replay {args.replay}: {exc}", file=sys.stderr)
                return EXIT_USAGE
        printer = _Printer(sys.stdout, as_json=args.json, quiet=args.quiet)
        watch = _Watch(args, sub, dealer, printer)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the watch, not the report
            watch.run()
        printer.summary(watch.ledger.summary())
        sys.stdout.flush()
        return 0 if watch.ledger.consistent else EXIT_INCONSISTENT
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the exit flush
        return 0 if watch is None or watch.ledger.consistent else EXIT_INCONSISTENT
    finally:
        ctx.destroy(linger=0)
