"""`KeyManager`: create, verify, disable, enable, revoke and roll keys.

The manager is the one place that turns a token into a record (`verify`); whether a key may
be used is `apikeys.lifecycle.check_usable`. Stores only keep state. Its parts, one job each:
`construction` (building, setup, closing), `reading`, `changes` (issuing and the key's
transitions) and `verification`.
"""

from __future__ import annotations

from apikeys.lifecycle import check_usable, refusal
from apikeys.manager.changes import UNSET, KeyChanges
from apikeys.manager.construction import LIMITER_URL_ENV, STORE_URL_ENV
from apikeys.manager.credits import CreditSpending
from apikeys.manager.verification import KeyVerification

__all__ = ["LIMITER_URL_ENV", "STORE_URL_ENV", "UNSET", "KeyManager", "check_usable", "refusal"]


class KeyManager(KeyChanges, KeyVerification, CreditSpending):
    """Issues and checks API keys held in a `KeyStore`.

    ```python
    manager = KeyManager(store_from_url("sqlite:///apikeys.db"))
    created = await manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
    created.key  # the full key: shown here, and never again
    record = await manager.verify(created.key)
    ```

    `store` is a `KeyStore` or a store URL; without one, the manager reads the variables the
    `apikeys` command line reads, so both find the same keys: the store URL in
    `APIKEYS_STORE_URL` (`memory://` when it is unset), and, through `Hasher()`,
    `APIKEYS_PEPPER` and `APIKEYS_OLD_PEPPERS`. `hasher` defaults to `Hasher()`
    (HMAC-SHA256 keyed with `APIKEYS_PEPPER`). Request counts are buffered and written every
    `usage_flush_interval` seconds; `aclose()` (or leaving `async with`) writes the rest.

    `prefix` (default `ak`) starts every key it makes, followed by the key's environment:
    `ak_live_…` for a live key, `ak_test_…` for a test key (`create(environment="test")`).
    It reads those and the bare `ak_…` of keys made before environments existed (live).

    `limiter` is the `RateLimiter` the integrations (the Starlette backend, the FastAPI
    dependency) share by default: a `RateLimiter`, or its storage URL; without one,
    `APIKEYS_LIMITER_URL` (`memory://` when it is unset), made on first use with the default
    limit of `APIKEYS_RATE_LIMIT`. A limiter the manager made is closed by `aclose()`.

    Records are cached in process (`cache`, on by default for SQLite, PostgreSQL and Redis)
    and trusted only while the store's invalidation channel proves them fresh, so `verify`
    needs no store round trip while every change still holds for the very next request in
    every process (docs/consistency.md), whoever made it. `cache_lease` bounds how long a
    change waits for a process that does not answer (seconds); `cache_size` bounds the
    records kept. `cache=False` reads the store on every verification; such a manager still
    waits, after each change it makes, for the processes that do cache keys. `channel`
    replaces the store's own channel with another `Channel` of the same store (tests use
    it to route the channel through a proxy); anything else (a URL, a channel that is not
    the store's own kind) raises `ConfigurationError`.

    Every verification reads the key the same way: from the key cache, else the store's
    `get_for_verification_now` (the memory store answers it; other stores answer False)
    and then `get_for_verification`; a store test double that fails or counts reads
    overrides those. `verify` asks `verify_now` first, and the request path calls
    `verify_now` itself, so a subclass sees every verification in `verify_now`.

    From its first use until it is closed, a manager also delivers the store's webhooks
    that are due (docs/webhooks.md); `webhooks=False` stops that, and a `DeliveryOptions`
    tunes it.

    Close a manager when done with it: `await manager.aclose()`, or use it as
    `async with KeyManager(...) as manager:`. One that has done work (issued, read, changed
    or verified a key) and is garbage-collected or reaches interpreter exit unclosed emits a
    `ResourceWarning`, once (Python shows it with `-W always::ResourceWarning` or `-X dev`);
    at exit, the usage counts it still buffers are written if the store answers within a
    few seconds, and a logged warning says how many were lost if not. A manager that has
    done nothing holds nothing, and is never warned about.
    """
