"""New keys waiting for their one display, sealed, in the key store every process shares.

After a key is created (or rolled) the browser is redirected to the list page
(Post/Redirect/Get), which must show the key once, in whichever worker or host serves that
page, and never again. The key is split in two halves, neither of which says anything
about it alone (a one-time pad):

- the key store keeps `sealed = key XOR pad` and a tag for 5 minutes (`KeyStore.put_once`,
  in every store: memory, SQLite, PostgreSQL and Redis), under a name drawn from a random
  token and the user's id;
- the browser keeps the token, the pad (random bytes as long as the key, used once) and the
  tag's key, in the page's own signed, HttpOnly cookie.

The first page that shows the key takes the sealed half with `KeyStore.take_once`, which
deletes it in the same atomic step: any later page, in any process, finds nothing, and says
the key was shown already or has expired, which is then true. The plaintext key is never
written anywhere: not to the store (it holds the sealed half), not to the cookie (it holds
the pad), not to a log. The tag kept with the sealed half, an HMAC-SHA256 of the token, the
user's id, the key's id and the key under a key only the cookie holds, refuses either half
once changed, and a page of another user.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from apikeys.stores.contract import KeyStore
from apikeys.types import KeyRecord

__all__ = ["REVEAL_TTL", "Reveal", "RevealStore"]

REVEAL_TTL: Final = timedelta(minutes=5)
"""How long a new key waits for its one display."""


@dataclass(frozen=True, slots=True)
class Reveal:
    """A key to show once, to the user who made it."""

    key: str = field(repr=False)
    record: KeyRecord
    user_id: str
    rolled_from: KeyRecord | None = None
    """For a roll: the old key, with its new (grace period) expiry."""
    unconfirmed: bool = False
    """The store's replicas did not confirm the new key in time (`CreatedKey.warning`)."""

    @property
    def old_expires_at(self) -> datetime | None:
        """For a roll: when the old key stops working (the end of the grace period)."""
        return None if self.rolled_from is None else self.rolled_from.expires_at


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes | None:
    if not isinstance(text, str) or not text.isascii():
        return None
    try:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    except (binascii.Error, ValueError):
        return None


def _xor(data: bytes, pad: bytes) -> bytes:
    return bytes(a ^ b for a, b in zip(data, pad, strict=True))


def _tag(mac_key: bytes, token: str, user_id: str, key_id: str, key: bytes) -> bytes:
    message = b"\0".join((token.encode(), user_id.encode(), key_id.encode(), key))
    return hmac.new(mac_key, message, hashlib.sha256).digest()


def _slot(token: str, user_id: str) -> str:
    """Where the store keeps the sealed half: another user's page, given the same cookie,
    looks elsewhere (and finds nothing), so it cannot spend the key's one display."""
    digest = hashlib.sha256(b"\0".join((token.encode(), user_id.encode()))).digest()
    return _b64(digest).rstrip("=")


class RevealStore:
    """Keeps new keys for one display, sealed in `store` (a `KeyStore` that keeps one-time
    values, shared by every process that serves the page) for `ttl`.

    `put` seals a `Reveal` and returns the browser's half (a small dict for the page's
    signed cookie); `pop` with that half gives the `Reveal` back once, to the same user,
    within `ttl`, in any process, and None ever after.
    """

    def __init__(self, store: KeyStore, *, ttl: timedelta = REVEAL_TTL) -> None:
        self.store = store
        self.ttl = ttl

    def __repr__(self) -> str:
        return f"RevealStore({self.store!r}, ttl={self.ttl!r})"

    async def put(self, reveal: Reveal) -> dict[str, Any]:
        key = reveal.key.encode()
        token = secrets.token_urlsafe(24)
        pad = secrets.token_bytes(len(key))
        mac_key = secrets.token_bytes(32)
        sealed = _xor(key, pad)
        tag = _tag(mac_key, token, reveal.user_id, reveal.record.id, key)
        await self.store.put_once(
            _slot(token, reveal.user_id), f"{_b64(sealed)}.{_b64(tag)}", self.ttl
        )
        return {
            "token": token,
            "pad": _b64(pad),
            "mac": _b64(mac_key),
            "id": reveal.record.id,
            "rolled": reveal.rolled_from is not None,
            "unconfirmed": reveal.unconfirmed,
        }

    async def pop(self, half: object, user_id: str) -> Reveal | None:
        """The `Reveal` sealed with `half` (what `put` returned), if it is `user_id`'s and
        still kept; it is gone from the store after, whatever the answer."""
        if not isinstance(half, dict):
            return None
        token, key_id = half.get("token"), half.get("id")
        pad, mac_key = _unb64(half.get("pad")), _unb64(half.get("mac"))
        if not (isinstance(token, str) and isinstance(key_id, str) and pad and mac_key):
            return None
        # The records first: a store that fails here leaves the sealed key for a reload.
        stored = await self.store.get(key_id)
        rolled_from: KeyRecord | None = None
        if stored is not None and half.get("rolled") is True and stored.record.replaces:
            old = await self.store.get(stored.record.replaces)
            rolled_from = None if old is None else old.record
        value = await self.store.take_once(_slot(token, user_id))
        if value is None or stored is None:
            return None
        sealed_text, _, tag_text = value.partition(".")
        sealed, tag = _unb64(sealed_text), _unb64(tag_text)
        if sealed is None or tag is None or len(sealed) != len(pad):
            return None
        key = _xor(sealed, pad)
        if not hmac.compare_digest(tag, _tag(mac_key, token, user_id, key_id, key)):
            return None  # changed in the store or in the cookie, or another user's
        return Reveal(
            key.decode(),
            stored.record,
            user_id,
            rolled_from=rolled_from,
            unconfirmed=half.get("unconfirmed") is True,
        )
