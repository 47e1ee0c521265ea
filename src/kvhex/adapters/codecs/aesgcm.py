"""``aes-gcm``: AES-256-GCM keyed per tenant (the ``cryptography`` package).

Each tenant (a request's ``cache_salt``; requests without one are a tenant of their own) has
its own key, derived from the master key by HKDF-SHA256. A block is sealed for the tenant of
the request that stored it, with a random 96-bit nonce and the block's offload key as
associated data, and stored as ``nonce | ciphertext | tag`` (28 bytes more than the input). A
get opens it with the key of the tenant asking: another tenant's key, another master key or
a block moved under another offload key fails the tag, and the block is a miss for that
request (:class:`~kvhex.ports.codec.CodecRefused`), left in place.

The chunk record a block keeps in its header (the request's token ids: its prompt) is sealed
too (:class:`~kvhex.ports.codec.RecordSealing`), under a records key derived from the master
key: every instance of the fleet reads it back (restarts, peer views), storage without the
key holds no prompt in the clear.

The master key (32 bytes: raw in a file, or 64 hex digits or base64 in the file or the
environment variable) is read once at start-up and never reaches a configuration dump, a log
or an event; what the namespace records is a fingerprint (HKDF of the key, 8 bytes), so
instances with another master key keep their blocks apart instead of failing every read.
"""

from __future__ import annotations

import base64
import binascii
import os
import threading
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvhex.domain.keys import OffloadKey
from kvhex.ports.codec import Buffer, CodecCorrupt, CodecRefused

NONCE = 12
TAG = 16
KEY_ENV = "KVHEX_CODEC_KEY"
"""The environment variable the master key is read from without ``key_file``."""


class MasterKeyError(ValueError):
    """No master key, or one that is not 32 bytes. The message names where it was looked
    for; :attr:`option` is the option to correct."""

    def __init__(self, message: str, option: str) -> None:
        super().__init__(f"{option}: {message}")
        self.option = option


def _parse_key(data: bytes) -> bytes | None:
    """32 raw bytes, or 64 hex digits, or base64 of 32 bytes (whitespace around ignored)."""
    if len(data) == 32:
        return data
    text = data.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
    try:
        key = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None
    return key if len(key) == 32 else None


def read_master_key(key_file: str | None, key_env: str) -> bytes:
    """The master key from ``key_file``, else from the environment variable ``key_env``.

    Raises:
        MasterKeyError: the file cannot be read, the variable is unset or empty, or what
            either holds is not a 32-byte key.
    """
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                data = f.read(4096)
        except OSError as exc:
            raise MasterKeyError(f"cannot read the key file: {exc.strerror}", "key_file") from None
        where, option = "the key file", "key_file"
    else:
        value = os.environ.get(key_env, "")
        if not value:
            raise MasterKeyError(
                f"no master key: set the environment variable {key_env} (64 hex digits or "
                "base64 of 32 bytes) or give key_file",
                "key_env",
            )
        data = value.encode()
        where, option = f"the environment variable {key_env}", "key_env"
    key = _parse_key(data)
    if key is None:
        raise MasterKeyError(
            f"{where} does not hold a 32-byte key (32 raw bytes, 64 hex digits or base64)",
            option,
        )
    return key


class AesGcmCodec:
    """See the module docstring.

    Args:
        key_file: a file holding the master key; without it, the environment variable
            ``key_env`` does.
        key_env: the environment variable read without ``key_file``.

    Raises:
        MasterKeyError: no master key, or not a 32-byte one (a ``ValueError``).
    """

    name = "aes-gcm"
    lossy = False
    keyed = True

    def __init__(self, *, key_file: str | None = None, key_env: str = KEY_ENV) -> None:
        if key_file is not None and not isinstance(key_file, str):
            raise ValueError(f"key_file: a path, got {type(key_file).__name__}")
        if not isinstance(key_env, str) or not key_env:
            raise ValueError("key_env: the name of an environment variable")
        master = read_master_key(key_file, key_env)

        def derive(info: bytes) -> bytes:
            kdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info)
            return kdf.derive(master)

        self._derive = derive
        self._ciphers: dict[str | None, Any] = {}
        self._lock = threading.Lock()
        self.key_id = derive(b"kvhex aes-gcm key id")[:8].hex()
        """The master key's public fingerprint (what the namespace records)."""
        self._records = AESGCM(derive(b"kvhex aes-gcm records"))

    def __repr__(self) -> str:  # never the key
        return f"AesGcmCodec(key_id={self.key_id})"

    def describe(self) -> Mapping[str, Any]:
        return {
            "cipher": "AES-256-GCM",
            "kdf": "HKDF-SHA256",
            "key_id": self.key_id,
            "records": "sealed",
        }

    def max_encoded_bytes(self, n: int) -> int:
        return n + NONCE + TAG

    def _cipher(self, tenant: str | None) -> Any:
        cipher = self._ciphers.get(tenant)
        if cipher is None:
            info = b"kvhex aes-gcm tenant\0" + (b"" if tenant is None else b"\1" + tenant.encode())
            cipher = AESGCM(self._derive(info))
            with self._lock:
                self._ciphers.setdefault(tenant, cipher)
        return cipher

    def encode(self, data: memoryview, key: OffloadKey, tenant: str | None) -> Buffer:
        nonce = os.urandom(NONCE)
        sealed: bytes = self._cipher(tenant).encrypt(nonce, data, bytes(key))
        return nonce + sealed

    def seal_record(self, data: bytes, key: OffloadKey) -> bytes:
        """``RecordSealing``: a block's chunk record sealed under the fleet's records key
        (derived from the master key), bound to the block's key."""
        nonce = os.urandom(NONCE)
        sealed: bytes = self._records.encrypt(nonce, data, b"record\0" + bytes(key))
        return nonce + sealed

    def open_record(self, data: bytes, key: OffloadKey) -> bytes | None:
        if len(data) < NONCE + TAG:
            return None
        try:
            opened: bytes = self._records.decrypt(
                data[:NONCE], data[NONCE:], b"record\0" + bytes(key)
            )
        except InvalidTag:
            return None
        return opened

    def decode(self, data: memoryview, size: int, key: OffloadKey, tenant: str | None) -> Buffer:
        if len(data) != size + NONCE + TAG:
            raise CodecCorrupt(f"aes-gcm: {len(data)} bytes do not seal {size}")
        try:
            out: bytes = self._cipher(tenant).decrypt(data[:NONCE], data[NONCE:], bytes(key))
        except InvalidTag:
            raise CodecRefused("aes-gcm: the block does not open with this tenant's key") from None
        return out
