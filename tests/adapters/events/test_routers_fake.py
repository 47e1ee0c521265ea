"""The router launchers of tests/routers.py against a fake vLLM: a publisher speaking vLLM's KV
event protocol (XPUB + replay ROUTER, bound on loopback) and, for vllm-router, which proxies
requests, fake OpenAI servers. Pins the facts tests/routers.py's docstring stars, so a router
upgrade that changes them fails here, in seconds, before any vLLM test misreads it.

Events are built as plain msgpack maps (not kvhex's encoder): these tests are about the routers.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import msgspec
import pytest
import zmq

from tests.dynamo import Credit, expected_credit
from tests.routers import (
    DynamoSelect,
    VllmRouter,
    vllm_router_credit,
    vllm_router_tier,
)

BLOCK = 32
END = (-1).to_bytes(8, "big", signed=True)


def tokens(base: int, blocks: int = 4) -> list[int]:
    """``blocks`` whole blocks of token ids no other prompt here shares."""
    return list(range(base, base + blocks * BLOCK))


def stored(
    prompt: list[int], first: int, medium: str | None, parent: int | None = None, **extra: Any
) -> dict[str, Any]:
    """A ``BlockStored`` map of ``prompt``'s whole blocks, hashed ``first``, ``first + 1``..."""
    n = len(prompt) // BLOCK
    return {
        "type": "BlockStored",
        "block_hashes": list(range(first, first + n)),
        "parent_block_hash": parent,
        "token_ids": prompt,
        "block_size": extra.pop("block_size", BLOCK),
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        **extra,
    }


def chain(prompt: list[int], first: int, media: list[str]) -> list[dict[str, Any]]:
    """One store per block of ``prompt``, block i on ``media[i]``, each the next one's parent."""
    return [
        stored(prompt[i * BLOCK : (i + 1) * BLOCK], first + i, m, first + i - 1 if i else None)
        for i, m in enumerate(media)
    ]


class FakePublisher:
    """vLLM's publisher: ``(topic, 8-byte big-endian sequence, msgpack [ts, events, 0])`` on an
    XPUB (so a test can wait for subscribers), and a replay ROUTER answering an 8-byte start
    sequence with every kept batch from there, then the end marker. Records replay requests."""

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = self._ctx.socket(zmq.ROUTER)
        self._replay.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self.kept: dict[int, tuple[bytes, bytes]] = {}
        self.replay_requests: list[int] = []
        self.next_seq = 0
        self._lock = threading.Lock()
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(
        self,
        *events: dict[str, Any],
        seq: int | None = None,
        topic: bytes = b"",
        lost: bool = False,
    ) -> int:
        """Send a batch as sequence ``seq`` (default: the next), kept for replay; ``lost``:
        kept but never sent. Returns its sequence."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        with self._lock:
            self.kept[seq] = (topic, payload)
        if not lost:
            self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        return seq

    def await_subscribers(self, count: int = 1, timeout: float = 10) -> None:
        """Wait until ``count`` subscriptions reached the XPUB (a SUB connects lazily)."""
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            assert time.monotonic() < deadline, f"{seen} of {count} subscribers in {timeout} s"
            if self._pub.poll(50):
                seen += self._pub.recv()[:1] == b"\x01"

    def _serve(self) -> None:
        while self._running:
            if not self._replay.poll(50):
                continue
            client, *_, start = self._replay.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            with self._lock:
                batches = sorted((s, b) for s, b in self.kept.items() if s >= first)
            for seq, (topic, payload) in batches:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._replay.close(linger=0)
        self._ctx.term()


class _Completions(BaseHTTPRequestHandler):
    """What vllm-router asks of a worker: ``/health``, ``/v1/models``, ``/v1/completions``."""

    def _answer(self, body: object, status: int = 200) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._answer({})
        elif self.path == "/v1/models":
            self._answer({"object": "list", "data": [{"id": "kvhex-test", "object": "model"}]})
        else:
            self._answer({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            self._answer({"error": "not found"}, 404)
            return
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
        self._answer({"id": "c", "object": "text_completion", "choices": [choice], "usage": usage})

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def publishers() -> Iterator[tuple[FakePublisher, FakePublisher]]:
    """Two workers' publishers: the first also serves replays."""
    first, second = FakePublisher(), FakePublisher()
    try:
        yield first, second
    finally:
        first.close()
        second.close()


