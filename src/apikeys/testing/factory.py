"""The plugin's key manager and key factory, usable without pytest as well.

`in_memory_manager()` is a `KeyManager` on a fresh `MemoryStore` with a fixed test pepper;
`KeyFactory(manager)` creates keys in any state: `await factory(status="revoked")`, or
`factory.sync(...)` from synchronous code; `IdentityFactory(manager)` creates identities
the same way, for keys to belong to (`await make_key(identity=…)`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from collections.abc import Coroutine, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal, TypeVar, get_args

from apikeys.hashing import Hasher
from apikeys.identities import IdentityRecord
from apikeys.keys import DEFAULT_PREFIX
from apikeys.manager import KeyManager
from apikeys.stores.memory.store import MemoryStore
from apikeys.types import LIVE, CreatedKey, Environment, KeyRecord, Status, utcnow

__all__ = [
    "TEST_PEPPER",
    "IdentityFactory",
    "IdentityStatus",
    "KeyFactory",
    "aclose_manager",
    "close_manager",
    "in_memory_manager",
    "run_sync",
]

TEST_PEPPER = "VgmlXT49KsxtgDum8MD6S9--M5bS3k6ax2s6TdmOaiM"
"""The pepper of `in_memory_manager()`: fixed, so hashes are reproducible. Tests only."""

_STATUSES: tuple[str, ...] = get_args(Status)

IdentityStatus = Literal["active", "disabled", "revoked"]
"""The states `IdentityFactory` makes an identity in."""
_IDENTITY_STATUSES: tuple[str, ...] = get_args(IdentityStatus)
_T = TypeVar("_T")


def in_memory_manager(*, prefix: str = DEFAULT_PREFIX) -> KeyManager:
    """A `KeyManager` on a fresh in-memory store, peppered with `TEST_PEPPER`.

    Usage counts are written to the store every 50 ms (the store's records stay close to
    exact); `manager.get()` and `list()` include the unwritten ones anyway.
    """
    return KeyManager(
        MemoryStore(),
        hasher=Hasher(pepper=TEST_PEPPER),
        prefix=prefix,
        usage_flush_interval=0.05,
    )


def run_sync(coroutine: Coroutine[Any, Any, _T]) -> _T:
    """Run `coroutine` to its end from synchronous code, on an event loop of its own.

    Inside a running event loop (a sync helper called from an async test) it runs in a
    worker thread, so the caller's loop is never re-entered. The thread's current event
    loop is left as it was.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="apikeys-testing") as pool:
        return pool.submit(_run, coroutine).result()


def _run(coroutine: Coroutine[Any, Any, _T]) -> _T:
    # Unlike asyncio.run(), a runner with a loop factory leaves the thread's current event
    # loop alone: a loop pytest-asyncio keeps for a module or session stays in place.
    with asyncio.Runner(loop_factory=asyncio.new_event_loop) as runner:
        return runner.run(coroutine)


async def aclose_manager(manager: KeyManager) -> None:
    """`manager.aclose()`, tolerant of a usage task left on another event loop.

    A test's requests start the manager's usage task on the test's loop; closing runs
    where the fixture is torn down. When that is another loop (closed, or not running),
    the task cannot be awaited from here: it has been cancelled, and the counts it held
    are written from this loop instead.
    """
    try:
        await manager.aclose()
    except RuntimeError:
        await manager.flush()


def close_manager(manager: KeyManager) -> None:
    """`aclose_manager(manager)` from synchronous code (a fixture's teardown)."""
    run_sync(aclose_manager(manager))


