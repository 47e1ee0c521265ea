"""Building the engine a configuration describes: every entry is checked before anything is
built, what a tier refuses while it is built (an S3 store that cannot be used included) is a
``ConfigError`` at the key to correct, naming the file, and nothing stays half-started."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryEventSink, MemoryHostBuffer, MemoryTierStore
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.domain import JobKind
from kvhex.errors import ConfigError, TierUnavailable
from kvhex.plugins import SINKS, TIERS, Registry
from tests.adapters.conftest import CREDENTIALS, AuthS3, s3_options
from tests.adapters.jobs import run

SLOT = 4096
SOURCE = "kvhex.toml"
FAST = {"connect_timeout": 1, "read_timeout": 1, "retries": {"max_attempts": 1}}


def _fails(
    tiers: list[dict[str, Any]],
    sinks: Sequence[dict[str, Any]] = (),
    registry: Registry | None = None,
) -> ConfigError:
    """The error of building ``tiers`` and ``sinks`` over 4 host slots, loaded from a file."""
    config = load_config(
        {"primary": {"capacity_bytes": 4 * SLOT}, "tiers": tiers, "sinks": list(sinks)}
    )
    with pytest.raises(ConfigError) as info:
        build_engine(
            config,
            MemoryHostBuffer(4, SLOT),
            registry or Registry.discover(),
            namespace={"model": "m"},
            source=SOURCE,
        )
    assert info.value.source == SOURCE
    return info.value


def test_every_entry_is_checked_before_anything_is_built(tmp_path: Path) -> None:
    first = tmp_path / "first"
    events = tmp_path / "events.jsonl"
    error = _fails(
        [
            {"type": "fsspec", "options": {"url": str(first), "capacity_bytes": 1 << 24}},
            {"type": "memory", "name": "small", "options": {"capacity_bytes": SLOT - 1}},
            {"type": "memory", "name": "m", "options": {"capacity_bytes": SLOT, "colour": 1}},
            {"type": "nosuch"},
        ],
        [{"type": "jsonl", "options": {"path": str(events), "bogus": True}}],
    )
    assert error.paths == (
        "$.tiers[1].options.capacity_bytes",
        "$.tiers[2].options.colour",
        "$.tiers[3].type",
        "$.sinks[0].options.bogus",
    )
    problems = dict(error.issues)
    small = problems["$.tiers[1].options.capacity_bytes"]
    assert small.startswith("4095 bytes hold no block of 4096 bytes (one host slot)")
    assert "unknown kvhex tier 'nosuch'; available:" in problems["$.tiers[3].type"]
    assert not first.exists(), "the first tier was never built"
    assert not events.exists(), "the sink was never built"


def test_option_values_are_checked_against_the_factory_s_annotations(tmp_path: Path) -> None:
    options = {"url": str(tmp_path), "capacity_bytes": "big", "fsync": 1, "io_threads": True}
    error = _fails([{"type": "fsspec", "options": options}])
    assert error.issues == (
        ("$.tiers[0].options.capacity_bytes", "expected int or None, got str 'big'"),
        ("$.tiers[0].options.fsync", "expected bool, got int 1"),
        ("$.tiers[0].options.io_threads", "expected int or None, got bool True"),
    )
    assert list(tmp_path.iterdir()) == [], "nothing was built"


def test_a_value_a_tier_refuses_while_built_is_named_at_its_option(tmp_path: Path) -> None:
    """One host slot fits, but not the file tier's header beside it: the tier's own
    ValueError is placed at the option it names."""
    url = str(tmp_path / "kv")
    ((path, problem),) = _fails(
        [{"type": "fsspec", "options": {"url": url, "capacity_bytes": SLOT}}]
    ).issues
    assert path == "$.tiers[0].options.capacity_bytes"
    assert problem.startswith("rejected by kvhex tier 'fsspec': capacity_bytes 4096 holds no block")


def test_a_tier_that_cannot_start_is_named_at_its_url_and_what_was_built_is_closed(
    tmp_path: Path,
) -> None:
    built: list[Any] = []

    def recorded_tier(host: Any, *, capacity_bytes: int, name: str = "memory") -> MemoryTierStore:
        built.append(MemoryTierStore(host, capacity_bytes=capacity_bytes, name=name))
        return built[-1]

    def recorded_sink() -> MemoryEventSink:
        built.append(MemoryEventSink())
        return built[-1]

    registry = Registry.discover()
    registry.register(TIERS, "recorded", recorded_tier)
    registry.register(SINKS, "recorded", recorded_sink)
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    error = _fails(
        [
            {"type": "recorded", "name": "a", "options": {"capacity_bytes": SLOT}},
            {"type": "recorded", "name": "b", "options": {"capacity_bytes": SLOT}},
            {"type": "fsspec", "options": {"url": str(not_a_directory), "capacity_bytes": 1 << 24}},
        ],
        [{"type": "recorded"}],
        registry,
    )
    ((path, problem),) = error.issues
    assert path == "$.tiers[2].options.url"
    assert problem.startswith("kvhex tier 'fsspec' cannot start: cannot use root")
    sink, *tiers = built
    assert len(tiers) == 2
    assert isinstance(sink, MemoryEventSink)
    assert sink.closed
    for tier in tiers:
        with pytest.raises(TierUnavailable, match="closed"):
            run(tier, JobKind.PUT, [1])


# -- S3: each cause named as what it is, at the key to correct -----------------------------
def _s3_tier(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "fsspec",
        "name": "s3",
        "options": {
            "url": url,
            "capacity_bytes": 1 << 24,
            "locality": "REMOTE",
            "storage_options": storage_options,
        },
    }


def _assert_no_secrets(error: ConfigError, *secrets: str) -> None:
    for secret in secrets:
        assert secret not in str(error)


def test_an_s3_endpoint_that_is_down_is_named_at_the_endpoint(dead_endpoint: str) -> None:
    options = s3_options(dead_endpoint, config_kwargs=FAST)
    ((path, problem),) = _fails([_s3_tier("s3://kvhex-down/kv", options)]).issues
    assert path == "$.tiers[0].options.storage_options.endpoint_url"
    assert f"the endpoint {dead_endpoint} refused the connection" in problem
    assert "start the server or correct endpoint_url" in problem


def test_a_missing_s3_bucket_is_named_at_the_url(s3_server: str) -> None:
    error = _fails([_s3_tier("s3://kvhex-no-such-bucket/kv", s3_options(s3_server))])
    ((path, problem),) = error.issues
    assert path == "$.tiers[0].options.url"
    assert "bucket 'kvhex-no-such-bucket' does not exist (NoSuchBucket)" in problem
    _assert_no_secrets(error, CREDENTIALS["key"], CREDENTIALS["secret"])


@pytest.mark.parametrize(
    ("wrong", "key", "words"),
    [
        ("key", "key", "access key id is not known to the server (InvalidAccessKeyId)"),
        ("secret", "secret", "wrong secret key (SignatureDoesNotMatch)"),
    ],
)
def test_wrong_s3_credentials_are_named_at_the_credential(
    s3_auth_server: AuthS3, wrong: str, key: str, words: str
) -> None:
    admin = s3_auth_server.users["admin"]
    bad = {"key": "AKIAKVHEXUNKNOWNKEY1", "secret": "kvhex-wrong-secret-value"}[wrong]
    options = s3_options(s3_auth_server.endpoint, **{**admin, wrong: bad})
    error = _fails([_s3_tier(f"s3://{s3_auth_server.bucket}/kv", options)])
    ((path, problem),) = error.issues
    assert path == f"$.tiers[0].options.storage_options.{key}"
    assert words in problem
    _assert_no_secrets(error, bad, admin["key"], admin["secret"])
