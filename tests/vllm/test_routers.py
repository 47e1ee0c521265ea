"""Two real KV-aware routers in front of two real vLLM servers running kvhex: what each router
credits, as it reports it, follows what kvhex's tiers hold.

Servers A and B (vLLM's OpenAI server, the CPU build, tests/vllm/servers.py) each run kvhex's
connector with host memory (``HOST_CHUNKS``) and a file tier on one shared root with
``announce_peers``; their events go out on vLLM's own ZMQ publisher. In front of both, at
once: vllm-router 0.1.17 (``kv_aware``; it reports a credit only by routing a request, in its
debug log) and Dynamo's selection service (``/overlap_scores``
and ``/potential_loads`` answer without side effects). tests/routers.py has what each credits
and drops (measured). Each test uses prompts no other test sends; the servers are shared by the
module (they take about a minute to start).

What the tests assert is each router's own answer: credited tokens, selections, and
the server's cached tokens by source for a request the router sent; never which worker
happened to answer a request nobody was credited for.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests.dynamo import BUILD as DYNAMO_BUILD
from tests.dynamo import NOTHING, Credit
from tests.dynamo import PYTHON_VARIABLE as DYNAMO_VARIABLE
from tests.routers import (
    ROUTER_BUILD,
    ROUTER_VARIABLE,
    DynamoSelect,
    VllmRouter,
    python_or_skip,
    vllm_router_credit,
)
from tests.vllm.engine import BLOCK, CHUNK_BYTES, ENGINE_SKIP, flush
from tests.vllm.servers import VllmServer

pytestmark = [
    pytest.mark.skipif(ENGINE_SKIP is not None, reason=ENGINE_SKIP or ""),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

HOST_CHUNKS = 28
"""Host memory per server: a 10-block prefix and one flush prompt (15 blocks) fit, two flush
prompts after it push it out."""
FILE_BLOCKS = 48
"""A's file tier: a prefix and two flush prompts fit, three push it out."""
PEER_SCAN_S = 0.5
PREFIX_BLOCKS = 10
TOKENS = PREFIX_BLOCKS * BLOCK
SETTLE_S = 20.0
"""How long a router may take to show what a server's events say."""
_turns = itertools.count(100)


def prefix(seed: int) -> list[int]:
    """A prompt of ``PREFIX_BLOCKS`` full blocks no other prompt shares, and a partial one."""
    body = [((seed * 131 + i * 37) % 1000) + 3 for i in range(TOKENS)]
    return [*body, *(((seed * 7 + j) % 1000) + 3 for j in range(8))]


def flushes(server: VllmServer, n: int) -> None:
    """``n`` prompts sharing nothing with anything (15 blocks each), served by ``server``."""
    for _ in range(n):
        server.complete(flush(next(_turns)))


def extra(root: Path, file_blocks: int) -> dict[str, Any]:
    return {
        "cpu_bytes_to_use": HOST_CHUNKS * CHUNK_BYTES,
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(root),
                "enable_kv_events": True,
                "locality": "LOCAL",
                "kvhex": {
                    "capacity_bytes": file_blocks * (CHUNK_BYTES + 4096),
                    "announce_peers": True,
                    "peer_scan_interval_s": PEER_SCAN_S,
                },
            }
        ],
        # every hit loaded: the routers' credit is tested, not the load-or-recompute decision
        "kvhex": {"loading": {"mode": "off"}},
    }


class Fleet(NamedTuple):
    a: VllmServer
    b: VllmServer
    router: VllmRouter
    dynamo: DynamoSelect
    start_router: Callable[[str], VllmRouter]
    start_dynamo: Callable[[str], DynamoSelect]


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    router_python = python_or_skip(ROUTER_VARIABLE, "vllm-router", ROUTER_BUILD, ".venv-router")
    dynamo_python = python_or_skip(
        DYNAMO_VARIABLE, "Dynamo's runtime", DYNAMO_BUILD, ".venv-dynamo"
    )
    work = tmp_path_factory.mktemp("fleet")
    with contextlib.ExitStack() as stack:
        # one after the other: two starting at once on two cores take minutes each
        a = stack.enter_context(VllmServer(model, work / "a.log", extra(work / "kv", FILE_BLOCKS)))
        b = stack.enter_context(VllmServer(model, work / "b.log", extra(work / "kv", 1024)))

        def start_router(name: str) -> VllmRouter:
            sources = {a.url: a.events, b.url: b.events}
            replay = {a.url: a.replay, b.url: b.replay}
            log = work / f"vllm-router-{name}.log"
            router = VllmRouter(router_python, log, sources, replay_sources=replay)
            return stack.enter_context(router)

        def start_dynamo(name: str) -> DynamoSelect:
            dynamo = stack.enter_context(DynamoSelect(dynamo_python, work / f"dynamo-{name}.log"))
            dynamo.register(1, a.url, a.events, replay=a.replay)
            dynamo.register(2, b.url, b.events, replay=b.replay)
            return dynamo

        router, dynamo = start_router("first"), start_dynamo("first")
        yield Fleet(a, b, router, dynamo, start_router, start_dynamo)


