"""``kvhex tiers`` as a user runs it: the built-ins listed and loaded, a third party's plugin
beside them, a broken one with its error and install hint, duplicates, and bad flags."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.cli.command import kvhex

BUILTINS = {
    ("kvhex.tiers", "memory"),
    ("kvhex.tiers", "fsspec"),
    ("kvhex.tiers", "nixl"),
    ("kvhex.transfers", "memory"),
    ("kvhex.transfers", "torch"),
    ("kvhex.sinks", "memory"),
    ("kvhex.sinks", "jsonl"),
    ("kvhex.sinks", "log"),
    ("kvhex.sinks", "zmq"),
    ("kvhex.policies", "lru"),
    ("kvhex.policies", "arc"),
}

POLICY = """
class DemoPolicy:
    def __init__(self, capacity): self.capacity = capacity
    def insert(self, keys): pass
    def remove(self, keys): pass
    def mark_evictable(self, keys): pass
    def mark_pinned(self, keys): pass
    def touch(self, keys, ctx): pass
    def evict(self, n, protected): return None
    def clear(self): pass
"""


def third_party(site: Path, entry_points: str) -> dict[str, str]:
    """A distribution ``thirdparty-demo 1.2.3`` installed into ``site`` with these entry
    points (as pip leaves one: a module and its dist-info); the environment that finds it."""
    (site / "thirdparty_demo.py").write_text(POLICY)
    info = site / "thirdparty_demo-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-demo\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(entry_points)
    return {"PYTHONPATH": str(site)}


def test_every_builtin_is_listed_as_built_in_and_loads() -> None:
    done = kvhex("tiers")
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()[1:-1]]
    listed = {(f"kvhex.{row[0]}", row[1]) for row in rows}
    assert listed >= BUILTINS
    for row in rows:
        if (f"kvhex.{row[0]}", row[1]) in BUILTINS:
            assert row[2:6] == ["kvhex", version("kvhex"), "yes", "ok"], row
    assert done.stdout.splitlines()[-1] == f"{len(rows)} plugins, {len(rows)} load, 0 fail"


def test_json_lists_the_same_with_every_field() -> None:
    done = kvhex("tiers", "--json", "--check")
    assert done.returncode == 0, done.stderr
    plugins = json.loads(done.stdout)["plugins"]
    by_name = {(p["group"], p["name"]): p for p in plugins}
    assert set(by_name) >= BUILTINS
    fsspec = by_name[("kvhex.tiers", "fsspec")]
    assert fsspec == {
        "group": "kvhex.tiers",
        "name": "fsspec",
        "target": "kvhex.adapters.storage.fsspec:FsspecTierStore [files]",
        "distribution": "kvhex",
        "version": version("kvhex"),
        "builtin": True,
        "extras": ["files"],
        "loaded": True,
        "error": None,
    }


def test_a_third_party_plugin_and_a_broken_one(tmp_path: Path) -> None:
    env = third_party(
        tmp_path,
        "[kvhex.policies]\ndemo = thirdparty_demo:DemoPolicy\n\n"
        "[kvhex.tiers]\nbroken = thirdparty_missing:Tier [gpu]\n",
    )
    done = kvhex("tiers", env=env)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    demo = next(line for line in lines if line.startswith("policies") and " demo " in line)
    assert demo.split()[2:6] == ["thirdparty-demo", "1.2.3", "no", "ok"]
    broken = lines.index(next(line for line in lines if " broken " in line))
    assert lines[broken].split()[2:6] == ["thirdparty-demo", "1.2.3", "no", "FAILED"]
    error = lines[broken + 1]
    assert "kvhex.tiers entry point 'broken'" in error
    assert "thirdparty_missing" in error
    assert "pip install 'thirdparty-demo[gpu]'" in error
    assert lines[-1].endswith("1 fail")

    checked = kvhex("tiers", "--check", "--json", env=env)
    assert checked.returncode == 1
    failed = [p for p in json.loads(checked.stdout)["plugins"] if not p["loaded"]]
    assert [(p["name"], p["builtin"]) for p in failed] == [("broken", False)]
    assert "fail to load" in checked.stderr

    policies = kvhex("tiers", "--group", "policies", "--check", env=env)
    assert policies.returncode == 0
    assert {line.split()[0] for line in policies.stdout.splitlines()[1:-1]} == {"policies"}


def test_a_name_declared_twice_is_refused_naming_both(tmp_path: Path) -> None:
    env = third_party(tmp_path, "[kvhex.policies]\nlru = thirdparty_demo:DemoPolicy\n")
    done = kvhex("tiers", env=env)
    assert done.returncode == 1
    assert "'lru'" in done.stderr
    assert "kvhex" in done.stderr
    assert "thirdparty-demo" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "named"), [(["tiers", "--bogus"], "--bogus"), (["tiers", "--group", "x"], "--group")]
)
def test_bad_flags_exit_2_naming_the_flag(args: list[str], named: str) -> None:
    done = kvhex(*args)
    assert done.returncode == 2
    assert named in done.stderr
