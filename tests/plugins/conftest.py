"""Installs the third-party fixture distributions and the example tier, transfer and codec
for real (pip, no index, no network) into private directories, and puts one on sys.path only
for the tests that ask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures"
EXAMPLES = Path(__file__).parent.parent.parent / "examples"
MODULES = ("kvhex_fifo", "kvhex_shadow", "kvhex_sqlite", "kvhex_counting", "kvhex_zlib")
"""Forgotten when a site leaves sys.path."""


def env_with(site: Path) -> dict[str, str]:
    """This interpreter's environment with an installed site first on the path, and no
    bytecode or cache written into the source tree (for a child process)."""
    path = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONDONTWRITEBYTECODE": "1"}


def run_own_suite(example: Path, site: Path, report: Path) -> ET.Element:
    """Run an example's own tests (its pytest settings apply) against its installed
    distribution in ``site``; they must pass. Returns the JUnit ``testsuite``."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=example,
        env=env_with(site),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    suite = ET.parse(report).getroot().find("testsuite")
    assert suite is not None
    return suite


def imported_from(example: Path, site: Path, module: str) -> Path:
    """Where a child process run in the example's source tree imports ``module`` from."""
    imported = subprocess.run(
        [sys.executable, "-c", f"import {module} as m; print(m.__file__)"],
        cwd=example,
        env=env_with(site),
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(imported.stdout.strip())


def kvhex_run(site: Path, config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``kvhex run --config config --json`` in a child process with ``site`` on its path."""
    command = ["run", "--config", str(config), "--json", "--no-progress", *flags]
    return subprocess.run(
        [sys.executable, "-m", "kvhex", *command],
        env=env_with(site),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def run_summary(site: Path, config: Path, *flags: str) -> dict[str, Any]:
    """:func:`kvhex_run`, which must succeed; its JSON summary."""
    done = kvhex_run(site, config, *flags)
    assert done.returncode == 0, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


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


@pytest.fixture(scope="session")
def zlib_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The worked example codec, installed as a user would install it."""
    return _install(EXAMPLES / "kvhex-zlib-codec", tmp_path_factory.mktemp("zlib-site"))


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


@pytest.fixture
def with_zlib(zlib_site: Path) -> Iterator[Path]:
    yield from _on_path(zlib_site)