def overlaps(dynamo: DynamoSelect, tokens: list[int]) -> dict[int, Credit]:
    return {worker: dynamo.overlaps(tokens).get(worker, NOTHING) for worker in (1, 2)}


def settle(fleet: Fleet, tokens: list[int], want: dict[int, Credit]) -> dict[int, Credit]:
    """Dynamo's overlaps of ``tokens`` once they equal ``want``, or the last ones after
    ``SETTLE_S`` (the caller asserts on them)."""
    return fleet.dynamo.settle(lambda: overlaps(fleet.dynamo, tokens), want, SETTLE_S)


def vllm_router_expects(credit: Credit) -> int:
    """What vllm-router credits a prompt whose blocks Dynamo says are held so (its
    cumulative gpu, cpu and disk runs, in tokens)."""
    g, c, d = credit.gpu // BLOCK, credit.cpu // BLOCK, credit.disk // BLOCK
    held = [{"gpu"}] * g + [{"host"}] * (c - g) + [{"disk"}] * (d - c)
    return vllm_router_credit(held + [set()] * (PREFIX_BLOCKS - len(held)), BLOCK)


def served_from(fleet: Fleet, tokens: list[int]) -> tuple[int, dict[str, float]]:
    """Route ``tokens`` through vllm-router: the tokens it credited, and the prompt tokens
    the servers then served from cache, per source."""
    before = [fleet.a.cached_by_source(), fleet.b.cached_by_source()]
    decision = fleet.router.route(tokens, max_tokens=4)
    after = [fleet.a.cached_by_source(), fleet.b.cached_by_source()]
    by_source = {
        source: sum(now[source] - then[source] for now, then in zip(after, before, strict=True))
        for source in after[0]
    }
    return decision.credited_prefix_tokens, by_source


def test_a_prefix_kept_in_host_memory_is_credited_at_the_routers_cpu_weight(fleet: Fleet) -> None:
    p = prefix(1)
    fleet.a.complete(p)
    flushes(fleet.a, 1)  # out of A's device cache, still in its host memory and files
    want = {1: Credit(0, TOKENS, TOKENS), 2: Credit(0, 0, TOKENS)}  # B: A's files, its view
    assert settle(fleet, p, want) == want, fleet.dynamo.context()
    credits = fleet.dynamo.credits(p)
    assert credits[1] == int(0.75 * TOKENS), credits  # Dynamo's host weight
    assert fleet.dynamo.select(p).worker_id == 1
    credited, by_source = served_from(fleet, p)
    assert credited == int(0.8 * TOKENS) == vllm_router_expects(want[1]), fleet.router.context()
    assert by_source["host"] == TOKENS, by_source  # served from A's kvhex host memory


