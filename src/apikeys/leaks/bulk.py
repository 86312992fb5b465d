"""A public endpoint where anyone who finds leaked keys can get them revoked, GitHub-style.

Like GitHub's "revoke a list of credentials" (`POST /credentials/revoke`), whoever finds a
key in public (a researcher, a scanner, the key's own owner without a login) POSTs
`{"credentials": ["ak_…", …]}` (or the bare array), at most 1000 keys, with no
authentication. Each key whose secret is right is revoked, recorded as `leak_revoked` in
the audit trail; a key already revoked, disabled or expired is revoked too when its
secret is right. Nothing else is done: a real id with a made-up secret revokes nothing.

The answer is the same for any list that is well formed, `202` and a fixed body: it never
says which keys existed or were revoked, so the endpoint is no oracle for guessed keys
(the one who holds a real key can learn nothing here they could not learn by using it).
Refusals, in this order, change nothing: 405 another method, 429 over the rate limit per
client address (an IPv6 client's /64), 415 not JSON, 413 over 1 MiB, 400 not JSON or not a
list of at most 1000 strings of 1 to 1024 characters. 503 when the key store cannot be
reached (keys confirmed before that are revoked).
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any, Final

from apikeys.addresses import client_address
from apikeys.errors import (
    AuthUnavailable,
    InvalidPayload,
    MethodNotAllowed,
    RateLimited,
    RequestRefused,
)
from apikeys.keys import parse_key_of
from apikeys.leaks.http import parse_json, read_body, require_json, send_json
from apikeys.leaks.verdicts import act_on_leak
from apikeys.manager import KeyManager
from apikeys.problems import send_problem
from apikeys.ratelimit import RateLimiter, parse_rate_limit
from apikeys.types import Receive, Scope, Send

__all__ = [
    "BULK_REVOKE_ACTOR",
    "BULK_REVOKE_ANSWER",
    "BULK_REVOKE_RATE_LIMIT",
    "MAX_KEYS",
    "BulkRevoke",
    "validate_credentials",
]

logger = logging.getLogger("apikeys.leaks")

BULK_REVOKE_ACTOR: Final = "bulk-revoke"
"""The actor of the `leak_revoked` events this endpoint records."""
BULK_REVOKE_RATE_LIMIT = "60/hour"
"""Requests per client address, by default: GitHub's own limit for its endpoint."""
BULK_REVOKE_ANSWER: Final = {
    "message": "Accepted. Every key in the list whose secret is right is now revoked."
}
"""The body of every 202: the same whichever keys the list holds."""
MAX_KEYS = 1000
TOKEN_MAX = 1024
MAX_BODY_BYTES = 1024 * 1024
MAX_ERRORS = 20


def validate_credentials(data: Any) -> list[str]:
    """The keys of a bulk-revoke body, each once, in order; or `InvalidPayload`.

    `{"credentials": [...]}` (GitHub's shape) or the bare array, at most `MAX_KEYS`
    strings of 1 to 1024 characters. Any string is taken: one not in the key format is
    simply not confirmed.
    """
    if isinstance(data, dict):
        if set(data) != {"credentials"}:
            raise InvalidPayload(
                [{"field": "body", "message": 'must be {"credentials": [...]} or an array'}]
            )
        data = data["credentials"]
        where = "credentials"
    else:
        where = "body"
    if not isinstance(data, list):
        raise InvalidPayload([{"field": where, "message": "must be a JSON array"}])
    if len(data) > MAX_KEYS:
        raise InvalidPayload([{"field": where, "message": f"must hold at most {MAX_KEYS} keys"}])
    errors = [
        {
            "field": f"{where}[{index}]",
            "message": f"must be a string of 1 to {TOKEN_MAX} characters",
        }
        for index, item in enumerate(data)
        if not (isinstance(item, str) and 1 <= len(item) <= TOKEN_MAX)
    ]
    if errors:
        raise InvalidPayload(errors[:MAX_ERRORS])
    return list(dict.fromkeys(data))


def _client_bucket(address: str | None) -> str:
    """The rate-limit bucket of a client: its IPv4 address, its IPv6 /64, or one shared
    bucket for clients the server gives no address for."""
    if address is None:
        return "unknown"
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return f"name:{address[:100]}"  # a Unix socket path, a server's own label
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        # One host usually holds a whole /64: counting addresses would count nothing.
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


class BulkRevoke:
    """The ASGI app of the public bulk-revoke endpoint.

    ```python
    app.mount("/credentials/revoke", BulkRevoke(manager))
    ```

    No authentication: keep its path public to `APIKeyMiddleware`. `rate_limit` is the
    requests each client address may make (`60/hour` by default), counted by `limiter`
    (by default one of its own in memory; pass a `RateLimiter` on Redis to share the count
    between processes). `trusted_proxies` says how many proxies in front of the app append
    to `X-Forwarded-For` (see `apikeys.addresses.client_address`).
    """

    def __init__(
        self,
        manager: KeyManager,
        *,
        rate_limit: str = BULK_REVOKE_RATE_LIMIT,
        limiter: RateLimiter | None = None,
        trusted_proxies: int = 0,
        actor: str = BULK_REVOKE_ACTOR,
    ) -> None:
        parse_rate_limit(rate_limit)  # refused now, not on the first request
        client_address({}, trusted_proxies)  # the same check of the count
        self.manager = manager
        self.rate_limit = rate_limit
        self.limiter = (
            limiter
            if limiter is not None
            else RateLimiter(rate_limit, "memory://", key_prefix="apikeys-bulk-revoke")
        )
        self.trusted_proxies = trusted_proxies
        self.actor = actor

    def __repr__(self) -> str:
        return f"BulkRevoke(rate_limit={self.rate_limit!r})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            await self._revoke(scope, receive)
        except RequestRefused as exc:
            if isinstance(exc, AuthUnavailable):
                logger.warning("bulk revoke: the key store is unavailable: %s", exc)
            await send_problem(send, exc)
            return
        await send_json(send, 202, BULK_REVOKE_ANSWER)

    async def _revoke(self, scope: Scope, receive: Receive) -> None:
        if scope.get("method") != "POST":
            raise MethodNotAllowed(["POST"])
        bucket = _client_bucket(client_address(scope, self.trusted_proxies))
        decision = await self.limiter.hit(f"bulk-revoke/{bucket}", self.rate_limit)
        if not decision.allowed:
            raise RateLimited(decision.reset_after)
        require_json(scope)
        tokens = validate_credentials(parse_json(await read_body(scope, receive, MAX_BODY_BYTES)))
        revoked = 0
        for token in tokens:
            outcome = await act_on_leak(self.manager, token, actor=self.actor)
            if outcome == "revoked":
                revoked += 1
                logger.warning(
                    "bulk revoke: %s revoked as leaked, reported from %s",
                    parse_key_of(token, self.manager.prefix).masked,
                    bucket,
                )
        logger.info("bulk revoke: %d keys received, %d revoked", len(tokens), revoked)
