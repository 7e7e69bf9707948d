"""Secrets at rest and credential material.

RELAY_MASTER_KEY is any high-entropy string; two independent keys are derived
from it with HKDF-SHA256: an AES-256-GCM key for host-key values, and the
Ed25519 seed that signs inference tokens. Rotating the master key therefore
invalidates both stored host-key values and outstanding tokens.
"""

import base64
import hashlib
import os
import secrets
from functools import lru_cache

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

_VERSION = "v1"
RELAY_KEY_PREFIX = "sk-wr-"
DISPLAY_PREFIX_LEN = 14


class SecretUnavailable(Exception):
    """A stored secret cannot be read (wrong master key, missing env var)."""


@lru_cache(maxsize=8)
def _derive(master: str, purpose: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=b"relay-batch", info=purpose).derive(master.encode())


def encrypt(plaintext: str) -> str:
    key = _derive(settings.RELAY_MASTER_KEY, b"host-key-values")
    nonce = os.urandom(12)
    sealed = AESGCM(key).encrypt(nonce, plaintext.encode(), _VERSION.encode())
    return f"{_VERSION}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"


def decrypt(token: str) -> str:
    version, _, body = token.partition(":")
    if version != _VERSION or not body:
        raise SecretUnavailable("stored secret has an unknown format")
    raw = base64.urlsafe_b64decode(body.encode())
    key = _derive(settings.RELAY_MASTER_KEY, b"host-key-values")
    try:
        return AESGCM(key).decrypt(raw[:12], raw[12:], _VERSION.encode()).decode()
    except InvalidTag as exc:
        raise SecretUnavailable("stored secret cannot be decrypted: RELAY_MASTER_KEY changed?") from exc


def token_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(_derive(settings.RELAY_MASTER_KEY, b"inference-token-ed25519"))


def sha256_hex(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def new_relay_key() -> tuple[str, str, str]:
    """Return (plaintext, sha256 hex, display prefix). 48 random bytes: 384 bits."""
    plaintext = RELAY_KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(48)).decode().rstrip("=")
    return plaintext, sha256_hex(plaintext), plaintext[:DISPLAY_PREFIX_LEN]
