"""Running the ``kvhex`` command as a user does: a child process of this Python."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def kvhex(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m kvhex ARGS``, finished, with its exit status, stdout and stderr."""
    return subprocess.run(
        [sys.executable, "-m", "kvhex", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def spawn(*args: str) -> subprocess.Popen[str]:
    """``python -m kvhex ARGS`` started in the background (stdout and stderr piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kvhex", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
