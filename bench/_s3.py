"""A loopback S3 server (moto) for the benchmarks, in a process of its own as S3 is: in the
bench's process it would share one GIL with the client threads it serves, and each side's
Python work would slow the other's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

_SERVER = (
    "import sys\n"
    "from moto.server import ThreadedMotoServer\n"
    "server = ThreadedMotoServer(ip_address='127.0.0.1', port=0, verbose=False)\n"
    "server.start()\n"
    "print(server.get_host_and_port()[1], flush=True)\n"
    "sys.stdin.read()  # until the bench ends\n"
)


def start_loopback_s3() -> tuple[int, Callable[[], None]]:
    """Start the server: its port, and the call that stops it (its stdin closes: it exits)."""
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert server.stdout is not None
    port = int(server.stdout.readline())

    def stop() -> None:
        server.communicate("")

    return port, stop
