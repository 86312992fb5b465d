"""Standard Webhooks signatures: `webhook-id`, `webhook-timestamp`, `webhook-signature`.

The signature is `v1,<base64 HMAC-SHA256 of "id.timestamp.body">` keyed with the bytes of
the endpoint's secret `whsec_<base64>`; while a rolled secret's overlap lasts, the header
carries a signature with each secret, separated by a space, as the specification allows.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Iterable
from typing import Final

__all__ = ["SECRET_PREFIX", "new_secret", "sign", "signed_headers"]

SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - the prefix of every secret, not one


def new_secret() -> str:
    """A new signing secret: `whsec_` and 32 random bytes in base64."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("a webhook secret starts with whsec_")
    return base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """The `v1,<base64>` signature of `body` sent as `message_id` at `timestamp`."""
    content = f"{message_id}.{timestamp}.".encode() + body
    digest = hmac.new(_key(secret), content, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(
    secrets_: Iterable[str], message_id: str, timestamp: int, body: bytes
) -> dict[str, str]:
    """The headers of a delivery of `body`, signed with each of `secrets_`."""
    return {
        "content-type": "application/json",
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(
            sign(secret, message_id, timestamp, body) for secret in secrets_
        ),
    }