class KeyFactory:
    """Creates keys in `manager`, in any state: what the `make_key` fixture returns.

    ```python
    created = await make_key(scopes=["contacts:read"])       # restricted, active
    admin = await make_key(full_access=True, rate_limit="3/second")
    gone = await make_key(status="revoked")                  # also disabled, expired
    created = make_key.sync(scopes=["contacts:read"])        # in a synchronous test
    grouped = await make_key(identity=(await make_identity()).id)
    ```

    Without `scopes` a key has full access. `status="expired"` ends the key's life now
    (the store's `shorten_expiry`, as a roll's grace period does), without a second key.
    The returned `CreatedKey.record` is the record after the state change.
    """

    def __init__(self, manager: KeyManager) -> None:
        self.manager = manager
        self._numbers = itertools.count(1)

    def __repr__(self) -> str:
        return f"KeyFactory(manager={self.manager!r})"

    def __call__(
        self,
        *,
        scopes: Iterable[str] | None = None,
        full_access: bool | None = None,
        rate_limit: str | None = None,
        status: Status = "active",
        workspace: str = "default",
        name: str | None = None,
        expires_in: timedelta | None = None,
        environment: Environment = LIVE,
        identity: str | None = None,
    ) -> Coroutine[Any, Any, CreatedKey]:
        """Create a key; await the result. Arguments as `KeyManager.create` (`identity`: the
        id of an identity of `workspace` for it to belong to), plus `status`."""
        if status not in _STATUSES:
            raise ValueError(f"status must be one of {', '.join(_STATUSES)}, not {status!r}")
        return self._create(
            scopes=None if scopes is None else tuple(scopes),
            full_access=scopes is None if full_access is None else full_access,
            rate_limit=rate_limit,
            status=status,
            workspace=workspace,
            name=name if name is not None else f"test key {next(self._numbers)}",
            expires_in=expires_in,
            environment=environment,
            identity=identity,
        )

    def sync(
        self,
        *,
        scopes: Iterable[str] | None = None,
        full_access: bool | None = None,
        rate_limit: str | None = None,
        status: Status = "active",
        workspace: str = "default",
        name: str | None = None,
        expires_in: timedelta | None = None,
        environment: Environment = LIVE,
        identity: str | None = None,
    ) -> CreatedKey:
        """The same as `await factory(...)`, for synchronous tests (`TestClient`)."""
        return run_sync(
            self(
                scopes=scopes,
                full_access=full_access,
                rate_limit=rate_limit,
                status=status,
                workspace=workspace,
                name=name,
                expires_in=expires_in,
                environment=environment,
                identity=identity,
            )
        )

    async def _create(
        self,
        *,
        scopes: tuple[str, ...] | None,
        full_access: bool,
        rate_limit: str | None,
        status: Status,
        workspace: str,
        name: str,
        expires_in: timedelta | None,
        environment: Environment,
        identity: str | None,
    ) -> CreatedKey:
        manager = self.manager
        created = await manager.create(
            name=name,
            workspace=workspace,
            scopes=scopes or (),
            full_access=full_access,
            rate_limit=rate_limit,
            expires_in=expires_in,
            environment=environment,
            identity=identity,
        )
        key_id = created.record.id
        record: KeyRecord
        if status == "disabled":
            record = await manager.disable(key_id)
        elif status == "revoked":
            record = await manager.revoke(key_id)
        elif status == "expired":
            record = await manager.store.shorten_expiry(key_id, utcnow())
        else:
            return created
        return CreatedKey(created.key, record)


class IdentityFactory:
    """Creates identities in `manager`, in any state: what the `make_identity` fixture
    returns.

    ```python
    shared = await make_identity(rate_limit="10/minute", credits=100)
    key = await make_key(identity=shared.id)                   # a key of that identity
    gone = await make_identity(status="revoked")              # also disabled
    acme = make_identity.sync("acme", workspace="acme")        # in a synchronous test
    ```

    Without an id, each gets the next of `test-identity-1`, `test-identity-2`, … The
    returned `IdentityRecord` is the record after the state change.
    """

    def __init__(self, manager: KeyManager) -> None:
        self.manager = manager
        self._numbers = itertools.count(1)

    def __repr__(self) -> str:
        return f"IdentityFactory(manager={self.manager!r})"

    def __call__(
        self,
        identity_id: str | None = None,
        *,
        workspace: str = "default",
        name: str | None = None,
        rate_limit: str | None = None,
        credits: int | None = None,
        credit_refill: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        status: IdentityStatus = "active",
    ) -> Coroutine[Any, Any, IdentityRecord]:
        """Create an identity; await the result. Arguments as
        `KeyManager.create_identity`, plus `status`."""
        if status not in _IDENTITY_STATUSES:
            raise ValueError(
                f"status must be one of {', '.join(_IDENTITY_STATUSES)}, not {status!r}"
            )
        chosen = identity_id if identity_id is not None else f"test-identity-{next(self._numbers)}"
        return self._create(
            chosen,
            status,
            workspace=workspace,
            name=name,
            rate_limit=rate_limit,
            credits=credits,
            credit_refill=credit_refill,
            metadata=metadata,
        )

    def sync(
        self,
        identity_id: str | None = None,
        *,
        workspace: str = "default",
        name: str | None = None,
        rate_limit: str | None = None,
        credits: int | None = None,
        credit_refill: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        status: IdentityStatus = "active",
    ) -> IdentityRecord:
        """The same as `await factory(...)`, for synchronous tests."""
        return run_sync(
            self(
                identity_id,
                workspace=workspace,
                name=name,
                rate_limit=rate_limit,
                credits=credits,
                credit_refill=credit_refill,
                metadata=metadata,
                status=status,
            )
        )

    async def _create(
        self, identity_id: str, status: IdentityStatus, **fields: Any
    ) -> IdentityRecord:
        manager = self.manager
        record = await manager.create_identity(identity_id, **fields)
        if status == "disabled":
            record = await manager.disable_identity(identity_id)
        elif status == "revoked":
            record = await manager.revoke_identity(identity_id)
        return record
