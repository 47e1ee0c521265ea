"""Installs the third-party fixture distributions for real (pip, no index, no network) into a
private directory, and puts that directory on sys.path only for the tests that ask."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures"


def _install(name: str, target: Path) -> Path:
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
            str(FIXTURES / name),
        ],
        check=True,
    )
    return target


@pytest.fixture(scope="session")
def fifo_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install("kvhex-fifo-policy", tmp_path_factory.mktemp("fifo-site"))


@pytest.fixture(scope="session")
def shadow_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install("kvhex-shadow-lru", tmp_path_factory.mktemp("shadow-site"))


def _on_path(site: Path) -> Iterator[Path]:
    sys.path.insert(0, str(site))
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for mod in [m for m in sys.modules if m.startswith(("kvhex_fifo", "kvhex_shadow"))]:
            del sys.modules[mod]


@pytest.fixture
def with_fifo(fifo_site: Path) -> Iterator[Path]:
    yield from _on_path(fifo_site)


@pytest.fixture
def with_shadow(shadow_site: Path) -> Iterator[Path]:
    yield from _on_path(shadow_site)
