"""Standard Webhooks signatures (https://www.standardwebhooks.com), exactly as the `openai` SDK's
`client.webhooks.unwrap()` and the `standardwebhooks` package verify them:

    webhook-id:        the delivery's id (the same on every retry: receivers dedupe on it)
    webhook-timestamp: Unix seconds of this attempt (fresh on every retry: receivers refuse old ones)
    webhook-signature: "v1," + base64(HMAC-SHA256(secret, f"{id}.{timestamp}.{body}")), space-separated,
                       one per secret while a rotated secret overlaps

A secret is `whsec_` + base64 of 32 random bytes; the HMAC key is the decoded bytes.
"""

import base64
import hashlib
import hmac
import secrets

PREFIX = "whsec_"
SECRET_BYTES = 32


def new_secret() -> str:
    return PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def hint(secret: str) -> str:
    """What the API shows after create: the prefix and the secret's last four characters (no padding)."""
    return f"{PREFIX}…{secret.rstrip('=')[-4:]}"


def _key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(PREFIX))


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    mac = hmac.new(_key(secret), f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256)
    return "v1," + base64.b64encode(mac.digest()).decode()


def headers(msg_id: str, timestamp: int, body: bytes, keys: list[str]) -> dict[str, str]:
    """The three Standard Webhooks headers, signed with every secret in `keys` (the current one first)."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(secret, msg_id, timestamp, body) for secret in keys),
    }
