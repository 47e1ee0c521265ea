"""The fsspec tier against a real S3-compatible server on loopback (no mocking of s3fs or
boto): integrity, restart, sharing, and failures at start-up and run
time."""

from __future__ import annotations

from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.objects.s3_direct import REQUESTS_IN_FLIGHT
from kvhex.domain import JobKind, Removed, Stored
from kvhex.errors import TierUnavailable
from tests.adapters.conftest import CREDENTIALS, Wire, s3_options
from tests.adapters.jobs import key, run
from tests.adapters.storage.peer_kit import started

SLOT = 2048
NS = {"model": "tiny-llama", "dtype": "float16"}


def tier(host: MemoryHostBuffer, endpoint: str, bucket: str, **kw: Any) -> FsspecTierStore:
    opts = kw.pop("storage_options", s3_options(endpoint))
    return FsspecTierStore(
        host,
        f"s3://{bucket}/kv",
        capacity_bytes=kw.pop("capacity_bytes", 1 << 24),
        name=kw.pop("name", "s3"),
        namespace=NS,
        storage_options=opts,
        locality=None,
        **kw,
    )


def fill(host: MemoryHostBuffer, n: int, seed: int) -> None:
    for s in range(n):
        host.slot_view(s)[:] = bytes([(seed + s) % 256]) * SLOT


def test_a_missing_bucket_fails_at_start_up_without_creating_it(s3_server: str) -> None:
    import s3fs

    host = MemoryHostBuffer(2, SLOT)
    with pytest.raises(TierUnavailable, match="does not exist") as info:
        tier(host, s3_server, "no-such-bucket-kvhex")
    assert info.value.tier == "s3"
    assert not s3fs.S3FileSystem(**s3_options(s3_server)).exists("no-such-bucket-kvhex")
    assert CREDENTIALS["secret"] not in str(info.value)


def test_object_stores_default_to_eight_io_threads(s3_server: str, bucket: str) -> None:
    """Requests wait on the network, not the CPU: more of them are in flight than cores."""
    store = tier(MemoryHostBuffer(2, SLOT), s3_server, bucket)
    assert store.io_threads == 8
    store.close()


def test_corrupt_objects_are_deleted_and_their_removal_announced(
    s3_server: str, bucket: str
) -> None:
    import s3fs

    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 2, 1)
    assert run(store, JobKind.PUT, [1, 2]).success
    store.take_events()
    fs = s3fs.S3FileSystem(**s3_options(s3_server))
    data = bytearray(fs.cat_file(store.location(key(1))[0]))
    data[-100] ^= 0x55  # a payload byte
    fs.pipe_file(store.location(key(1))[0], bytes(data))
    result = run(store, JobKind.GET, [1, 2], [2, 3])
    assert not result.success
    assert result.ok_keys == frozenset({key(2)})
    assert bytes(host.slot_view(3)) == bytes([2]) * SLOT
    (removed,) = store.take_events()
    assert isinstance(removed, Removed)
    assert removed.keys == (key(1),)
    store.drain()  # the object is deleted on an IO thread
    assert not fs.exists(store.location(key(1))[0])
    store.close()


def test_restart_and_a_second_instance_see_the_bucket(s3_server: str, bucket: str) -> None:
    host = MemoryHostBuffer(4, SLOT)
    first = tier(host, s3_server, bucket, name="a")
    fill(host, 3, 7)
    assert run(first, JobKind.PUT, [1, 2, 3]).success
    other = started(tier(host, s3_server, bucket, name="b"))
    (inventory,) = other.take_events()
    assert isinstance(inventory, Stored)
    assert set(inventory.keys) == {key(1), key(2), key(3)}
    assert run(first, JobKind.PUT, [9], [0]).success
    assert run(other, JobKind.PROBE, [9, 10]).found == frozenset({key(9)})  # written later
    assert run(other, JobKind.GET, [9], [3]).success
    first.close()
    other.close()


