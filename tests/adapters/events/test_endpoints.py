"""ZMQ endpoints: what is refused before a socket sees it, and what a real bind refuses,
named by the sink's option and said as what would work."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest
import zmq

from kvhex.adapters.events.endpoints import endpoint_problem, is_endpoint, refusal
from kvhex.adapters.events.zmq import ZmqEventSink
from kvhex.domain.events import AllBlocksCleared, EventBatch
from kvhex.errors import ConfigError


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5557", "tcp://*:5557", "tcp://127.0.0.1:*", "tcp://[::1]:5557", "ipc:///x"],
)
def test_usable_endpoints_pass(endpoint: str) -> None:
    assert endpoint_problem(endpoint, bind=True) is None


@pytest.mark.parametrize(
    ("endpoint", "bind", "said"),
    [
        ("127.0.0.1:5557", True, "not an endpoint"),
        ("udp://127.0.0.1:5557", True, "transport 'udp' cannot carry KV events"),
        ("pgm://eth0;239.0.0.1:5555", True, "transport 'pgm'"),
        ("tcp://", True, "needs an address"),
        ("tcp://127.0.0.1", True, "needs a host and a port"),
        ("tcp://:5557", True, "needs a host and a port"),
        ("tcp://127.0.0.1:http", True, "port 'http' is not a number"),
        ("tcp://127.0.0.1:0x10", True, "is not a number"),
        ("tcp://127.0.0.1:-1", True, "is not a number"),
        ("tcp://127.0.0.1:99999", True, "port 99999 is out of range: give 1-65535 or *"),
        ("tcp://127.0.0.1:0", False, "port 0 is out of range: give 1-65535"),
        ("tcp://127.0.0.1:*", False, "cannot connect to port *"),
    ],
)
def test_unusable_endpoints_are_refused_saying_what_would_work(
    endpoint: str, bind: bool, said: str
) -> None:
    problem = endpoint_problem(endpoint, bind=bind)
    assert problem is not None
    assert said in problem


def test_endpoints_and_files_are_told_apart() -> None:
    assert is_endpoint("tcp://127.0.0.1:5557")
    assert not is_endpoint("events.jsonl")


def test_refusals_say_what_would_work() -> None:
    assert "pick a free port" in refusal(errno.EADDRINUSE, "Address in use", bind=True)
    foreign = refusal(errno.EADDRNOTAVAIL, "x", bind=True, may_connect=True)
    assert "no interface of this machine has that address" in foreign
    assert "connect to it instead" in foreign
    assert "connect instead" not in refusal(errno.EADDRNOTAVAIL, "x", bind=True)
    assert refusal(12345, "Odd failure", bind=False) == "cannot connect: Odd failure"


@pytest.fixture
def taken() -> Iterator[str]:
    """A loopback TCP port something else listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield f"tcp://127.0.0.1:{other.getsockname()[1]}"


def test_a_port_in_use_names_the_option(taken: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ZmqEventSink(taken)
    ((option, problem),) = caught.value.issues
    assert option == "endpoint"
    assert f"endpoint '{taken}': address already in use" in problem
    with pytest.raises(ConfigError) as caught:
        ZmqEventSink("tcp://127.0.0.1:*", taken)
    ((option, problem),) = caught.value.issues
    assert option == "replay_endpoint"
    assert "address already in use" in problem


def test_an_address_of_another_machine_cannot_be_bound() -> None:
    with pytest.raises(ConfigError, match="no interface of this machine has that address"):
        ZmqEventSink("tcp://192.0.2.1:5557")  # TEST-NET-1: nobody's


def test_every_bad_endpoint_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        ZmqEventSink("udp://x:1", "tcp://127.0.0.1:70000")
    assert [option for option, _ in caught.value.issues] == ["endpoint", "replay_endpoint"]


def test_a_rank_offset_past_the_last_port_is_refused() -> None:
    with pytest.raises(
        ConfigError, match=r"offset by data-parallel rank 3 to 'tcp://127\.0\.0\.1:65538'"
    ):
        ZmqEventSink("tcp://127.0.0.1:65535", data_parallel_rank=3)
    with pytest.raises(ConfigError, match="needs a tcp:// or inproc:// endpoint"):
        ZmqEventSink("ipc:///tmp/kvhex-events", data_parallel_rank=1)


def test_a_connecting_sink_reaches_a_bound_subscriber() -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    sink = ZmqEventSink(endpoint, connect=True)
    try:
        assert sink.endpoint == endpoint
        got = None
        for i in range(200):  # until the subscription has reached the connecting PUB
            sink.publish(EventBatch(float(i), [AllBlocksCleared()]))
            if sub.poll(50):
                got = sub.recv_multipart()
                break
        assert got is not None, "nothing arrived"
    finally:
        sink.close()
        sub.close(linger=0)


def test_close_delivers_what_was_queued() -> None:
    ctx = zmq.Context.instance()
    sink = ZmqEventSink("tcp://127.0.0.1:*")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sink.endpoint)
    try:
        for i in range(200):  # until subscribed
            sink.publish(EventBatch(float(i), [AllBlocksCleared()]))
            if sub.poll(20):
                break
        while sub.poll(100):
            sub.recv_multipart()
        for i in range(500):
            sink.publish(EventBatch(float(1000 + i), [AllBlocksCleared()]))
        sink.close()  # returns after the queue went out (or its linger ran out)
        received = 0
        while sub.poll(1000):
            sub.recv_multipart()
            received += 1
        assert received == 500
    finally:
        sub.close(linger=0)
