"""A loopback S3 server (moto) for the benchmarks, in a process of its own as S3 is: in the
bench's process it would share one GIL with the client threads it serves, and each side's
Python work would slow the other's."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

_SERVER = (
    "import sys, threading, time\n"
    "from moto.server import DomainDispatcherApplication, create_backend_app\n"
    "from werkzeug.serving import make_server\n"
    "latency = float(sys.argv[1])\n"
    "app = DomainDispatcherApplication(create_backend_app)\n"
    "def served(environ, start_response):\n"
    "    if latency:\n"
    "        time.sleep(latency)  # each request's own thread: requests wait side by side\n"
    "    return app(environ, start_response)\n"
    "server = make_server('127.0.0.1', 0, served, threaded=True)\n"
    "print(server.server_address[1], flush=True)\n"
    "threading.Thread(target=server.serve_forever, daemon=True).start()\n"
    "sys.stdin.read()  # until the bench ends\n"
)


def start_loopback_s3(latency_s: float = 0.0) -> tuple[int, Callable[[], None]]:
    """Start the server: its port, and the call that stops it (its stdin closes: it exits).

    ``latency_s`` holds every request that long before moto serves it (in the request's own
    thread, so concurrent requests wait side by side): the time to first byte of a store that
    is not on loopback, where throughput follows the requests a client keeps in flight."""
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER, repr(latency_s)],
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