def test_an_instance_starting_with_less_room_than_the_bucket_holds_deletes_nothing(
    s3_server: str, bucket: str
) -> None:
    """A shared bucket holds other instances' blocks: one starting with room for fewer
    adopts what fits and leaves the rest in place (deleting it would take blocks from under
    the instances that stored and announced them); it still finds and serves those."""
    import s3fs

    from kvhex.adapters.storage.format import HEADER_AREA

    host = MemoryHostBuffer(4, SLOT)
    first = tier(host, s3_server, bucket, name="a")
    fill(host, 3, 7)
    expected = [bytes(host.slot_view(s)) for s in range(3)]
    assert run(first, JobKind.PUT, [1, 2, 3]).success
    small = started(
        tier(host, s3_server, bucket, name="b", capacity_bytes=2 * (SLOT + HEADER_AREA))
    )
    (adopted,) = small.take_events()
    assert isinstance(adopted, Stored)
    assert len(adopted.keys) == 2
    fs = s3fs.S3FileSystem(**s3_options(s3_server))
    assert len([p for p in fs.find(bucket) if p.endswith(".blk")]) == 3  # none deleted
    (left,) = [i for i in (1, 2, 3) if key(i) not in adopted.keys]
    assert run(small, JobKind.PROBE, [1, 2, 3]).found == frozenset({key(1), key(2), key(3)})
    fill(host, 3, 99)
    assert run(small, JobKind.GET, [left], [0]).success
    assert bytes(host.slot_view(0)) == expected[left - 1]
    assert run(first, JobKind.GET, [1, 2, 3], [1, 2, 3]).success
    assert [bytes(host.slot_view(s)) for s in (1, 2, 3)] == expected
    first.close()
    small.close()


def test_the_server_going_away_gives_failed_jobs_not_a_crash(private_s3_server: Any) -> None:
    import s3fs

    host_name, port = private_s3_server.get_host_and_port()
    endpoint = f"http://{host_name}:{port}"
    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir("kvhex-down")
    opts = s3_options(
        endpoint,
        config_kwargs={"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}},
    )
    host = MemoryHostBuffer(2, SLOT)
    store = tier(host, endpoint, "kvhex-down", storage_options=opts)
    fill(host, 1, 3)
    assert run(store, JobKind.PUT, [1]).success
    store.take_events()
    private_s3_server.stop()
    put = run(store, JobKind.PUT, [2], [0])
    get = run(store, JobKind.GET, [1], [1])
    assert not put.success
    assert not get.success
    assert store.take_events() == []  # nothing announced that is not stored
    assert store.keys() == [key(1)]
    assert CREDENTIALS["secret"] not in (put.error or "")
    store.close()


def test_wrong_credentials_fail_at_start_up_without_leaking_them(
    s3_server: str, bucket: str
) -> None:
    host = MemoryHostBuffer(2, SLOT)
    wrong = s3_options(s3_server, key="AKIAWRONGWRONGWRONG", secret="wrong-secret-value")
    with pytest.raises(TierUnavailable) as info:
        tier(host, s3_server, bucket, storage_options=wrong)
    assert "wrong-secret-value" not in str(info.value)
    assert info.value.tier == "s3"


def _objects(endpoint: str) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3_options(endpoint))


def events_of(store: FsspecTierStore) -> list[tuple[str, set[int]]]:
    """The tier's events as (kind, chunk ids)."""
    out = []
    for event in store.take_events():
        assert isinstance(event, Stored | Removed)
        ids = {int.from_bytes(k[:-4], "big") for k in event.keys}
        out.append(("stored" if isinstance(event, Stored) else "removed", ids))
    return out


def test_a_probe_asks_the_store_and_announces_blocks_it_lost(s3_server: str, bucket: str) -> None:
    """The server lost objects behind the tier's back: probes do not answer from the index."""
    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 3, 1)
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    store.take_events()
    _objects(s3_server).rm([store.location(key(i))[0] for i in (1, 2)])
    assert run(store, JobKind.PROBE, [1, 2, 3]).found == frozenset({key(3)})
    assert events_of(store) == [("removed", {1, 2})]
    assert store.keys() == [key(3)]
    store.close()


