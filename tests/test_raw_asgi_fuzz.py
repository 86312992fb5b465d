"""Any bytes in path, query, headers and method, straight through ASGI: never a 500.

HTTP/2 servers pass bytes through that HTTP/1.1 parsers refuse, so the example service and
the middleware are driven here with raw ASGI scopes, as a server could hand them over:
`raw_path` and `query_string` of any bytes, `path` with any characters, any header names and
values, any method string. The answer is a response below 500, and nothing is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore
from tests.conftest import TEST_PEPPER

PREFIXES = [
    "/api/v1/contacts",
    "/api/v1/contacts/",
    "/api/v1/campaigns/",
    "/api/v1/openapi.json",
    "/api/v1/secret-scanning",
    "/login",
    "/logout",
    "/settings/integrations/api-keys",
    "/settings/integrations/api-keys/",
    "/settings/integrations/api-keys/AAAAAAAAAAAA/edit",
    "/settings/integrations/api-keys/static/",
    "/settings/integrations/api-keys/static/app.css",
    "/",
]

scopes = st.fixed_dictionaries(
    {
        "method": st.one_of(
            st.sampled_from(["GET", "POST", "get", "DELETE", "HEAD", "OPTIONS", "PATCH"]),
            st.text(max_size=12),
        ),
        "path": st.builds(str.__add__, st.sampled_from(PREFIXES), st.text(max_size=40)),
        "raw_path": st.binary(max_size=60),
        "query_string": st.binary(max_size=60),
        "headers": st.lists(
            st.tuples(
                st.one_of(
                    st.sampled_from(
                        [b"authorization", b"content-type", b"cookie", b"content-length"]
                    ),
                    st.binary(min_size=1, max_size=20),
                ),
                st.binary(max_size=80),
            ),
            max_size=5,
        ),
        "body": st.binary(max_size=200),
    }
)


async def call(app: Any, drawn: dict[str, Any]) -> int:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "2",
        "scheme": "http",
        "client": ("127.0.0.1", 4242),
        "server": ("testserver", 80),
        "root_path": "",
        **{name: drawn[name] for name in ("method", "path", "raw_path", "query_string")},
        "headers": drawn["headers"],
    }
    sent: list[dict[str, Any]] = []
    body = drawn["body"]

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    starts = [message for message in sent if message["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    return int(starts[0]["status"])


class Lifespan:
    """Runs an app's lifespan in a task: startup on enter, shutdown on exit."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def __aenter__(self) -> Lifespan:
        self.task = asyncio.ensure_future(
            self.app({"type": "lifespan", "asgi": {"version": "3.0"}}, self.inbox.get, self.put)
        )
        await self.inbox.put({"type": "lifespan.startup"})
        assert (await self.outbox.get())["type"] == "lifespan.startup.complete"
        return self

    async def put(self, message: dict[str, Any]) -> None:
        await self.outbox.put(message)

    async def __aexit__(self, *exc: object) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.outbox.get()
        await self.task


@pytest.fixture(scope="module")
def example_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("fuzz")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "APIKEYS_PEPPER": TEST_PEPPER,
            "APIKEYS_STORE_URL": f"sqlite:///{directory / 'keys.db'}",
            "EXAMPLE_DATABASE_URL": f"sqlite:///{directory / 'example.db'}",
            "APIKEYS_LIMITER_URL": "memory://",
            "APIKEYS_RATE_LIMIT": "100000/minute",
            # Never GitHub: unsigned requests are refused before any key list is fetched.
            "EXAMPLE_GITHUB_KEYS_URL": "http://127.0.0.1:9/secret_scanning",
            "EXAMPLE_ADMIN_EMAIL": "fuzz@example.com",
            "EXAMPLE_ADMIN_PASSWORD": "fuzz-password-0123456789",
        }.items():
            patch.setenv(name, value)
        yield directory


@contextlib.asynccontextmanager
async def example_app() -> AsyncIterator[Any]:
    from examples.contacts_service.app import create_app

    app = create_app()
    async with Lifespan(app):
        yield app


@dataclass
class RunningApp:
    """The example service after its startup, and the event loop it runs on."""

    loop: asyncio.AbstractEventLoop
    app: Any

    def call(self, drawn: dict[str, Any]) -> int:
        return self.loop.run_until_complete(call(self.app, drawn))


@pytest.fixture(scope="module")
def example_service(example_env: Path) -> Iterator[RunningApp]:
    """One started service for every example, as a server runs one app for every request:
    its startup (tables, the admin user's password hash) is paid once, not per example, and
    it is shut down at the end of the module."""
    loop = asyncio.new_event_loop()
    entered = example_app()
    try:
        app = loop.run_until_complete(entered.__aenter__())
        try:
            yield RunningApp(loop, app)
        finally:
            loop.run_until_complete(entered.__aexit__(None, None, None))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


@pytest.mark.sqlite
@given(drawn=scopes)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_if_the_example_service_gets_any_bytes_then_never_a_500(
    example_service: RunningApp, drawn: dict[str, Any]
) -> None:
    status = example_service.call(drawn)
    assert status < 500, drawn


@given(drawn=scopes)
@settings(max_examples=300, deadline=None)
def test_if_the_middleware_gets_any_bytes_then_a_4xx_and_nothing_counted(
    drawn: dict[str, Any],
) -> None:
    async def ok(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def scenario() -> tuple[int, MemoryStore]:
        store = MemoryStore()
        manager = KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER))
        app = APIKeyMiddleware(
            ok, manager=manager, scopes={"GET /api/v1/contacts": "contacts:read"}, protect="/api/"
        )
        status = await call(app, drawn)
        await manager.aclose()
        return status, store

    status, store = asyncio.run(scenario())
    assert status < 500, drawn
    if drawn["path"].startswith("/api/"):
        assert 400 <= status < 500  # no key in the store: nothing passes
    assert repr(store) == "MemoryStore(keys=0)"