def test_a_prefix_on_the_shared_root_is_credited_to_both_servers_at_storage_weight(
    fleet: Fleet,
) -> None:
    q = prefix(2)
    fleet.a.complete(q)
    flushes(fleet.a, 2)  # out of A's device cache and host memory; in the shared files
    want = {1: Credit(0, 0, TOKENS), 2: Credit(0, 0, TOKENS)}
    assert settle(fleet, q, want) == want, fleet.dynamo.context()
    assert fleet.dynamo.credits(q) == {1: TOKENS // 4, 2: TOKENS // 4}  # disk weight 0.25
    credited, by_source = served_from(fleet, q)
    assert credited == int(0.3 * TOKENS) == vllm_router_expects(want[1]), fleet.router.context()
    assert by_source["disk"] == TOKENS, by_source  # from the file tier, whichever served it


def test_once_kvhex_removed_a_prefix_from_every_tier_neither_server_is_credited(
    fleet: Fleet,
) -> None:
    r = prefix(3)
    fleet.a.complete(r)
    want = {1: Credit(TOKENS, TOKENS, TOKENS), 2: Credit(0, 0, TOKENS)}
    assert settle(fleet, r, want) == want, fleet.dynamo.context()
    flushes(fleet.a, 3)  # out of A's device cache, host memory and file tier
    want = {1: NOTHING, 2: NOTHING}
    assert settle(fleet, r, want) == want, fleet.dynamo.context()
    credited, by_source = served_from(fleet, r)
    assert credited == 0, fleet.router.context()
    assert sum(by_source.values()) == 0, by_source


def test_routers_that_join_late_recover_the_same_credits_from_the_replay(fleet: Fleet) -> None:
    s = prefix(4)
    fleet.a.complete(s)
    flushes(fleet.a, 1)
    want = {1: Credit(0, TOKENS, TOKENS), 2: Credit(0, 0, TOKENS)}
    assert settle(fleet, s, want) == want, fleet.dynamo.context()
    late_dynamo = fleet.start_dynamo("late")
    late_router = fleet.start_router("late")
    # a late subscriber asks the replay for everything from sequence 0 at its first live
    # batch: each server serves a prompt of its own to send one
    for server, seed in ((fleet.a, 5), (fleet.b, 6)):
        server.complete(prefix(seed)[: 2 * BLOCK])
    got = late_dynamo.settle(lambda: overlaps(late_dynamo, s), want, SETTLE_S)
    assert got == want, late_dynamo.context()
    assert late_dynamo.credits(s) == fleet.dynamo.credits(s)
    decision = late_router.route(s, max_tokens=4)
    assert decision.credited_prefix_tokens == vllm_router_expects(want[1]), late_router.context()
    assert any(kind == "replay" for kind, _ in late_router.sequences(fleet.a.url))


def test_after_a_device_clear_every_copy_kvhex_holds_is_credited_again(fleet: Fleet) -> None:
    t = prefix(7)
    fleet.a.complete(t)
    last = flush(next(_turns))
    fleet.a.complete(last)  # on A's device now; t only in host memory and files
    want = {1: Credit(0, TOKENS, TOKENS), 2: Credit(0, 0, TOKENS)}
    assert settle(fleet, t, want) == want, fleet.dynamo.context()
    assert overlaps(fleet.dynamo, last)[1].gpu > 0
    fleet.a.reset_prefix_cache()  # AllBlocksCleared on A's stream: routers forget A
    # the device's blocks are gone, and kvhex said again what it holds (A's idle engine
    # steps once to publish the clear and kvhex's events together)
    deadline = time.monotonic() + SETTLE_S
    while overlaps(fleet.dynamo, last)[1].gpu and time.monotonic() < deadline:
        time.sleep(0.05)
    assert overlaps(fleet.dynamo, last)[1].gpu == 0, fleet.dynamo.context()
    assert overlaps(fleet.dynamo, t) == want, fleet.dynamo.context()
    credited, by_source = served_from(fleet, t)
    assert credited == int(0.8 * TOKENS), fleet.router.context()
    assert by_source["host"] == TOKENS, by_source


def test_an_idle_servers_peer_view_announces_and_withdraws_on_time(fleet: Fleet) -> None:
    """B serves nothing here: only its peer view, woken by kvhex, tells the routers what A
    stores in the shared files and what A's file tier evicts."""
    u = prefix(8)
    fleet.a.complete(u)
    began = time.monotonic()
    want = {1: Credit(TOKENS, TOKENS, TOKENS), 2: Credit(0, 0, TOKENS)}
    assert settle(fleet, u, want) == want, fleet.dynamo.context()
    assert time.monotonic() - began < 10 * PEER_SCAN_S
    flushes(fleet.a, 3)  # out of A's file tier: B's view withdraws it
    began = time.monotonic()
    want = {1: NOTHING, 2: NOTHING}
    assert settle(fleet, u, want) == want, fleet.dynamo.context()
    assert time.monotonic() - began < 10 * PEER_SCAN_S
