"""``kvhex events ENDPOINT|FILE``: watch a KV-event stream, or read one, and check that it
adds up.

Subscribes to a ZMQ KV-event publisher, kvhex's ``ZmqEventSink`` or vLLM's
``ZmqEventPublisher`` (same framing: ``(topic, sequence as 8-byte big-endian, msgpack
batch)``), by connecting to ENDPOINT (``--bind``: binding it, for a publisher that connects),
decodes each batch with kvhex's wire structs and prints every event on one line (or as one
JSON object with ``--json``). With ``--replay`` it first asks the publisher's replay socket for
every batch it still buffers from ``--from-seq`` on, as vLLM's replay protocol does, and asks
again when the live stream skips a sequence; batches seen twice are shown once. It stops
after ``--count`` events or ``--duration`` seconds (or on Ctrl-C). A FILE (anything without
``://``) is a JSONL file kvhex's ``jsonl`` sink wrote, read whole the same way.

Then it prints what a consumer replaying the stream ends up with (``kvhex.cli._ledger``).
With ``--router NAME`` it also prints, one line each with its count, everything that router
would silently drop or miscredit (``kvhex.cli._router``: the ZMQ topic of each live message
included), and what it credits at which weight.
Exit status: 0 consistent (and, with ``--router``, nothing dropped or miscredited), 1
inconsistent or something the router would drop or miscredit, 2 a bad flag, endpoint or file,
3 nothing received (no publisher within ``--duration``, or a publisher that sent nothing, or
an empty file).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from kvhex.adapters.events.endpoints import endpoint_problem, is_endpoint, refusal
from kvhex.cli._args import EXIT_FAILED, EXIT_NOTHING, EXIT_OK, fail, positive
from kvhex.cli._event_printer import EventPrinter
from kvhex.domain.routers import PROFILES

if TYPE_CHECKING:
    from kvhex.cli._router import RouterCheck

REPLAY_TIMEOUT_S = 5.0


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
        help="watch a KV-event stream (kvhex's or vLLM's ZMQ publisher, or a kvhex JSONL "
        "file) and check it adds up",
        description="Subscribe to a ZMQ KV-event publisher (kvhex's or vLLM's), or read a "
        "JSONL file kvhex wrote, print each event, and report at the end whether the stream "
        "is consistent: sequence gaps, removals of blocks never stored, duplicate stores, "
        "blocks stored before their parent, AllBlocksCleared, and the blocks each medium "
        "holds; with --router, everything that router would drop or miscredit. Exit 0 "
        "consistent, 1 inconsistent (or, with --router, something dropped or miscredited), "
        "2 bad input, 3 nothing received.",
    )
    parser.add_argument(
        "endpoint",
        metavar="ENDPOINT",
        help="the publisher's PUB address to connect to, e.g. tcp://127.0.0.1:5557 (--bind "
        "binds it instead, for a publisher that connects), or a JSONL FILE kvhex wrote",
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
        help=f"how long to wait for each replay message (default {REPLAY_TIMEOUT_S:g})",
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
    parser.add_argument(
        "--router",
        choices=sorted(PROFILES),
        help="also report everything this KV-aware router would silently drop or miscredit "
        "(exit 1 when anything is), and what it credits: "
        + "; ".join(f"{p.name} is {p.label}" for p in PROFILES.values()),
    )
    parser.add_argument(
        "--router-block-size",
        metavar="N",
        type=positive(int),
        help="the block size the router reads (vllm-router's --kv-event-block-size, default "
        "16; the block_size Dynamo registered the worker with: default the stream's first)",
    )
    return parser


class _Watch:
    """One subscription: replays, live batches, de-duplication and limits."""

    def __init__(
        self,
        args: argparse.Namespace,
        sub: Any,
        dealer: Any,
        printer: EventPrinter,
        monitor: Any = None,
    ) -> None:
        from kvhex.cli._ledger import StreamLedger

        self.sub = sub
        self.dealer = dealer
        self.monitor = monitor
        self.printer = printer
        self.topic = args.topic.encode()
        self.count: int | None = args.count
        self.deadline = time.monotonic() + args.duration if args.duration else None
        self.replay_timeout_ms = int((args.replay_timeout or REPLAY_TIMEOUT_S) * 1000)
        self.ledger = StreamLedger(expected_first=args.from_seq if dealer is not None else None)
        self.router = _router_check(args)
        self.from_seq: int = args.from_seq
        self.seen = 0
        self.last: int | None = None
        self.peer = False
        """A publisher was seen: a connection, a replay answer or a message."""

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
            self.watch_peer()
            if not self.sub.poll(timeout_ms):
                continue
            self.peer = True
            frames = self.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                self.ledger.problems.append(f"a message of {len(frames)} frames, not 3")
                continue
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big")
            if self.dealer is not None:
                floor = self.from_seq - 1 if self.last is None else self.last
                if seq <= floor:
                    continue  # already seen through a replay, or before --from-seq
                if seq > floor + 1:  # missed: a slow subscription, or a dropped message
                    self.replay(floor + 1, seq)
            self.handle(seq, payload, replayed=False, topic=topic)

    def watch_peer(self) -> None:
        """Note a connection made to or from the SUB socket (its monitor's events)."""
        while self.monitor is not None and not self.peer and self.monitor.poll(0):
            self.monitor.recv_multipart()  # only connected / accepted events are asked for
            self.peer = True

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
            self.peer = True
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

    def handle(
        self, seq: int, payload: bytes, *, replayed: bool, topic: bytes | None = None
    ) -> None:
        """One batch: ``topic`` is its live message's (``None`` for a replayed one)."""
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
        self.seen += _take(self, seq, batch, replayed, topic)
        self.printer.out.flush()


def _check_flags(args: argparse.Namespace) -> str | None:
    """What argparse cannot check alone, as the message to fail with (``None``: fine)."""
    if is_endpoint(args.endpoint):
        return _check_endpoints(args)
    if not os.path.isfile(args.endpoint):
        found = "a directory" if os.path.isdir(args.endpoint) else "no such file"
        return (
            f"ENDPOINT {args.endpoint}: neither a ZMQ endpoint (tcp://HOST:PORT, "
            f"ipc://PATH) nor a JSONL file kvhex wrote ({found})"
        )
    zmq_only = [
        flag
        for flag, given in (
            ("--replay", args.replay is not None),
            ("--from-seq", args.from_seq != 0),
            ("--replay-timeout", args.replay_timeout is not None),
            ("--topic", args.topic != ""),
            ("--bind", args.bind),
            ("--duration", args.duration is not None),
        )
        if given
    ]
    if zmq_only:
        return (
            f"{', '.join(zmq_only)}: apply to a ZMQ ENDPOINT, and {args.endpoint} is read "
            "as a JSONL FILE (an endpoint looks like tcp://HOST:PORT)"
        )
    return _check_router_flags(args)


def _check_router_flags(args: argparse.Namespace) -> str | None:
    if args.router_block_size is not None and args.router is None:
        return "--router-block-size: applies to --router, which is not given"
    return None


def _check_endpoints(args: argparse.Namespace) -> str | None:
    """ENDPOINT and ``--replay``, and the flags that need ``--replay``."""
    for flag, endpoint, bind in (
        ("ENDPOINT", args.endpoint, args.bind),
        ("--replay", args.replay, False),
    ):
        if endpoint is None:
            continue
        problem = endpoint_problem(endpoint, bind=bind)
        if problem is None and endpoint.startswith("inproc://"):
            problem = "inproc:// reaches only this process: use tcp://HOST:PORT or ipc://PATH"
        if problem is not None:
            return f"{flag} {endpoint}: {problem}"
    if args.replay is None and (args.from_seq or args.replay_timeout is not None):
        flag = "--from-seq" if args.from_seq else "--replay-timeout"
        return f"{flag}: applies to --replay, which is not given"
    return _check_router_flags(args)


def _verdict(watch: _Watch | _FileWatch, what: str) -> int:
    """Print the summary; the exit status (and why on stderr when nothing was received)."""
    summary = watch.ledger.summary()
    if watch.router is not None:
        summary["router"] = watch.router.summary(joined_late=watch.ledger.joined_late)
    watch.printer.summary(summary)
    sys.stdout.flush()
    if summary["verdict"] == "inconsistent":
        return EXIT_FAILED
    if summary["verdict"] == "nothing received":
        return fail("events", what, EXIT_NOTHING)
    if watch.router is not None and summary["router"]["verdict"] == "mismatch":
        return EXIT_FAILED
    return EXIT_OK


class _FileWatch:
    """One JSONL file read whole, into the same ledger and printer as a live stream."""

    def __init__(self, args: argparse.Namespace, printer: EventPrinter) -> None:
        from kvhex.cli._ledger import StreamLedger

        self.path: str = args.endpoint
        self.printer = printer
        self.count: int | None = args.count
        self.ledger = StreamLedger(expected_first=0)
        self.router = _router_check(args)
        self.seen = 0

    def run(self) -> None:
        from kvhex.adapters.events.jsonl import read_batches

        for number, seq, batch in read_batches(self.path):
            if self.count is not None and self.seen >= self.count:
                return
            if isinstance(batch, str):
                self.ledger.bad_batch(seq)
                self.printer.bad(seq, f"line {number}: {batch}")
                continue
            self.ledger.batch(seq)
            self.seen += _take(self, seq, batch, False, None)
        self.printer.out.flush()


def _router_check(args: argparse.Namespace) -> RouterCheck | None:
    from kvhex.cli._router import RouterCheck

    if args.router is None:
        return None
    return RouterCheck(PROFILES[args.router], args.router_block_size)


def _take(
    watch: _Watch | _FileWatch, seq: int, batch: Any, replayed: bool, topic: bytes | None
) -> int:
    """Feed a decoded batch's events (up to ``--count``) to the ledger, the printer and the
    router check; how many were taken."""
    events = batch.events
    if watch.count is not None:
        events = events[: max(0, watch.count - watch.seen)]
    for event in events:
        watch.ledger.event(event)
        watch.printer.event(seq, batch.ts, batch.data_parallel_rank, event, replayed)
    if watch.router is not None:
        watch.router.batch(events, topic)
    return len(events)


def main(args: argparse.Namespace) -> int:
    """Watch the stream (or read the file), print it and its consistency; exit 0 consistent,
    1 not (or, with ``--router``, something that router drops or miscredits), 2 bad input,
    3 nothing received."""
    problem = _check_flags(args)
    if problem is not None:
        return fail("events", problem)
    # without pyzmq or msgspec: one line naming the extra (``kvhex.cli``)
    import msgspec  # noqa: F401

    if is_endpoint(args.endpoint):
        import zmq
    printer = EventPrinter(sys.stdout, as_json=args.json, quiet=args.quiet)
    try:
        if not is_endpoint(args.endpoint):
            return _read_file(args, printer)
        return _subscribe(args, printer, zmq)
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the exit flush
        return EXIT_OK


def _read_file(args: argparse.Namespace, printer: EventPrinter) -> int:
    watch = _FileWatch(args, printer)
    try:
        watch.run()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return fail(
            "events",
            f"ENDPOINT {args.endpoint}: neither a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH) "
            f"nor a readable JSONL file: {why}",
        )
    return _verdict(watch, f"FILE {args.endpoint} holds no batch")


def _subscribe(args: argparse.Namespace, printer: EventPrinter, zmq: Any) -> int:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    watch: _Watch | None = None
    try:
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
        try:
            if "[" in args.endpoint:
                sub.setsockopt(zmq.IPV6, 1)
            (sub.bind if args.bind else sub.connect)(args.endpoint)
        except zmq.ZMQError as exc:
            problem = refusal(exc.errno, exc.strerror, bind=args.bind)
            return fail("events", f"ENDPOINT {args.endpoint}: {problem}")
        if args.bind:  # the port a publisher connects to (``*`` resolved)
            bound = sub.getsockopt_string(zmq.LAST_ENDPOINT)
            print(f"kvhex events: listening on {bound}", file=sys.stderr, flush=True)
        dealer = None
        if args.replay is not None:
            dealer = ctx.socket(zmq.DEALER)
            try:
                if "[" in args.replay:
                    dealer.setsockopt(zmq.IPV6, 1)
                dealer.connect(args.replay)
            except zmq.ZMQError as exc:
                problem = refusal(exc.errno, exc.strerror, bind=False)
                return fail("events", f"--replay {args.replay}: {problem}")
        watch = _Watch(args, sub, dealer, printer, monitor)
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends the watch, not the report
            watch.run()
        watch.watch_peer()
        within = f" within {args.duration:g} s" if args.duration else ""
        if watch.peer:
            what = f"a publisher was connected to {args.endpoint} but sent nothing{within}"
        elif args.bind:
            what = f"no publisher connected to {args.endpoint}{within}"
        else:
            what = (
                f"no publisher at {args.endpoint}{within}: nothing there accepted the "
                "connection (is it running, and bound there? kvhex run --events binds; "
                "for a publisher that connects, add --bind)"
            )
        return _verdict(watch, what)
    finally:
        ctx.destroy(linger=0)
