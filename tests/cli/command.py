"""Running the ``kvhex`` command as a user does: a child process of this Python."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO


def kvhex(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """``python -m kvhex ARGS``, finished, with its exit status, stdout and stderr (a
    default run on a slow machine takes about a minute)."""
    return subprocess.run(
        [sys.executable, "-m", "kvhex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def spawn(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m kvhex ARGS`` started in the background (stdout and stderr piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvhex", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


class Lines:
    """The lines a child writes to one of its pipes, read as they come by a thread of their
    own (so the child never blocks on a full pipe), with a wait for a line that matters."""

    def __init__(self, pipe: IO[str] | None) -> None:
        assert pipe is not None, "the pipe was not captured"
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe: IO[str]) -> None:
        with pipe:
            for line in pipe:
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def wait_for(self, found: Callable[[list[str]], bool], timeout: float = 60) -> list[str]:
        """Block until ``found(lines so far)`` holds; the lines then. Fails the test when the
        pipe closes or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while not found(self.lines):
                left = deadline - time.monotonic()
                assert not self._closed, f"the pipe closed first: {self.lines[-20:]}"
                assert left > 0, f"not within {timeout} s: {self.lines[-20:]}"
                self._changed.wait(left)
            return list(self.lines)

    def text(self, timeout: float = 60) -> str:
        """Everything, once the pipe has closed."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the pipe did not close"
        return "\n".join(self.lines)


def small_config(tmp_path: Path, extra: str = "") -> Path:
    """A configuration of a 4 MiB host tier and a 64 MiB file tier ``disk`` under
    ``tmp_path``, 40 requests of a small model (``extra``: more ``[run]`` keys)."""
    config = tmp_path / "kvhex.toml"
    config.write_text(
        f"""
[primary]
capacity_bytes = 4194304

[[tiers]]
type = "fsspec"
name = "disk"
options = {{ url = "{tmp_path / "tier"}", capacity_bytes = 67108864 }}

[run]
requests = 40
layers = 2
page_bytes = 4096
device_blocks = 512
{extra}
"""
    )
    return config
