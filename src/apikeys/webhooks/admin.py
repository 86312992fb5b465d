"""Managing endpoints: add one (its secret shown once), roll its secret."""

from __future__ import annotations

import re
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

__all__ = [
    "DEFAULT_OVERLAP",
    "MAX_URL_LENGTH",
    "add_endpoint",
    "roll_endpoint_secret",
    "validate_url",
]

DEFAULT_OVERLAP = timedelta(hours=24)
"""How long a rolled secret still signs deliveries beside the new one."""


MAX_URL_LENGTH = 2048
"""The longest endpoint URL taken."""

# Printable ASCII without spaces: an IDNA host is given in its xn-- form, anything else
# percent-encoded. A host name, or an IPv6 address (which urlsplit gives without brackets).
_URL_RE = re.compile(rf"[!-~]{{1,{MAX_URL_LENGTH}}}")
_HOST_RE = re.compile(r"[a-z0-9._~-]+|[0-9a-f:.]+")


def validate_url(url: str) -> str:
    """`url` (stripped) when it is an http(s) URL with a host, no credentials, a valid port
    if any, and only printable ASCII without spaces (at most `MAX_URL_LENGTH`): one an
    HTTP client can send to, shown on one line. `InvalidKeyParameters` if not."""
    url = url.strip()
    if _URL_RE.fullmatch(url) is None:
        raise InvalidKeyParameters(
            f"a webhook URL is printable ASCII without spaces, at most {MAX_URL_LENGTH} "
            "characters (percent-encode the rest; an international host in its xn-- form)"
        )
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError:
        raise InvalidKeyParameters("a webhook URL is http:// or https:// with a host") from None
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or _HOST_RE.fullmatch(host) is None:
        raise InvalidKeyParameters("a webhook URL is http:// or https:// with a host")
    if parts.username or parts.password:
        raise InvalidKeyParameters("a webhook URL carries no credentials")
    return url


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
