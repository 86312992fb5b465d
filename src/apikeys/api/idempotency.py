"""`Idempotency-Key` on every POST: a retry gets the first answer, and makes nothing twice.

The first answer to a POST with an `Idempotency-Key` is kept for `IDEMPOTENCY_TTL` in the
key store every process shares (`KeyStore.put_once`), sealed the way the settings page
seals a new key (`apikeys.ui.onetime`): the store never holds a secret in clear. The
answer (a created key's secret, say) is encrypted and tagged under a key derived from the
caller's own API key, which the store never holds either (it keeps a hash of it), and kept
under a name drawn from the caller's key id and the `Idempotency-Key`:

- a retry by the same caller with the same request (method, path and body) gets the first
  answer again, with `Idempotent-Replayed: true`; nothing is done again;
- the same `Idempotency-Key` with another request answers 422 `idempotency_key_reused`;
- a retry while the first is still running answers 409 `conflict`;
- another caller, with the same `Idempotency-Key`, looks elsewhere and finds nothing: it
  could not open the sealed answer anyway.

Only successful answers are kept: a refused request may be retried as it is.

One request per caller and `Idempotency-Key` runs, however many arrive at once, in any
process: the first marks the name as running in one atomic step
(`KeyStore.put_once_if_absent`), and every other finds the mark (409) or the answer. The
answer replaces that very mark (`KeyStore.replace_once`), and a failed request removes only
its own mark; a read (`KeyStore.peek_once`) never takes a value away, even for a moment. A
mark lasts a minute: a request that runs longer (or whose process died) no longer
holds the name, and its answer is kept only if no other request has taken the name since.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

from apikeys.errors import Conflict, IdempotencyKeyReused, InvalidPayload
from apikeys.stores.contract import KeyStore

__all__ = [
    "IDEMPOTENCY_TTL",
    "MAX_IDEMPOTENCY_KEY",
    "Idempotency",
    "Kept",
    "check_idempotency_key",
]

IDEMPOTENCY_TTL: Final = timedelta(hours=24)
"""How long a POST's answer is kept for its retries."""
MAX_IDEMPOTENCY_KEY: Final = 255
"""The longest `Idempotency-Key` taken (printable ASCII)."""

_PENDING: Final = "pending"
# How long a running request's mark lasts: a process that dies mid-request blocks the
# retries of its Idempotency-Key this long, not for the whole IDEMPOTENCY_TTL.
_PENDING_TTL: Final = timedelta(minutes=1)
_RUNNING: Final = "A request with this Idempotency-Key is still running; retry later."
# How often `begin` tries to take a name whose value vanishes each time it looks.
_BEGIN_ATTEMPTS: Final = 3


@dataclass(frozen=True, slots=True)
class Kept:
    """A first answer, given again to a retry."""

    status: int
    body: bytes


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text.encode("ascii"))
    except (binascii.Error, ValueError, UnicodeEncodeError):
        return None


def _stream(key: bytes, nonce: bytes, length: int) -> bytes:
    # HMAC-SHA256 in counter mode under a fresh nonce per answer kept: no two answers are
    # ever sealed with the same stream (two racing retries each keep their own).
    blocks = (length + 31) // 32
    return b"".join(
        hmac.new(key, b"stream" + nonce + n.to_bytes(8, "big"), hashlib.sha256).digest()
        for n in range(blocks)
    )[:length]


_NONCE_BYTES: Final = 16


def check_idempotency_key(value: str) -> str:
    """`value` if it can be an `Idempotency-Key`; else `InvalidPayload`."""
    if not 1 <= len(value) <= MAX_IDEMPOTENCY_KEY or not all(" " < c <= "~" for c in value):
        raise InvalidPayload(
            [
                {
                    "field": "Idempotency-Key",
                    "message": f"must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters",
                }
            ]
        )
    return value


class Idempotency:
    """The kept answers of one caller's one `Idempotency-Key`, in `store`."""

    def __init__(
        self,
        store: KeyStore,
        *,
        caller_id: str,
        caller_token: str,
        idempotency_key: str,
        request: bytes,
        ttl: timedelta = IDEMPOTENCY_TTL,
    ) -> None:
        check_idempotency_key(idempotency_key)
        name = b"\0".join((b"apikeys-idempotency", caller_id.encode(), idempotency_key.encode()))
        self._slot = "idem-" + _b64(hashlib.sha256(name).digest()).rstrip("=")
        # Only the holder of the caller's key can derive this: the store keeps its hash.
        self._key = hmac.new(caller_token.encode(), name, hashlib.sha256).digest()
        self._fingerprint = hashlib.sha256(request).hexdigest()
        self._store = store
        self._ttl = ttl
        self._pending_ttl = min(ttl, _PENDING_TTL)
        # This request's own mark: a request whose mark expired cannot touch another's.
        self._mark = f"{_PENDING}.{self._fingerprint}.{_b64(secrets.token_bytes(12))}"

    async def begin(self) -> Kept | None:
        """The first answer to give again (`IdempotencyKeyReused` for another request,
        `Conflict` while the first runs); None: this is the first, run it, then `keep`
        (or `abandon`)."""
        for _ in range(_BEGIN_ATTEMPTS):
            if await self._store.put_once_if_absent(self._slot, self._mark, self._pending_ttl):
                return None
            found = await self._store.peek_once(self._slot)
            if found is not None:
                return self._answer(found)
            # The value went (a failed request's mark removed, or expired) between the two
            # calls: the name is free again, try to take it.
        raise Conflict(_RUNNING)

    async def keep(self, status: int, body: bytes) -> None:
        """Keep the answer for the retries, in place of this request's mark (kept only if
        the mark is still there: see the module doc)."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        stream = _stream(self._key, nonce, len(body))
        sealed = nonce + bytes(a ^ b for a, b in zip(body, stream, strict=True))
        tag = self._tag(status, sealed)
        value = f"{status}.{self._fingerprint}.{_b64(sealed)}.{_b64(tag)}"
        await self._store.replace_once(self._slot, self._mark, value, self._ttl)

    async def abandon(self) -> None:
        """Forget the running request: it failed, and may be retried."""
        await self._store.replace_once(self._slot, self._mark, None, self._pending_ttl)

    def _answer(self, found: str) -> Kept:
        """What a request finds kept under its name: another's mark or answer."""
        kind, _, rest = found.partition(".")
        fingerprint, _, sealed = rest.partition(".")
        if not hmac.compare_digest(fingerprint, self._fingerprint):
            raise IdempotencyKeyReused()
        if kind == _PENDING:
            raise Conflict(_RUNNING)
        kept = self._open(kind, sealed)
        if kept is None:
            raise IdempotencyKeyReused()
        return kept

    def _tag(self, status: int, sealed: bytes) -> bytes:
        message = b"\0".join((str(status).encode(), self._fingerprint.encode(), sealed))
        return hmac.new(self._key, b"tag" + message, hashlib.sha256).digest()

    def _open(self, status_text: str, sealed_text: str) -> Kept | None:
        sealed_b64, _, tag_b64 = sealed_text.partition(".")
        sealed, tag = _unb64(sealed_b64), _unb64(tag_b64)
        if not status_text.isdigit() or sealed is None or tag is None:
            return None
        status = int(status_text)
        if not hmac.compare_digest(tag, self._tag(status, sealed)):
            return None
        nonce, sealed = sealed[:_NONCE_BYTES], sealed[_NONCE_BYTES:]
        stream = _stream(self._key, nonce, len(sealed))
        return Kept(status, bytes(a ^ b for a, b in zip(sealed, stream, strict=True)))
