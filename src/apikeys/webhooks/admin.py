"""Managing endpoints: add one (its secret shown once), roll its secret."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlsplit

from apikeys.errors import InvalidKeyParameters
from apikeys.policies import check_text
from apikeys.types import utcnow
from apikeys.webhooks.base import Endpoint, WebhookStore
from apikeys.webhooks.events import EVENT_TYPES
from apikeys.webhooks.signing import new_secret

__all__ = ["DEFAULT_OVERLAP", "add_endpoint", "roll_endpoint_secret", "validate_url"]

DEFAULT_OVERLAP = timedelta(hours=24)
"""How long a rolled secret still signs deliveries beside the new one."""


def validate_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host; `InvalidKeyParameters` if not."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidKeyParameters("a webhook URL is http:// or https:// with a host")
    if parts.username or parts.password:
        raise InvalidKeyParameters("a webhook URL carries no credentials")
    return url.strip()


async def add_endpoint(
    hooks: WebhookStore,
    url: str,
    *,
    events: Sequence[str] = (),
    workspace: str | None = None,
) -> Endpoint:
    """Add an endpoint for `events` (all when empty) of `workspace`'s keys (all when None;
    an empty or malformed workspace is refused, never taken for all of them).

    The endpoint returned holds its secret: show it once, it is not shown again.
    """
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        raise InvalidKeyParameters(f"unknown event {unknown[0]!r}: one of {', '.join(EVENT_TYPES)}")
    endpoint = Endpoint(
        id="wh_" + secrets.token_hex(8),
        url=validate_url(url),
        events=tuple(dict.fromkeys(events)),
        workspace=None if workspace is None else check_text(workspace, "workspace"),
        secret=new_secret(),
        created_at=utcnow(),
    )
    await hooks.add_endpoint(endpoint)
    return endpoint


async def roll_endpoint_secret(
    hooks: WebhookStore, endpoint_id: str, overlap: timedelta = DEFAULT_OVERLAP
) -> str | None:
    """Give the endpoint a new secret; the old one signs too for `overlap`. The new
    secret, or None when there is no such endpoint."""
    secret = new_secret()
    if not await hooks.roll_secret(endpoint_id, secret, utcnow() + overlap):
        return None
    return secret
