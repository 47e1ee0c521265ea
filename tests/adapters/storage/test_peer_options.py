"""The peer-view options of the storage tiers: bad values are errors naming the option,
from a configuration file (at its key) and from Python, before anything is built; the
``SHARED`` locality is accepted where localities are."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.fsspec import FsspecTierStore
from kvhex.adapters.storage.nixl import NixlTierStore
from kvhex.bootstrap import build_engine
from kvhex.config import load_config
from kvhex.config.model import CHECKS
from kvhex.domain import Locality
from kvhex.errors import ConfigError
from kvhex.plugins import Registry

SLOT = 4096


def _issues(tmp_path: Path, tier_type: str, **options: Any) -> dict[str, str]:
    root = tmp_path / "root"
    config = load_config(
        {
            "primary": {"capacity_bytes": 4 * SLOT},
            "tiers": [
                {
                    "type": tier_type,
                    "options": {"url": str(root), "capacity_bytes": 1 << 20, **options},
                }
            ],
        }
    )
    with pytest.raises(ConfigError) as info:
        build_engine(
            config, MemoryHostBuffer(4, SLOT), Registry.discover(), namespace={"model": "m"}
        )
    assert not root.exists(), "nothing was built"
    return dict(info.value.issues)


@pytest.mark.parametrize("tier_type", ["fsspec", "nixl"])
@pytest.mark.parametrize(
    ("options", "key", "says"),
    [
        ({"announce_peers": "yes"}, "announce_peers", "expected bool, got str 'yes'"),
        ({"announce_peers": 1}, "announce_peers", "expected bool, got int 1"),
        ({"peer_scan_interval_s": "1s"}, "peer_scan_interval_s", "expected float, got str"),
        ({"peer_scan_interval_s": 0}, "peer_scan_interval_s", "greater than 0"),
        ({"peer_scan_interval_s": -1.5}, "peer_scan_interval_s", "greater than 0"),
        ({"peer_scan_interval_s": 3601}, "peer_scan_interval_s", "at most 3600 seconds"),
        ({"peer_scan_interval_s": math.inf}, "peer_scan_interval_s", "got inf"),
        ({"peer_scan_interval_s": math.nan}, "peer_scan_interval_s", "got nan"),
    ],
)
def test_bad_peer_options_are_errors_at_their_key(
    tmp_path: Path, tier_type: str, options: dict[str, Any], key: str, says: str
) -> None:
    issues = _issues(tmp_path, tier_type, **options)
    assert list(issues) == [f"$.tiers[0].options.{key}"]
    assert says in issues[f"$.tiers[0].options.{key}"]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"announce_peers": "true"}, TypeError),
        ({"peer_scan_interval_s": True}, TypeError),
        ({"peer_scan_interval_s": 0.0}, ValueError),
        ({"peer_scan_interval_s": 7200}, ValueError),
    ],
)
@pytest.mark.parametrize("tier_class", [FsspecTierStore, NixlTierStore])
def test_bad_peer_options_from_python_name_the_option(
    tmp_path: Path, tier_class: type[Any], options: dict[str, Any], error: type[Exception]
) -> None:
    (name,) = options
    with pytest.raises(error, match=name):
        tier_class(
            MemoryHostBuffer(2, SLOT), str(tmp_path / "r"), capacity_bytes=1 << 20, **options
        )
    assert not (tmp_path / "r").exists()


def test_good_peer_options_and_the_shared_locality(tmp_path: Path) -> None:
    host = MemoryHostBuffer(2, SLOT)
    store = FsspecTierStore(
        host,
        str(tmp_path),
        capacity_bytes=1 << 20,
        name="shared",
        locality=Locality.SHARED,
        announce_peers=True,
        peer_scan_interval_s=3600,
    )
    assert store.identity.locality is Locality.SHARED
    assert store.peer_identity.locality is Locality.SHARED
    assert store.peer_identity.ownership == "shared@peers"
    store.close()
    check = CHECKS[Locality]
    assert check("shared") is Locality.SHARED
    with pytest.raises(ValueError, match="must be 'LOCAL', 'REMOTE' or 'SHARED', got 'nearby'"):
        check("nearby")
    config = load_config(
        {
            "primary": {"capacity_bytes": 4 * SLOT},
            "tiers": [
                {
                    "type": "fsspec",
                    "name": "shared",
                    "options": {
                        "url": str(tmp_path),
                        "capacity_bytes": 1 << 20,
                        "locality": "SHARED",
                        "announce_peers": True,
                    },
                }
            ],
        }
    )
    engine, (tier,) = build_engine(
        config, MemoryHostBuffer(4, SLOT), Registry.discover(), namespace={"model": "m"}
    )
    try:
        assert isinstance(tier, FsspecTierStore)
        assert tier.identity.locality is Locality.SHARED
        # the engine announces both identities as one residency, with no ownership name
        public = engine.announcer.public(tier.identity)
        assert engine.announcer.public(tier.peer_identity) == public
        assert public.locality is Locality.SHARED
        assert public.ownership is None
    finally:
        engine.shutdown()
