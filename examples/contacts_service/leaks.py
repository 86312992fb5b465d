"""Leak response: GitHub's secret scanning alerts and the public bulk-revoke endpoint.

Both are the library's own ASGI apps (`apikeys.leaks`), routed at one path each and public
to `APIKeyMiddleware` (GitHub signs its alerts; whoever reports leaked keys has no key):

- `POST /api/v1/secret-scanning`: `SecretScanningReceiver`, checked against the keys at
  `EXAMPLE_GITHUB_KEYS_URL`; a key GitHub finds in public is revoked, or disabled with
  `EXAMPLE_LEAK_ACTION=disable`.
- `POST /api/v1/credentials/revoke`: `BulkRevoke`, up to 1000 leaked keys a request,
  60 requests an hour per client address.
"""

from __future__ import annotations

from starlette.routing import BaseRoute, Route

from apikeys import KeyManager
from apikeys.leaks import BulkRevoke, SecretScanningReceiver
from examples.contacts_service.settings import Settings

__all__ = ["BULK_REVOKE_PATH", "PATH", "routes"]

PATH = "/api/v1/secret-scanning"
BULK_REVOKE_PATH = "/api/v1/credentials/revoke"


def routes(settings: Settings, manager: KeyManager) -> list[BaseRoute]:
    """One path for each app: they answer other methods with 405 themselves."""
    receiver = SecretScanningReceiver(
        manager,
        action=settings.leak_action,
        keys_url=settings.github_keys_url,
    )
    return [Route(PATH, receiver), Route(BULK_REVOKE_PATH, BulkRevoke(manager))]