@pytest.fixture
def workers() -> Iterator[tuple[str, str]]:
    """Two fake OpenAI servers on loopback: their URLs."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), _Completions) for _ in range(2)]
    for server in servers:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        first, second = (f"http://127.0.0.1:{s.server_address[1]}" for s in servers)
        yield first, second
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


Start = Callable[..., VllmRouter]


def start_router(
    vllm_router: Start, workers: tuple[str, str], pubs: tuple[FakePublisher, FakePublisher]
) -> VllmRouter:
    return vllm_router(
        {workers[0]: pubs[0].endpoint, workers[1]: pubs[1].endpoint},
        replay_sources={workers[0]: pubs[0].replay_endpoint},
    )


# -- vllm-router ------------------------------------------------------------------------------
MEDIA: list[tuple[str | None, dict[str, Any], int]] = [
    ("GPU", {}, 128),
    (None, {}, 128),
    ("CPU", {}, 102),
    ("cpu", {}, 102),
    ("STORAGE", {}, 38),
    ("DISK", {}, 38),
    ("SHARED_STORAGE", {}, 128),
    ("CPU_PINNED", {}, 128),
    ("CPU", {"locality": "REMOTE"}, 102),
    ("STORAGE", {"locality": "LOCAL"}, 38),
    ("CPU", {"ownership": "SHARED"}, 76),
    ("GPU", {"ownership": "SHARED"}, 76),
]
CHAINS = [
    (["GPU", "GPU", "CPU", "CPU"], 115),
    (["CPU", "CPU", "GPU", "GPU"], 51),
    (["GPU", "CPU", "STORAGE", "STORAGE"], 57),
    (["GPU", "STORAGE", "STORAGE", "STORAGE"], 60),
    (["CPU", "STORAGE", "CPU", "CPU"], 25),
]


def test_vllm_router_credits_each_medium_and_chain_as_documented(
    vllm_router: Start,
    workers: tuple[str, str],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    router = start_router(vllm_router, workers, publishers)
    pub = publishers[0]
    pub.await_subscribers()
    for i, (medium, extra, credit) in enumerate(MEDIA):
        prompt = tokens(10_000 + 1_000 * i)
        router.await_sequence(workers[0], pub.publish(stored(prompt, 100 * i, medium, **extra)))
        decision = router.route([*prompt, 7])
        assert (decision.worker, decision.credited_prefix_tokens) == (workers[0], credit), (
            f"{medium} {extra}{router.context()}"
        )
        tier = vllm_router_tier(medium, extra.get("ownership"))
        assert vllm_router_credit([{tier}] * 4, BLOCK) == credit
    for i, (media, credit) in enumerate(CHAINS):
        prompt = tokens(50_000 + 1_000 * i)
        router.await_sequence(workers[0], pub.publish(*chain(prompt, 5_000 + 10 * i, media)))
        decision = router.route([*prompt, 7])
        assert decision.credited_prefix_tokens == credit, f"{media}{router.context()}"
        held = [{vllm_router_tier(m)} for m in media]
        assert vllm_router_credit(held, BLOCK) == credit
    assert router.lookups() == {"hit": len(MEDIA) + len(CHAINS)}


def test_vllm_router_drops_orphans_forgets_on_clear_and_drops_mismatches_silently(
    vllm_router: Start,
    workers: tuple[str, str],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    router = start_router(vllm_router, workers, publishers)
    pub, other = publishers
    pub.await_subscribers()
    other.await_subscribers()
    for i, medium in enumerate(["GPU", "CPU", "STORAGE"]):
        prompt = tokens(10_000 + 1_000 * i)
        blocks = chain(prompt, 100 * i, [medium] * 4)
        router.await_sequence(workers[0], pub.publish(*blocks[2:]))  # children first
        router.await_sequence(workers[0], pub.publish(*blocks[:2]))
        half = vllm_router_credit([{vllm_router_tier(medium)}] * 2, BLOCK)
        assert router.route([*prompt, 7]).credited_prefix_tokens == half, router.context()

    held = {m: tokens(20_000 + 1_000 * i) for i, m in enumerate(["GPU", "CPU", "STORAGE"])}
    pub.publish(*(stored(p, 200 + 10 * i, m) for i, (m, p) in enumerate(held.items())))
    router.await_sequence(workers[1], other.publish(stored(held["GPU"][:BLOCK], 300, "GPU")))
    router.await_sequence(workers[0], pub.publish({"type": "AllBlocksCleared"}))
    after = {m: router.route([*p, 7]).credited_prefix_tokens for m, p in held.items()}
    assert after == {"GPU": 32, "CPU": 0, "STORAGE": 0}, router.context()  # GPU: the other's

    warned = len(router.warnings())
    topic = tokens(30_000)
    seq = other.publish(stored(topic, 400, "GPU"), topic=b"kv")
    small = tokens(31_000)
    pub.publish(stored(small, 500, "GPU", block_size=16) | {"block_hashes": [*range(500, 508)]})
    router.await_sequence(workers[0], pub.publish(stored(tokens(32_000, 1), 600, "GPU")))
    router.await_sequence(workers[1], other.publish(stored(tokens(33_000, 1), 700, "GPU")))
    assert router.route([*topic, 7]).credited_prefix_tokens == 0
    assert router.route([*small, 7]).credited_prefix_tokens == 0
    assert all(s != seq for _, s in router.sequences(workers[1])), router.context()
    assert len(router.warnings()) == warned, router.context()


def test_vllm_router_replays_from_zero_at_the_first_live_message(
    vllm_router: Start,
    workers: tuple[str, str],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    pub = publishers[0]
    early = tokens(10_000)
    for block in chain(early, 100, ["GPU"] * 4):
        pub.publish(block)  # nobody subscribed: sequences 0-3 reach no one
    router = start_router(vllm_router, workers, publishers)
    pub.await_subscribers()
    time.sleep(0.5)
    assert pub.replay_requests == []  # nothing asked at start
    assert router.route([*early, 7]).credited_prefix_tokens == 0

    router.await_sequence(workers[0], pub.publish(stored(tokens(20_000), 200, "CPU")))
    router.await_sequence(workers[0], 3)
    assert pub.replay_requests == [0]
    assert router.route([*early, 7]).credited_prefix_tokens == 128, router.context()


def test_vllm_router_forgets_a_worker_when_its_replay_skips_a_sequence(
    vllm_router: Start,
    workers: tuple[str, str],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    router = start_router(vllm_router, workers, publishers)
    pub = publishers[0]
    pub.await_subscribers()
    before, lost, after = tokens(10_000), tokens(20_000), tokens(30_000)
    router.await_sequence(workers[0], pub.publish(stored(before, 100, "GPU")))
    assert router.route([*before, 7]).credited_prefix_tokens == 128

    pub.publish(stored(lost, 200, "GPU"), lost=True)  # kept: a replay recovers it
    router.await_sequence(workers[0], pub.publish(stored(after, 300, "GPU")))
    assert pub.replay_requests == [1]
    credits = [router.route([*p, 7]).credited_prefix_tokens for p in (before, lost, after)]
    assert credits == [128, 128, 128], router.context()

    skipped = pub.next_seq  # sent nowhere, kept nowhere: the replay cannot be contiguous
    pub.next_seq += 1
    router.await_sequence(workers[0], pub.publish(stored(tokens(40_000), 400, "GPU")))
    assert pub.replay_requests == [1, skipped]
    assert any("noncontiguous" in w for w in router.warnings()), router.context()
    credits = [router.route([*p, 7]).credited_prefix_tokens for p in (before, lost, after)]
    assert credits == [0, 0, 0], router.context()
    assert router.route([*tokens(40_000), 7]).credited_prefix_tokens == 128


# -- Dynamo's selection service ---------------------------------------------------------------
def register(
    service: DynamoSelect, pubs: tuple[FakePublisher, FakePublisher], workers: tuple[str, str]
) -> None:
    """Workers 1 (with a replay socket) and 2, each subscribed to its publisher."""
    service.register(1, workers[0], pubs[0].endpoint, replay=pubs[0].replay_endpoint)
    service.register(2, workers[1], pubs[1].endpoint)
    pubs[0].await_subscribers()
    pubs[1].await_subscribers()


FAKE_URLS = ("http://127.0.0.1:9/a", "http://127.0.0.1:9/b")
"""Dynamo never calls its workers: any URL will do."""
DYNAMO_MEDIA: list[tuple[str | None, dict[str, Any], Credit, int]] = [
    ("GPU", {}, Credit(128, 128, 128), 128),
    (None, {}, Credit(128, 128, 128), 128),
    ("GPU", {"locality": "LOCAL"}, Credit(128, 128, 128), 128),
    ("CPU", {}, Credit(0, 128, 128), 96),
    ("CPU_PINNED", {}, Credit(0, 128, 128), 96),
    ("STORAGE", {}, Credit(0, 0, 128), 32),
    ("STORAGE", {"locality": "LOCAL"}, Credit(0, 0, 128), 32),
    ("DISK", {}, Credit(0, 0, 128), 32),
    ("EXTERNAL", {}, Credit(0, 0, 128), 32),
    ("cpu", {}, Credit(0, 0, 0), 0),
    ("SHARED_STORAGE", {}, Credit(0, 0, 0), 0),
    ("OBJECT_STORE", {}, Credit(0, 0, 0), 0),
    ("CPU", {"locality": "REMOTE"}, Credit(0, 0, 0), 0),
    ("CPU", {"ownership": "SHARED"}, Credit(0, 0, 0), 0),
]
MARKED = {"GPU": Credit(BLOCK, BLOCK, BLOCK), "CPU": Credit(0, BLOCK, BLOCK)}
MARKED |= {"STORAGE": Credit(0, 0, BLOCK), "EXTERNAL": Credit(0, 0, BLOCK)}


def publish_marked(pub: FakePublisher, base: int, *events: dict[str, Any]) -> int:
    """Publish ``events`` and, last in the same batch, a one-block marker per path (each tier
    is indexed on its own, ``EXTERNAL`` on one more, and may overtake the others): once
    :func:`marked`, every event before was taken or dropped. Returns ``base``, which names
    the markers."""
    markers = [stored(tokens(base + i, 1), base + i, m) for i, m in enumerate(MARKED)]
    pub.publish(*events, *markers)
    return base


def marked(service: DynamoSelect, base: int) -> bool:
    """Whether worker 1 holds every marker :func:`publish_marked` sent from ``base``."""
    return all(service.overlaps(tokens(base + i, 1))[1] == c for i, c in enumerate(MARKED.values()))


def test_dynamo_credits_each_medium_and_weight_as_documented(
    dynamo_select: Callable[..., DynamoSelect],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    service = dynamo_select()
    register(service, publishers, FAKE_URLS)
    pub = publishers[0]
    for i, (medium, extra, overlap, credit) in enumerate(DYNAMO_MEDIA):
        prompt = tokens(10_000 + 1_000 * i)
        base = publish_marked(pub, 900_000 + 100 * i, stored(prompt, 100 * i, medium, **extra))
        assert service.settle(partial(marked, service, base), True), service.context()
        assert service.overlaps([*prompt, 7]) == {1: overlap, 2: Credit(0, 0, 0)}, (
            f"{medium} {extra}{service.context()}"
        )
        assert service.credits([*prompt, 7]) == {1: credit, 2: 0}, f"{medium} {extra}"
        if credit:
            picked = service.select([*prompt, 7])
            assert (picked.worker_id, picked.overlap, picked.credit) == (1, overlap, credit)

    prompt = tokens(40_000)
    base = publish_marked(pub, 950_000, *chain(prompt, 4_000, ["GPU", "CPU", "STORAGE", "CPU"]))
    assert service.settle(partial(marked, service, base), True), service.context()
    held = [tuple(prompt[: (i + 1) * BLOCK]) for i in range(4)]
    model = expected_credit(prompt, BLOCK, gpu=held[:1], cpu=held[1:2] + held[3:], disk=held[2:3])
    assert service.overlaps(prompt)[1] == model == Credit(32, 64, 96)
    assert service.credits(prompt)[1] == 32 + 0.75 * 32 + 0.25 * 32

    device_only = dynamo_select(host_weight=0, disk_weight=0)
    register(device_only, publishers, FAKE_URLS)
    cpu, gpu = tokens(60_000), tokens(61_000)
    pub.publish(stored(cpu, 6_000, "CPU"), stored(gpu, 6_100, "GPU"))
    assert device_only.settle(lambda: device_only.credits(gpu)[1], 128) == 128
    assert device_only.overlaps(cpu)[1] == Credit(0, 128, 128)
    assert device_only.credits(cpu)[1] == 0  # vLLM's own view: the device alone


def test_dynamo_orphans_topics_and_block_sizes(
    dynamo_select: Callable[..., DynamoSelect],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    service = dynamo_select()
    register(service, publishers, FAKE_URLS)
    pub, other = publishers
    for i, medium in enumerate(["GPU", "CPU", "STORAGE"]):
        prompt = tokens(10_000 + 1_000 * i)
        blocks = chain(prompt, 100 * i, [medium] * 4)
        pub.publish(*blocks[2:])  # children first
        base = publish_marked(pub, 900_000 + 100 * i, *blocks[:2])
        assert service.settle(partial(marked, service, base), True), service.context()
        linked = 64 if medium == "GPU" else 128  # gpu drops the orphans; cpu and disk link them
        weight = {"GPU": 1.0, "CPU": 0.75, "STORAGE": 0.25}[medium]
        assert service.credits(prompt)[1] == linked * weight, service.context()
    assert any("Failed to find parent block" in w for w in service.warnings())

    topic = tokens(20_000)
    other.publish(stored(topic, 200, "GPU"), topic=b"kv")
    assert service.settle(lambda: service.credits(topic)[2], 128) == 128  # topics are not read

    small = tokens(30_000)
    sixteen = stored(small, 300, "GPU", block_size=16) | {"block_hashes": list(range(300, 308))}
    base = publish_marked(pub, 960_000, sixteen)
    assert service.settle(partial(marked, service, base), True), service.context()
    assert service.credits(small)[1] == 0
    assert any("Block not published" in w for w in service.warnings()), service.context()


def test_dynamo_replays_from_zero_at_the_first_live_message(
    dynamo_select: Callable[..., DynamoSelect],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    pub = publishers[0]
    early = tokens(10_000)
    for block in chain(early, 100, ["CPU"] * 4):
        pub.publish(block)  # nobody subscribed: sequences 0-3 reach no one
    service = dynamo_select()
    register(service, publishers, FAKE_URLS)
    time.sleep(0.5)
    assert pub.replay_requests == []  # nothing asked at registration
    assert service.credits(early)[1] == 0

    live = tokens(20_000)
    pub.publish(stored(live, 200, "GPU"))
    assert service.settle(lambda: service.credits(live)[1], 128) == 128
    assert pub.replay_requests == [0]
    assert service.settle(lambda: service.credits(early)[1], 96) == 96, service.context()


def test_dynamo_select_books_nothing_and_a_reservation_its_load(
    dynamo_select: Callable[..., DynamoSelect],
    publishers: tuple[FakePublisher, FakePublisher],
) -> None:
    service = dynamo_select()
    register(service, publishers, FAKE_URLS)
    prompt = tokens(10_000)
    publishers[0].publish(stored(prompt, 100, "CPU"))
    assert service.settle(lambda: service.credits([*prompt, 7]), {1: 96, 2: 0}) == {1: 96, 2: 0}

    def active() -> dict[int, tuple[int, int]]:
        """Per worker: requests booked, prefill tokens they hold."""
        (group,) = service.loads()
        loads = group["loads"]
        return {
            w["worker_id"]: (w["active_requests"], w["potential_prefill_tokens"]) for w in loads
        }

    assert service.select([*prompt, 7]).worker_id == 1
    assert active() == {1: (0, 0), 2: (0, 0)}  # a select without an id books nothing
    booked = service.select_and_reserve("r1", [*prompt, 7])
    assert (booked.worker_id, booked.credit) == (1, 96)
    assert active() == {1: (1, 33), 2: (0, 0)}  # 129 prompt tokens, 96 credited
    assert service.credits([*prompt, 7]) == {1: 96, 2: 0}  # reservations do not change credit
    service.prefill_complete("r1")
    assert active() == {1: (1, 0), 2: (0, 0)}
    service.release("r1")
    assert active() == {1: (0, 0), 2: (0, 0)}
