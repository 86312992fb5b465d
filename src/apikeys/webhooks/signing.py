"""Standard Webhooks signatures: `webhook-id`, `webhook-timestamp`, `webhook-signature`.

The signature is `v1,<base64 HMAC-SHA256 of "id.timestamp.body">` keyed with the bytes of
the endpoint's secret `whsec_<base64>`; while a rolled secret's overlap lasts, the header
carries a signature with each secret, separated by a space, as the specification allows.

The sender must know a secret to sign with it, so it cannot be hashed; and anyone who
reads it in the store could forge events to the receiver. So it is not stored: it is
derived from the server-side pepper (`APIKEYS_PEPPER`) and a random nonce,
HMAC-SHA256(pepper, `apikeys webhook secret|<nonce>`) (`Hasher.derive`), shown once, and
made again for each delivery. The store keeps `sealed$<pepper id>$<nonce>`: the pepper's
id as key hashes name it, and nothing a reader of the store can sign with. A rotation
keeps such secrets working while the old pepper is in `APIKEYS_OLD_PEPPERS`.

Without a pepper there is nothing to derive from: the secret is stored as it is
(`whsec_…`), with a logged warning, as key hashes are then unkeyed. Secrets stored so by
an earlier version are read as they are; rolling one (`roll_endpoint_secret`) seals its
successor.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Final

from apikeys.errors import ConfigurationError

if TYPE_CHECKING:
    from apikeys.hashing import Hasher

__all__ = [
    "SEALED_PREFIX",
    "SECRET_PREFIX",
    "UNSEALABLE",
    "is_sealed",
    "new_secret",
    "seal_new_secret",
    "sealed_pepper_id",
    "sign",
    "signed_headers",
    "unseal_secret",
]

logger = logging.getLogger("apikeys.webhooks")

SECRET_PREFIX: Final = "whsec_"  # noqa: S105 - the prefix of every secret, not one
SEALED_PREFIX: Final = "sealed$"
"""The prefix of what the store keeps of a derived secret: `sealed$<pepper id>$<nonce>`."""
UNSEALABLE: Final = "the pepper that sealed this endpoint's secret is not configured: roll it"
"""Why a delivery is not sent when its endpoint's secret was sealed with a pepper this
process does not have (its `last_error`)."""

_PURPOSE: Final = "webhook secret"
# Hashers whose missing pepper was warned about: once each, as `Hasher` warns once.
_warned: weakref.WeakSet[Hasher] = weakref.WeakSet()


def new_secret() -> str:
    """A new signing secret: `whsec_` and 32 random bytes in base64 (not derived from a
    pepper: `seal_new_secret` makes the secrets endpoints are given)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _as_secret(digest: bytes) -> str:
    return SECRET_PREFIX + base64.b64encode(digest).decode()


def seal_new_secret(hasher: Hasher) -> tuple[str, str]:
    """A new signing secret, and what the store keeps of it: `sealed$<pepper id>$<nonce>`,
    from which only a holder of that pepper makes the secret again (see the module doc).

    Without a pepper, the secret itself (`whsec_…`) is kept, and the `apikeys.webhooks`
    logger warns, once per hasher.
    """
    nonce = secrets.token_urlsafe(24)
    derived = hasher.derive(_PURPOSE, nonce)
    if derived is None:
        if hasher not in _warned:
            _warned.add(hasher)
            logger.warning(
                "apikeys: APIKEYS_PEPPER is not set; webhook signing secrets are stored in "
                "clear, and whoever reads the store can sign events with them. Set a pepper "
                "in production (docs/webhooks.md)."
            )
        secret = new_secret()
        return secret, secret
    pepper_id, digest = derived
    return _as_secret(digest), f"{SEALED_PREFIX}{pepper_id}${nonce}"


def is_sealed(stored: str) -> bool:
    """Whether a store's `stored` secret is sealed (`sealed$…`), not the secret itself."""
    return stored.startswith(SEALED_PREFIX)


def sealed_pepper_id(stored: str) -> str | None:
    """The id of the pepper a sealed secret was derived with (None for a secret stored as
    it is). Public: key hashes name their pepper the same way."""
    if not is_sealed(stored):
        return None
    return stored[len(SEALED_PREFIX) :].partition("$")[0]


def unseal_secret(hasher: Hasher, stored: str) -> str:
    """The signing secret of what a store keeps: made again from `sealed$<pepper id>$<nonce>`
    with that pepper (the current one, or one of the hasher's old peppers), or a `whsec_…`
    secret stored as it is. `ConfigurationError` (`UNSEALABLE`) when the hasher does not
    have that pepper."""
    if stored.startswith(SECRET_PREFIX):
        return stored
    if not is_sealed(stored):
        raise ConfigurationError("a webhook secret is whsec_… or sealed$…")
    pepper_id, separator, nonce = stored[len(SEALED_PREFIX) :].partition("$")
    derived = hasher.derive(_PURPOSE, nonce, pepper_id) if separator else None
    if derived is None:
        raise ConfigurationError(UNSEALABLE)
    return _as_secret(derived[1])


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