def test_a_put_of_a_listed_key_the_store_lost_writes_it_again_and_says_so(
    s3_server: str, bucket: str
) -> None:
    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 2, 1)
    assert run(store, JobKind.PUT, [1, 2]).success
    store.take_events()
    fs = _objects(s3_server)
    fs.rm(store.location(key(1))[0])
    fill(host, 2, 1)
    assert run(store, JobKind.PUT, [1, 2]).success  # 2 is still there: checked, not rewritten
    assert events_of(store) == [("removed", {1}), ("stored", {1})]
    assert fs.exists(store.location(key(1))[0])
    assert run(store, JobKind.GET, [1, 2], [2, 3]).success
    assert bytes(host.slot_view(2)) == bytes([1]) * SLOT
    assert run(store, JobKind.PUT, [1, 2]).success
    assert store.take_events() == []  # present and there: nothing new
    store.close()


def test_an_emptied_namespace_is_announced_as_every_block_gone(s3_server: str, bucket: str) -> None:
    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 3, 1)
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    store.take_events()
    _objects(s3_server).rm(store.root, recursive=True)  # config.json and every block
    assert run(store, JobKind.PROBE, [1]).found == frozenset()
    assert events_of(store) == [("removed", {1, 2, 3})]
    assert run(store, JobKind.PUT, [4], [0]).success  # the namespace works again
    assert events_of(store) == [("stored", {4})]
    store.close()
    again = started(tier(host, s3_server, bucket))  # and restarts into the same namespace
    assert events_of(again) == [("stored", {4})]
    again.close()


def test_a_namespace_record_expired_alone_costs_only_the_blocks_gone(
    s3_server: str, bucket: str
) -> None:
    """A lifecycle rule that expired ``config.json`` (and one block) while the other blocks
    stay: the tier records it again and drops exactly what a listing lacks, announced
    removed; the others stay announced and are served."""
    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 3, 1)
    expected = [bytes(host.slot_view(s)) for s in range(3)]
    assert run(store, JobKind.PUT, [1, 2, 3]).success
    store.take_events()
    fs = _objects(s3_server)
    fs.rm([f"{store.root}/config.json", store._io.path(key(2))])  # type: ignore[attr-defined]
    got = run(store, JobKind.GET, [1, 2, 3])
    assert not got.success
    assert got.ok_keys == frozenset({key(1), key(3)})
    store.poll()
    assert events_of(store) == [("removed", {2})]
    assert fs.exists(f"{store.root}/config.json")
    fill(host, 3, 99)
    assert run(store, JobKind.GET, [1, 3], [0, 2]).success
    assert [bytes(host.slot_view(s)) for s in (0, 2)] == [expected[0], expected[2]]
    store.close()


def test_a_deleted_bucket_is_announced_as_every_block_gone(private_s3_server: Any) -> None:
    """On moto, as on AWS S3: a PUT into a deleted bucket is refused (NoSuchBucket).
    SeaweedFS, whose buckets are filer directories, makes the bucket again on the next PUT
    by a principal allowed to, so this case needs a server with S3's own rule."""
    import s3fs

    host_name, port = private_s3_server.get_host_and_port()
    endpoint = f"http://{host_name}:{port}"
    bucket = "kvhex-deleted"
    s3fs.S3FileSystem(**s3_options(endpoint)).mkdir(bucket)
    host = MemoryHostBuffer(4, SLOT)
    store = tier(host, endpoint, bucket)
    fill(host, 2, 1)
    assert run(store, JobKind.PUT, [1, 2]).success
    store.take_events()
    fs = _objects(endpoint)
    fs.rm(bucket, recursive=True)
    if fs.exists(bucket):
        fs.rmdir(bucket)
    put = run(store, JobKind.PUT, [3], [0])
    assert not put.success
    assert "does not exist" in (put.error or "")
    assert events_of(store) == [("removed", {1, 2})]  # nothing stored, everything gone
    assert store.keys() == []
    assert not fs.exists(bucket)  # never created for you
    store.close()


