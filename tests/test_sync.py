"""`apikeys.sync.KeyManager`: the asynchronous manager's methods, blocking, on every store."""

from __future__ import annotations

import asyncio
import gc
import inspect
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from apikeys import Hasher, InvalidTransition, KeyNotFound, KeyRevoked, SyncKeyManager
from apikeys import KeyManager as AsyncKeyManager
from apikeys.stores import KeyStore, store_from_url
from apikeys.sync import KeyManager, LoopThread
from tests.conftest import TEST_PEPPER, delete_redis_prefix

# The asynchronous manager's coroutine methods whose twin has another name.
RENAMED = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}


def public_coroutine_methods() -> list[str]:
    return sorted(
        name
        for name, member in inspect.getmembers(AsyncKeyManager, inspect.iscoroutinefunction)
        if not name.startswith("_") or name in RENAMED
    )


@pytest.mark.parametrize("name", public_coroutine_methods())
def test_every_public_coroutine_method_has_a_synchronous_twin(name: str) -> None:
    twin = RENAMED.get(name, name)
    assert hasattr(KeyManager, twin), f"apikeys.sync.KeyManager has no {twin}()"
    if name in RENAMED:
        return
    asynchronous = getattr(AsyncKeyManager, name)
    synchronous = KeyManager.__dict__[twin]
    # Same arguments (self aside), same result, same documentation.
    assert inspect.signature(synchronous.method) == inspect.signature(asynchronous)
    assert synchronous.__doc__ == asynchronous.__doc__
    with KeyManager(hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        bound = getattr(manager, twin)
        assert inspect.signature(bound) == inspect.signature(getattr(manager.manager, name))
        assert bound.__doc__ == asynchronous.__doc__


def test_the_root_package_exports_it() -> None:
    assert SyncKeyManager is KeyManager


@pytest.fixture
def sync_store(
    store_kind: str, store_url: str, store_options: dict[str, str]
) -> Iterator[KeyStore]:
    """A store of each kind, made outside any event loop; the manager sets it up."""
    yield store_from_url(store_url, **store_options)
    if "key_prefix" in store_options:
        asyncio.run(delete_redis_prefix(store_url, store_options["key_prefix"]))


@pytest.fixture
def sync_manager(sync_store: KeyStore) -> Iterator[KeyManager]:
    manager = KeyManager(sync_store, hasher=Hasher(pepper=TEST_PEPPER), usage_flush_interval=60)
    try:
        yield manager
    finally:
        manager.close()


def test_a_key_s_whole_life_without_an_event_loop(sync_manager: KeyManager) -> None:
    manager = sync_manager
    created = manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
    key_id = created.record.id
    assert manager.verify(created.key).id == key_id
    assert [record.id for record in manager.list("acme")] == [key_id]
    assert manager.update(key_id, name="Zapier 2").name == "Zapier 2"
    assert manager.disable(key_id, actor="ops").status == "disabled"
    assert manager.enable(key_id).status == "active"
    rolled = manager.roll(key_id, timedelta(0))
    assert rolled.record.replaces == key_id
    assert manager.verify(rolled.key).id == rolled.record.id
    manager.revoke(rolled.record.id)
    with pytest.raises(KeyRevoked):
        manager.verify(rolled.key)
    with pytest.raises(InvalidTransition):
        manager.enable(rolled.record.id)
    with pytest.raises(KeyNotFound):
        manager.get("nonexistent0")
    actions = [event.action for event in manager.audit(key_id=key_id)]
    assert "created" in actions
    assert "disabled" in actions
    manager.flush()
    assert manager.get(key_id).request_count == 1
    assert sum(day.admitted for day in manager.usage(key_id, days=1)) == 1


def test_closing_writes_the_usage_counts(sync_store: KeyStore) -> None:
    hasher = Hasher(pepper=TEST_PEPPER)
    with KeyManager(sync_store, hasher=hasher, usage_flush_interval=3600) as manager:
        created = manager.create(name="n", scopes=["a:read"])
        for _ in range(3):
            manager.verify(created.key)
    assert manager.closed
    assert not manager.loop_thread.thread.is_alive()
    manager.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        manager.get(created.record.id)
    # The store was closed: a new manager on the same store (set up again) reads the counts.
    with KeyManager(sync_store, hasher=hasher) as again:
        assert again.get(created.record.id).request_count == 3


def test_one_manager_shared_by_many_threads(sync_manager: KeyManager) -> None:
    created = sync_manager.create(name="n", scopes=["a:read"])
    errors: list[BaseException] = []
    made: list[str] = []

    def work() -> None:
        try:
            for _ in range(10):
                sync_manager.verify(created.key)
            made.append(sync_manager.create(name="t", scopes=["a:read"]).record.id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(set(made)) == 8
    sync_manager.flush()
    assert sync_manager.get(created.record.id).request_count == 80
    assert len(sync_manager.list()) == 9


def test_called_from_inside_a_running_event_loop(sync_manager: KeyManager) -> None:
    created = sync_manager.create(name="n", scopes=["a:read"])

    async def handler() -> str:
        # A synchronous helper called from async code: blocks this loop, never deadlocks.
        return sync_manager.verify(created.key).id

    assert asyncio.run(handler()) == created.record.id


def test_called_from_its_own_loop_it_refuses_rather_than_wait_forever() -> None:
    with KeyManager(hasher=Hasher(pepper=TEST_PEPPER)) as manager:

        async def hook() -> None:
            manager.list()

        with pytest.raises(RuntimeError, match="its own event loop"):
            manager.loop_thread.call(hook)


def test_a_manager_left_open_is_closed_when_collected(sync_store: KeyStore) -> None:
    hasher = Hasher(pepper=TEST_PEPPER)
    manager = KeyManager(sync_store, hasher=hasher, usage_flush_interval=3600)
    created = manager.create(name="n", scopes=["a:read"])
    manager.verify(created.key)
    thread = manager.loop_thread.thread
    del manager
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()
    with KeyManager(sync_store, hasher=hasher) as again:
        assert again.get(created.record.id).request_count == 1


def test_errors_of_the_async_manager_arrive_unchanged_and_leave_no_thread() -> None:
    from apikeys import ConfigurationError

    def loop_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "apikeys-sync-manager"}

    before = loop_threads()
    with pytest.raises(ConfigurationError, match="unknown key store scheme"):
        KeyManager("nonsense://")
    assert loop_threads() <= before


async def test_acall_awaits_from_another_loop_without_blocking_it() -> None:
    loop_thread = LoopThread()
    try:
        seen: list[str] = []

        async def on_the_loop() -> str:
            seen.append(threading.current_thread().name)
            return "done"

        assert await loop_thread.acall(on_the_loop) == "done"
        assert seen == ["apikeys"]
    finally:
        loop_thread.stop()
    assert not loop_thread.running
