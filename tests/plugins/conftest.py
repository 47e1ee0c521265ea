"""Installs the third-party fixture distributions and the example tier and transfer for real
(pip, no index, no network) into private directories, and puts one on sys.path only for the
tests that ask."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures"
EXAMPLES = Path(__file__).parent.parent.parent / "examples"
MODULES = ("kvhex_fifo", "kvhex_shadow", "kvhex_sqlite", "kvhex_counting")
"""Forgotten when a site leaves sys.path."""


def env_with(site: Path) -> dict[str, str]:
    """This interpreter's environment with an installed site first on the path, and no
    bytecode or cache written into the source tree (for a child process)."""
    path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1"}


def _install(source: Path, target: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--target",
            str(target),
            str(source),
        ],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def fifo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install(FIXTURES / "kvhex-fifo-policy", tmp_path_factory.mktemp("fifo-site"))


@pytest.fixture(scope="session")
def shadow_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install(FIXTURES / "kvhex-shadow-lru", tmp_path_factory.mktemp("shadow-site"))


@pytest.fixture(scope="session")
def sqlite_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worked example tier, installed as a user would install it."""
    return _install(EXAMPLES / "kvhex-sqlite-tier", tmp_path_factory.mktemp("sqlite-site"))


@pytest.fixture(scope="session")
def counting_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worked example transfer, installed as a user would install it."""
    return _install(EXAMPLES / "kvhex-counting-transfer", tmp_path_factory.mktemp("counting-site"))


def _on_path(site: Path) -> Iterator[Path]:
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for mod in [m for m in sys.modules if m.startswith(MODULES)]:
            del sys.modules[mod]


@pytest.fixture
def with_fifo(fifo_site: Path) -> Iterator[Path]:
    yield from _on_path(fifo_site)


@pytest.fixture
def with_shadow(shadow_site: Path) -> Iterator[Path]:
    yield from _on_path(shadow_site)


@pytest.fixture
def with_sqlite(sqlite_site: Path) -> Iterator[Path]:
    yield from _on_path(sqlite_site)


@pytest.fixture
def with_counting(counting_site: Path) -> Iterator[Path]:
    yield from _on_path(counting_site)