def test_blocks_go_without_a_transport_checksum_unless_the_user_asks(
    wire_s3_server: Wire,
) -> None:
    """A block carries its own checksum, verified on every read: the CRC32 botocore adds to
    every PUT and asks of every GET by default is not asked for; ``config_kwargs`` win."""
    wire = wire_s3_server
    host = MemoryHostBuffer(1, SLOT)
    fill(host, 1, 3)
    plain = tier(host, wire.endpoint, wire.bucket)
    assert run(plain, JobKind.PUT, [0]).success
    assert run(plain, JobKind.GET, [0]).success
    plain.close()
    assert wire.block_requests("PUT")
    assert wire.block_requests("GET")
    assert wire.checksums() == []
    wanted = s3_options(
        wire.endpoint,
        config_kwargs={
            "request_checksum_calculation": "when_supported",
            "response_checksum_validation": "when_supported",
        },
    )
    asked = tier(host, wire.endpoint, wire.bucket, name="s3-crc", storage_options=wanted)
    assert run(asked, JobKind.PUT, [1]).success
    assert run(asked, JobKind.GET, [1]).success
    asked.close()
    assert any(c.startswith("PUT x-amz-checksum-crc32") for c in wire.checksums())
    assert "GET x-amz-checksum-mode: ENABLED" in wire.checksums()


def test_reads_go_straight_into_the_slots_by_signed_gets_of_their_own(
    wire_s3_server: Wire,
) -> None:
    """On an S3-compatible endpoint a block's GET is kvhex's own (signed, read into the
    slot), not s3fs's: the bytes are exact and the server saw a request signed with the
    tier's key."""
    wire = wire_s3_server
    host = MemoryHostBuffer(2, SLOT)
    fill(host, 2, 7)
    expected = [bytes(host.slot_view(s)) for s in range(2)]
    store = tier(host, wire.endpoint, wire.bucket)
    assert run(store, JobKind.PUT, [0, 1]).success
    fill(host, 2, 99)
    assert run(store, JobKind.GET, [0, 1], [1, 0]).success
    store.close()
    assert [bytes(host.slot_view(s)) for s in range(2)] == expected[::-1]
    gets = wire.block_requests("GET")
    assert len(gets) == 2
    for headers in gets:
        assert headers["user-agent"] == "kvhex"
        assert f"Credential={CREDENTIALS['key']}/" in headers["authorization"]


def test_writes_go_straight_from_the_slots_by_signed_puts_of_their_own(
    wire_s3_server: Wire,
) -> None:
    """On an S3-compatible endpoint a block's PUT is kvhex's own: signed with the tier's
    key, its payload not hashed into the signature (``UNSIGNED-PAYLOAD``: the block's
    header carries its checksum, verified on every read), and the object is the whole block
    (header area, then the slot's bytes), which a tier reading through s3fs alone serves."""
    import s3fs

    from kvhex.adapters.storage.format import HEADER_AREA

    wire = wire_s3_server
    host = MemoryHostBuffer(2, SLOT)
    fill(host, 2, 11)
    expected = [bytes(host.slot_view(s)) for s in range(2)]
    store = tier(host, wire.endpoint, wire.bucket)
    assert run(store, JobKind.PUT, [0, 1]).success
    store.close()
    puts = wire.block_requests("PUT")
    assert len(puts) == 2
    for headers in puts:
        assert headers["user-agent"] == "kvhex"
        assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
        assert f"Credential={CREDENTIALS['key']}/" in headers["authorization"]
    fs = s3fs.S3FileSystem(**s3_options(wire.endpoint))
    blocks = [p for p in fs.find(wire.bucket) if p.endswith(".blk")]
    bodies = [fs.cat(p) for p in blocks]
    assert sorted(len(b) for b in bodies) == [HEADER_AREA + SLOT] * 2
    assert sorted(b[HEADER_AREA:] for b in bodies) == sorted(expected)
    # a tier that asks for signed payloads sends and reads through s3fs, and serves them
    signed = s3_options(wire.endpoint, config_kwargs={"s3": {"payload_signing_enabled": True}})
    other = tier(host, wire.endpoint, wire.bucket, name="s3-signed", storage_options=signed)
    fill(host, 2, 99)
    assert run(other, JobKind.GET, [0, 1], [1, 0]).success
    assert run(other, JobKind.PUT, [2], [0]).success
    other.close()
    assert [bytes(host.slot_view(s)) for s in range(2)] == expected[::-1]
    last = wire.block_requests("PUT")[-1]
    assert last["user-agent"] != "kvhex"
    assert last["x-amz-content-sha256"] != "UNSIGNED-PAYLOAD"
    assert all(h["user-agent"] != "kvhex" for h in wire.block_requests("GET"))


