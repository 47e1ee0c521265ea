"""kvhex installed as users install it: the sdist and the wheel built by the PEP 517 hooks
(hatchling's, from a copy of the source tree), each installed into a clean virtual
environment (packages from the registry, nothing from this one), then the ``kvhex`` command.

* A plain install (no torch): ``kvhex --version`` works, and ``kvhex run`` says in one line
  which extra it needs (exit 2, no traceback).
* With the extras the README names for the main job (``torch==2.13.0`` first, then
  ``kvhex[torch,files]``): a short ``kvhex run`` from the wheel, and from the sdist (where it
  compiles the native data path).
* The sdist installs where no C compiler is found (``CC=false``), its file tier then moving
  blocks in Python.
* The wheel holds ``py.typed``, the native data path's source and kvhex's entry points.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
TORCH = "torch==2.13.0"
MAIN_JOB_EXTRAS = "torch,files"
"""The extras the README's "installed as a package" section names for ``kvhex run``."""
RUN = ["run", "--requests", "30", "--no-progress", "--json"]


def _source_copy(target: Path) -> Path:
    """The files git tracks (and untracked ones it does not ignore), copied: a build never
    writes into the checkout (the build hook compiles next to the native source)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, listed):
        source = ROOT / os.fsdecode(name)
        if source.is_file():
            destination = target / os.fsdecode(name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The wheel and the sdist, built by hatchling's PEP 517 hooks."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the packaging check copies a git checkout: run it from one")
    source = _source_copy(tmp_path_factory.mktemp("source"))
    dist = tmp_path_factory.mktemp("dist")
    hooks = (
        "import sys, hatchling.build as b; "
        "print(b.build_wheel(sys.argv[1])); print(b.build_sdist(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", hooks, str(dist)],
        cwd=source,
        env=_user_env(),  # a user's build
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    wheel_name, sdist_name = done.stdout.split()
    return dist / wheel_name, dist / sdist_name


def clean_venv(where: Path) -> Path:
    """A new virtual environment with pip and nothing else; its ``bin``."""
    venv.create(where, with_pip=True, clear=True)
    return where / "bin"


def pip(bin_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        [
            str(bin_dir / "python"),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-cache-dir",  # no wheel an earlier install built: each install builds its own
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**_user_env(), **(env or {})},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


def _user_env() -> dict[str, str]:
    """This environment as a user's: none of the project's own build settings
    (``KVHEX_NATIVE=required``, which ``make`` sets) and nothing on ``PYTHONPATH``."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVHEX_NATIVE")}


def kvhex(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The installed ``kvhex`` script, run outside the checkout (nothing imported from it)."""
    env = _user_env()
    return subprocess.run(
        [str(bin_dir / "kvhex"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=cwd,
        env=env,
    )


def test_the_wheel_holds_types_the_native_source_and_the_entry_points(
    built: tuple[Path, Path],
) -> None:
    wheel, sdist = built
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (info,) = {n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA")}
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        meta = archive.read(f"{info}/METADATA").decode()
    assert "kvhex/py.typed" in names
    assert "kvhex/adapters/storage/files/_slotio.c" in names
    assert "kvhex/adapters/storage/files/_slotio.pyi" in names
    assert "kvhex/domain/_hostslots.c" in names
    assert "kvhex/domain/_hostslots.pyi" in names
    for group in (
        "kvhex.tiers",
        "kvhex.transfers",
        "kvhex.sinks",
        "kvhex.policies",
        "kvhex.codecs",
    ):
        assert f"[{group}]" in entry_points, group
    assert "kvhex = kvhex.cli:main" in entry_points
    assert "Requires-Python: >=3.11" in meta
    assert "Provides-Extra: all" in meta
    with tarfile.open(sdist) as archive:
        members = {m.name.split("/", 1)[1] for m in archive.getmembers() if "/" in m.name}
    assert not [m for m in members if m.endswith(".so")]  # built where it is installed
    for needed in (
        "pyproject.toml",
        "hatch_build.py",
        "src/kvhex/adapters/storage/files/_slotio.c",
        "src/kvhex/domain/_hostslots.c",
        "src/kvhex/py.typed",
    ):
        assert needed in members, needed


def test_a_plain_install_runs_what_it_can_and_names_the_extra_kvhex_run_needs(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    wheel, _ = built
    bin_dir = clean_venv(tmp_path / "plain")
    pip(bin_dir, str(wheel))
    version = kvhex(bin_dir, "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout.split()[0]) == (0, "kvhex")
    run = kvhex(bin_dir, *RUN, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "kvhex run: needs torch, not installed: pip install 'kvhex[torch]'"
    )
    listed = kvhex(bin_dir, "tiers", cwd=tmp_path)
    assert listed.returncode == 0
    assert "pip install 'kvhex[files]'" in listed.stdout  # the file tier's hint, unloaded


@pytest.mark.parametrize("artifact", ["wheel", "sdist"])
def test_the_main_job_runs_with_the_extras_the_readme_names(
    built: tuple[Path, Path], tmp_path: Path, artifact: str
) -> None:
    wheel, sdist = built
    bin_dir = clean_venv(tmp_path / artifact)
    pip(bin_dir, TORCH)  # first, as the README says: else pip pulls a CUDA build
    package = wheel if artifact == "wheel" else sdist
    pip(bin_dir, f"kvhex[{MAIN_JOB_EXTRAS}] @ {package.as_uri()}")
    run = kvhex(bin_dir, *RUN, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert '"verdict": "intact"' in run.stdout
    # a compiler is here: the install built both native modules
    assert data_path(bin_dir, tmp_path) == "native native"


def data_path(bin_dir: Path, cwd: Path) -> str:
    """``native`` or ``python``, twice: the file tier's data path and the host tier's LRU
    bookkeeping in the installed kvhex (the last line: a tier without the native path warns
    first)."""
    probe = (
        "from kvhex.adapters.storage.files.posix import PosixSlotMover; "
        "from kvhex.domain import LruPolicy, PrimaryTier; "
        "print('native' if PosixSlotMover().native else 'python', "
        "'native' if PrimaryTier(1, LruPolicy(1)).native else 'python')"
    )
    done = subprocess.run(
        [str(bin_dir / "python"), "-c", probe], capture_output=True, text=True, check=True, cwd=cwd
    )
    return done.stdout.splitlines()[-1]


def test_the_sdist_installs_without_a_compiler(built: tuple[Path, Path], tmp_path: Path) -> None:
    _, sdist = built
    bin_dir = clean_venv(tmp_path / "no-compiler")
    pip(bin_dir, f"kvhex[files] @ {sdist.as_uri()}", env={"CC": "false"})
    assert data_path(bin_dir, tmp_path) == "python python"
    assert kvhex(bin_dir, "--version", cwd=tmp_path).returncode == 0
