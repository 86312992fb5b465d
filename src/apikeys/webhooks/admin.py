"""Managing endpoints: add one (its secret shown once), roll its secret.

Each secret is derived from the pepper of `hasher` and kept sealed in the store
(`apikeys.webhooks.signing`): give these functions the `Hasher` the delivering processes
have (`manager.hasher`); without one, `Hasher()` reads `APIKEYS_PEPPER` and
`APIKEYS_OLD_PEPPERS`, as `KeyManager()` does.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from urllib.parse import urlsplit

from apikeys.errors import InvalidKeyParameters
from apikeys.hashing import Hasher
from apikeys.policies import check_text
from apikeys.stores.contract import WebhookStore
from apikeys.types import utcnow
from apikeys.webhooks.events import EVENT_TYPES
from apikeys.webhooks.model import Endpoint
from apikeys.webhooks.signing import seal_new_secret
from apikeys.webhooks.targets import allow_private_from_env, resolve_target

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
    hasher: Hasher | None = None,
    allow_private: bool | None = None,
) -> Endpoint:
    """Add an endpoint for `events` (all when empty) of `workspace`'s keys (all when None;
    an empty or malformed workspace is refused, never taken for all of them).

    A URL whose host is, or resolves to, an internal address is refused with
    `WebhookTargetRefused` unless `allow_private` (None: `APIKEYS_WEBHOOKS_ALLOW_PRIVATE`)
    allows it (`apikeys.webhooks.targets`); a name that does not resolve now is taken, and
    checked again at each delivery.

    The endpoint returned holds its secret, `whsec_…`: show it once, it is not shown
    again. The store keeps it sealed with the pepper of `hasher` (see the module doc).
    """
    unknown = sorted(set(events) - set(EVENT_TYPES))
    if unknown:
        shown = repr(unknown[0])[:64]  # an event name is short: never echo a long text whole
        raise InvalidKeyParameters(f"unknown event {shown}: one of {', '.join(EVENT_TYPES)}")
    url = validate_url(url)
    workspace = None if workspace is None else check_text(workspace, "workspace")
    if allow_private is None:
        allow_private = allow_private_from_env()
    await resolve_target(url, allow_private=allow_private)
    secret, sealed = seal_new_secret(hasher if hasher is not None else Hasher())
    endpoint = Endpoint(
        id="wh_" + secrets.token_hex(8),
        url=url,
        events=tuple(dict.fromkeys(events)),
        workspace=workspace,
        secret=sealed,
        created_at=utcnow(),
    )
    await hooks.add_endpoint(endpoint)
    return replace(endpoint, secret=secret)


async def roll_endpoint_secret(
    hooks: WebhookStore,
    endpoint_id: str,
    overlap: timedelta = DEFAULT_OVERLAP,
    *,
    hasher: Hasher | None = None,
) -> str | None:
    """Give the endpoint a new secret, sealed with the pepper of `hasher` (see the module
    doc); the old one signs too for `overlap`. The new secret, or None when there is no
    such endpoint.

    This is also how a secret stored in clear (by an earlier version, or without a
    pepper) leaves the store: its successor is sealed, and the old one is kept only while
    its overlap lasts (the delivering processes erase it then; with no overlap, at once).
    """
    now = utcnow()
    secret, sealed = seal_new_secret(hasher if hasher is not None else Hasher())
    if not await hooks.roll_secret(endpoint_id, sealed, now + overlap):
        return None
    if overlap <= timedelta(0):
        await hooks.forget_previous_secrets(now)
    return secret