def test_own_puts_the_server_keeps_refusing_give_way_to_s3fs_for_good(
    wire_s3_server: Wire,
) -> None:
    """A server (or a proxy before it) that refuses the tier's own PUTs but takes s3fs's:
    every block is stored and served exact; after ``REFUSED_JOBS`` such jobs in a row the
    tier stops sending its own requests and says why, once."""
    from structlog.testing import capture_logs

    from kvhex.adapters.storage.objects.mover import REFUSED_JOBS

    wire = wire_s3_server
    wire.refused_agents["kvhex"] = 403
    wire.refused_methods.clear()
    wire.refused_methods.add("PUT")
    host = MemoryHostBuffer(2, SLOT)
    store = tier(host, wire.endpoint, wire.bucket)
    jobs = REFUSED_JOBS + 2
    with capture_logs() as logs:
        for job in range(jobs):
            fill(host, 2, job)
            assert run(store, JobKind.PUT, [2 * job, 2 * job + 1]).success
    for job in range(jobs):
        assert run(store, JobKind.GET, [2 * job, 2 * job + 1]).success
        assert [bytes(host.slot_view(s)) for s in range(2)] == [
            bytes([(job + s) % 256]) * SLOT for s in range(2)
        ]
    store.close()
    agents = [headers["user-agent"] for headers in wire.block_requests("PUT")]
    assert agents.count("kvhex") == REFUSED_JOBS * 2
    assert len(agents) == (2 * REFUSED_JOBS + (jobs - REFUSED_JOBS)) * 2  # then s3fs's alone
    off = [entry for entry in logs if entry["event"] == "s3_direct_requests_off"]
    assert len(off) == 1
    assert off[0]["last_refusal"] == "PUT HTTP 403"


def stored(wire: Wire, n: int) -> tuple[MemoryHostBuffer, list[bytes], FsspecTierStore]:
    """A tier on ``wire`` that stored ``n`` blocks from host slots ``0..n-1``; the host
    buffer and those blocks' bytes."""
    host = MemoryHostBuffer(n, SLOT)
    fill(host, n, 11)
    expected = [bytes(host.slot_view(s)) for s in range(n)]
    store = tier(host, wire.endpoint, wire.bucket)
    assert run(store, JobKind.PUT, list(range(n))).success
    return host, expected, store


def test_own_gets_keep_connections_alive_where_the_server_does(wire_s3_server: Wire) -> None:
    """Many reads over few connections on a keep-alive server (one each on a server that
    closes them), every byte exact."""
    wire = wire_s3_server
    n = 24
    host, expected, store = stored(wire, n)
    for _ in range(3):
        fill(host, n, 200)
        assert run(store, JobKind.GET, list(range(n))).success
        assert [bytes(host.slot_view(s)) for s in range(n)] == expected
    store.close()
    gets = wire.block_requests("GET")
    assert len(gets) == 3 * n
    connections = len({headers["remote-port"] for headers in gets})
    if wire.keep_alive:
        assert connections <= min(n, REQUESTS_IN_FLIGHT)
    else:
        assert connections == 3 * n


def test_own_gets_the_server_keeps_refusing_give_way_to_s3fs_for_good(
    wire_s3_server: Wire,
) -> None:
    """A server (or a proxy before it) that refuses the tier's own GETs but serves s3fs's:
    every read is exact, through s3fs; after ``REFUSED_JOBS`` such jobs in a row the tier
    stops sending its own GETs (one request per block, not two) and says why, once."""
    from structlog.testing import capture_logs

    from kvhex.adapters.storage.objects.mover import REFUSED_JOBS

    wire = wire_s3_server
    wire.refused_agents["kvhex"] = 403
    n = 4
    host, expected, store = stored(wire, n)
    with capture_logs() as logs:
        for _ in range(REFUSED_JOBS + 2):
            fill(host, n, 200)
            assert run(store, JobKind.GET, list(range(n))).success
            assert [bytes(host.slot_view(s)) for s in range(n)] == expected
    store.close()
    agents = [headers["user-agent"] for headers in wire.block_requests("GET")]
    assert agents.count("kvhex") == REFUSED_JOBS * n
    assert len(agents) == (2 * REFUSED_JOBS + 2) * n  # then s3fs's alone
    off = [entry for entry in logs if entry["event"] == "s3_direct_requests_off"]
    assert len(off) == 1
    assert off[0]["last_refusal"] == "GET HTTP 403"


