"""A synchronous `KeyManager`, for scripts, management commands and WSGI views.

```python
from apikeys.sync import KeyManager

with KeyManager("sqlite:///apikeys.db") as manager:
    created = manager.create(name="Zapier", workspace="acme", scopes=["contacts:read"])
    record = manager.verify(created.key)
```

Every method of the asynchronous `apikeys.KeyManager` is here under the same name, with
the same arguments, result and errors, and blocks until it is done; `aclose` is `close`,
and `with` replaces `async with`. The methods are made from the asynchronous ones (their
signatures and docstrings are theirs), so the two cannot drift apart.

How it works: the manager owns one event loop, running in a daemon thread of its own (a
`LoopThread`), and every call is a coroutine submitted to that loop, whose result the
calling thread waits for. This is the design of anyio's blocking portal, rather than a new
event loop per call (`asyncio.run`, or asgiref's `async_to_sync` outside an event loop):
a manager's connections (an asyncpg pool, a Redis client), its key cache's listener and its
usage buffer's timer belong to one loop and must outlive a call, so they live on a loop that
outlives every call. Consequences:

- Any number of threads may share one manager (it is thread-safe): their calls run as
  concurrent tasks on its loop, as the requests of an ASGI server do.
- It may be called from inside a running event loop (a sync function called from async
  code) without deadlocking, since its own loop runs elsewhere; the caller's loop is blocked
  for the call's duration, so async code should await `apikeys.KeyManager` instead.
- Calling it from its own loop (from an `on_event` hook, say) would wait forever: that
  raises `RuntimeError` instead.
- A manager used without `with` runs `setup()` before its first call, as `with` does: a
  pepper other than the store's raises `ConfigurationError` there, with the store's
  fingerprint message, rather than every key answering `invalid_api_key`.
- `close()` (or leaving `with`) writes the buffered usage counts, closes the store and stops
  the thread. A manager left open is closed when it is garbage-collected or at interpreter
  exit, so its counts are still written, as the asynchronous manager's are.
- The thread does not survive `fork()`: make the manager in the process that uses it
  (after the fork of a pre-forking server), as with any connection pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from types import TracebackType
from typing import Any, Concatenate, Final, Generic, ParamSpec, Self, TypeVar, overload

from apikeys.listing import DEFAULT_PAGE_SIZE
from apikeys.manager import KeyManager as AsyncKeyManager
from apikeys.stores.contract import KeyStore
from apikeys.types import Environment, KeyRecord, Status

__all__ = ["KeyManager", "LoopThread", "SyncKeyManager"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

# How long closing a manager left open may take at interpreter exit (seconds).
_EXIT_TIMEOUT: Final = 5.0


class LoopThread:
    """An event loop running in a daemon thread of its own, and a way to call into it.

    `call(function, *args)` runs the coroutine function `function(*args)` on the loop from
    any other thread, and blocks until it returns or raises; `acall` is the same for a
    coroutine running on another event loop, which it does not block. `stop()` cancels what
    is left on the loop and ends the thread.
    """

    def __init__(self, name: str = "apikeys") -> None:
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._started.wait()

    def _run(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        loop.call_soon(self._started.set)
        try:
            loop.run_forever()
        finally:
            try:
                tasks = asyncio.all_tasks(loop)
                for task in tasks:
                    task.cancel()
                if tasks:
                    loop.run_until_complete(asyncio.wait(tasks, timeout=1.0))
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    @property
    def running(self) -> bool:
        """Whether the loop still runs (`stop()` has not been called)."""
        return self.thread.is_alive() and not self.loop.is_closed()

    def in_thread(self) -> bool:
        """Whether the caller runs in this loop's thread."""
        return threading.current_thread() is self.thread

    def submit(
        self, function: Callable[_P, Awaitable[_R]], *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_R]:
        """Schedule `function(*args, **kwargs)` on the loop; its result as a future."""
        if not self.running:
            raise RuntimeError("the event loop of this apikeys manager is closed")

        async def run() -> _R:
            return await function(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def call(
        self,
        function: Callable[_P, Awaitable[_R]],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _R:
        """Run `function(*args, **kwargs)` on the loop and wait for its result.

        Raises `RuntimeError` when called from the loop's own thread, where waiting would
        never end.
        """
        if self.in_thread():
            raise RuntimeError(
                "a synchronous apikeys manager was called from its own event loop, where "
                "it would wait forever: await the asynchronous manager (`.manager`) there"
            )
        future = self.submit(function, *args, **kwargs)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (KeyboardInterrupt): the task is cancelled too
            raise

    async def acall(
        self,
        function: Callable[_P, Awaitable[_R]],
        *args: _P.args,
        **kwargs: _P.kwargs,
    ) -> _R:
        """`call` for a coroutine running on another event loop: awaits instead of blocking."""
        if self.in_thread():
            return await function(*args, **kwargs)
        future = self.submit(function, *args, **kwargs)
        return await asyncio.wrap_future(future)

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is left on the loop, stop it and wait (up to `timeout`) for the thread."""
        if self.loop.is_closed():
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # closed meanwhile
            return
        if not self.in_thread():
            self.thread.join(timeout)


class _Blocking(Generic[_P, _R]):
    """A method of the synchronous manager made from a coroutine method of the async one:
    the same signature and docstring, run on the manager's loop."""

    def __init__(
        self, method: Callable[Concatenate[AsyncKeyManager, _P], Coroutine[Any, Any, _R]]
    ) -> None:
        self.method = method
        self.__doc__ = method.__doc__
        self.__wrapped__ = method

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Self: ...

    @overload
    def __get__(self, instance: KeyManager, owner: type) -> Callable[_P, _R]: ...

    def __get__(self, instance: KeyManager | None, owner: type) -> Self | Callable[_P, _R]:
        if instance is None:
            return self
        bound = self.method.__get__(instance.manager, AsyncKeyManager)
        loop = instance.loop_thread

        if self.name == "setup":

            @functools.wraps(bound)
            def set_up(*args: _P.args, **kwargs: _P.kwargs) -> _R:
                instance._check_open()
                result = loop.call(bound, *args, **kwargs)
                instance._set_up = True
                return result  # type: ignore[no-any-return]

            return set_up

        @functools.wraps(bound)
        def blocking(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            instance._check_open()
            if not instance._set_up:
                instance._set_up_once()
            return loop.call(bound, *args, **kwargs)  # type: ignore[no-any-return]

        return blocking


async def _make(store: KeyStore | str, options: dict[str, Any]) -> AsyncKeyManager:
    """The asynchronous manager, made on the loop it will run on."""
    return AsyncKeyManager(store, **options)


def _close(loop: LoopThread, manager: AsyncKeyManager, timeout: float | None) -> None:
    """Close `manager` on `loop` and stop the loop: what `close()`, garbage collection and
    interpreter exit do. From the loop's own thread, only schedules it."""
    if not loop.running:
        return
    if loop.in_thread():
        task = loop.loop.create_task(manager.aclose())
        task.add_done_callback(lambda _: loop.stop())
        return
    try:
        loop.submit(manager.aclose).result(timeout)
    finally:
        loop.stop(timeout)


class KeyManager:
    """The synchronous twin of `apikeys.KeyManager` (see the module's documentation).

    `KeyManager(store, **options)` takes the asynchronous manager's arguments and makes it
    on its own event loop (`manager` is that asynchronous manager, `loop_thread` its loop).
    Use it as `with KeyManager(...) as manager:`, or call `close()` when done.
    """

    def __init__(self, store: KeyStore | str = "memory://", **options: Any) -> None:
        self.loop_thread = LoopThread("apikeys-sync-manager")
        self._closed = False
        self._set_up = False
        self._setting_up = threading.Lock()
        try:
            self.manager: AsyncKeyManager = self.loop_thread.call(_make, store, options)
        except BaseException:
            self.loop_thread.stop()
            raise
        self._finalizer = weakref.finalize(
            self, _close, self.loop_thread, self.manager, _EXIT_TIMEOUT
        )

    def __repr__(self) -> str:
        return f"apikeys.sync.KeyManager(store={self.manager.store!r})"

    def __enter__(self) -> Self:
        self._check_open()
        self.loop_thread.call(self.manager.__aenter__)
        self._set_up = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this apikeys manager is closed")

    def _set_up_once(self) -> None:
        """`setup()` before the first call of a manager used without `with`: a pepper other
        than the store's raises `ConfigurationError` (the store's fingerprint message) at
        first use rather than every `verify` answering `invalid_api_key`. Tried again on the
        next call when it fails."""
        with self._setting_up:
            if not self._set_up:
                self.loop_thread.call(self.manager.setup)
                self._set_up = True

    @property
    def closed(self) -> bool:
        """Whether `close()` has been called."""
        return self._closed

    def close(self) -> None:
        """Write buffered usage, stop the cache, close the store and stop the loop's thread.

        Closing twice does nothing.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _close(self.loop_thread, self.manager, None)

    # The methods of the asynchronous manager, one for one (tests/test_sync.py checks that
    # every public coroutine method has its twin here).

    setup = _Blocking(AsyncKeyManager.setup)
    create = _Blocking(AsyncKeyManager.create)
    get = _Blocking(AsyncKeyManager.get)
    list = _Blocking(AsyncKeyManager.list)
    list_page = _Blocking(AsyncKeyManager.list_page)
    verify = _Blocking(AsyncKeyManager.verify)
    verify_imported = _Blocking(AsyncKeyManager.verify_imported)
    update = _Blocking(AsyncKeyManager.update)
    disable = _Blocking(AsyncKeyManager.disable)
    enable = _Blocking(AsyncKeyManager.enable)
    revoke = _Blocking(AsyncKeyManager.revoke)
    roll = _Blocking(AsyncKeyManager.roll)
    audit = _Blocking(AsyncKeyManager.audit)
    audit_page = _Blocking(AsyncKeyManager.audit_page)
    usage = _Blocking(AsyncKeyManager.usage)
    identity_usage = _Blocking(AsyncKeyManager.identity_usage)
    spend_credits = _Blocking(AsyncKeyManager.spend_credits)
    spend_request_credits = _Blocking(AsyncKeyManager.spend_request_credits)
    usable_identity = _Blocking(AsyncKeyManager.usable_identity)
    flush = _Blocking(AsyncKeyManager.flush)
    import_lookup_secret = _Blocking(AsyncKeyManager.import_lookup_secret)
    add_imported = _Blocking(AsyncKeyManager.add_imported)
    create_identity = _Blocking(AsyncKeyManager.create_identity)
    get_identity = _Blocking(AsyncKeyManager.get_identity)
    list_identities = _Blocking(AsyncKeyManager.list_identities)
    list_identities_page = _Blocking(AsyncKeyManager.list_identities_page)
    update_identity = _Blocking(AsyncKeyManager.update_identity)
    disable_identity = _Blocking(AsyncKeyManager.disable_identity)
    enable_identity = _Blocking(AsyncKeyManager.enable_identity)
    revoke_identity = _Blocking(AsyncKeyManager.revoke_identity)
    check_identity = _Blocking(AsyncKeyManager.check_identity)

    def iter_keys(
        self,
        workspace: str | None = None,
        *,
        owner: str | None = None,
        status: Status | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        environment: Environment | None = None,
        identity: str | None = None,
    ) -> Iterator[KeyRecord]:
        """Every record that matches, oldest first, read `page_size` at a time
        (`list_page` without the cursors)."""
        cursor: str | None = None
        while True:
            page = self.list_page(
                workspace,
                owner=owner,
                status=status,
                limit=page_size,
                cursor=cursor,
                environment=environment,
                identity=identity,
            )
            yield from page.records
            if page.next_cursor is None:
                return
            cursor = page.next_cursor


SyncKeyManager = KeyManager
"""`apikeys.sync.KeyManager`, under a name that does not shadow `apikeys.KeyManager`."""