@pytest.mark.parametrize("status", [403, 503], ids=["refused-for-a-while", "throttled"])
def test_own_gets_stay_on_through_passing_refusals_and_server_errors(
    wire_s3_server: Wire, status: int
) -> None:
    """Refusals that are not ``REFUSED_JOBS`` jobs in a row (a server that refused for a
    while), or any number of server errors (503 SlowDown: throttling, which s3fs retries),
    leave the tier's own GETs on."""
    from kvhex.adapters.storage.objects.mover import REFUSED_JOBS

    wire = wire_s3_server
    _, _, store = stored(wire, 2)
    for _ in range(2):
        wire.refused_agents["kvhex"] = status
        for _ in range(REFUSED_JOBS - 1 if status == 403 else REFUSED_JOBS + 1):
            assert run(store, JobKind.GET, [0, 1]).success
        wire.refused_agents.clear()
        assert run(store, JobKind.GET, [0, 1]).success
    store.close()
    agents = [headers["user-agent"] for headers in wire.block_requests("GET")]
    assert agents[-2:] == ["kvhex", "kvhex"]  # still the tier's own


@pytest.mark.parametrize(
    ("endpoint", "extra"),
    [
        ("https://s3.us-east-1.amazonaws.com", {}),
        ("http://127.0.0.1:9", {"config_kwargs": {"s3": {"addressing_style": "virtual"}}}),
        ("https://127.0.0.1:9", {"client_kwargs": {"verify": False}}),
        (
            "http://127.0.0.1:9",
            {"config_kwargs": {"response_checksum_validation": "when_supported"}},
        ),
        ("http://[::1]:9", {}),
    ],
    ids=["aws", "virtual-hosted", "own-certificates", "crc-asked", "ipv6"],
)
def test_reads_are_left_to_s3fs_where_a_request_is_not_plain(
    endpoint: str, extra: dict[str, Any]
) -> None:
    """AWS's own endpoints, virtual-hosted addressing, a custom certificate check, a CRC
    check asked of botocore or an IPv6 endpoint: s3fs reads, as botocore builds requests for
    that client."""
    from kvhex.adapters.storage.namespace import StoreOptions, open_fs
    from kvhex.adapters.storage.objects.s3_direct import DirectS3

    fs, _, _ = open_fs("s3://b/kv", s3_options(endpoint, **extra), "s3", StoreOptions())
    fs.connect()
    assert DirectS3.of(fs) is None
    plain, _, _ = open_fs("s3://b/kv", s3_options("http://127.0.0.1:9"), "s3", StoreOptions())
    plain.connect()
    reader = DirectS3.of(plain)
    assert isinstance(reader, DirectS3)
    reader.close()


def test_an_object_cut_short_is_corrupt_and_never_served(s3_server: str, bucket: str) -> None:
    """A block's object shorter than a block (a writer that was not kvhex's): the read says
    corrupt, announces it gone and leaves the slot's bytes unused."""
    import s3fs

    host = MemoryHostBuffer(2, SLOT)
    store = tier(host, s3_server, bucket)
    fill(host, 1, 5)
    assert run(store, JobKind.PUT, [1]).success
    store.take_events()
    fs = s3fs.S3FileSystem(**s3_options(s3_server))
    path = store.location(key(1))[0]
    fs.pipe_file(path, fs.cat_file(path)[:-1])
    result = run(store, JobKind.GET, [1], [1])
    assert not result.success
    assert result.ok_keys == frozenset()
    (removed,) = store.take_events()
    assert isinstance(removed, Removed)
    assert removed.keys == (key(1),)
    assert store.corrupt_blocks == 1
    store.close()
