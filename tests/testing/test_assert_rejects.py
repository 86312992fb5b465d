"""assert_rejects_bad_credentials: passes on the real middleware, fails on broken apps."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware, KeyManager, MemoryStore
from apikeys.keys import parse_key
from apikeys.testing import (
    BadCredentials,
    KeyFactory,
    assert_rejects_bad_credentials,
    async_assert_rejects_bad_credentials,
    in_memory_manager,
)
from apikeys.testing.factory import close_manager
from apikeys.types import Message, Receive, Scope, Send, StoredKey

EXAMPLES = 100


async def contacts(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"contacts of {request.scope['apikey'].workspace}")


def protected(manager: KeyManager) -> APIKeyMiddleware:
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/contacts", contacts, methods=["GET", "POST"])]),
        manager=manager,
        scopes={"POST /api/contacts": "contacts:write"},
        protect="/api/",
    )


@pytest.fixture
def app(apikeys_manager: KeyManager) -> APIKeyMiddleware:
    return protected(apikeys_manager)


async def respond(send: Send, status: int, body: bytes = b"", content_type: bytes = b"") -> None:
    headers = [(b"content-type", content_type)] if content_type else []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def authorization(scope: Scope) -> list[bytes]:
    return [value for name, value in scope["headers"] if name == b"authorization"]


async def admits_any_bearer(scope: Scope, receive: Receive, send: Send) -> None:
    """The classic bug: checks the scheme, never the key."""
    values = authorization(scope)
    ok = bool(values) and values[0].lower().startswith(b"bearer ")
    await respond(send, 200 if ok else 401)


async def crashes_on_odd_bytes(scope: Scope, receive: Receive, send: Send) -> None:
    """Decodes the header as ASCII without catching the error."""
    for value in authorization(scope):
        value.decode("ascii")
    await respond(send, 401)


def crashing_starlette_app() -> Starlette:
    """A Starlette app whose auth check raises: ServerErrorMiddleware answers 500."""

    async def endpoint(request: Request) -> PlainTextResponse:
        token = request.headers.get("authorization", "Bearer x").split(" ")[1]
        return PlainTextResponse("no" if token else "no!", status_code=401)

    return Starlette(routes=[Route("/api/contacts", endpoint)])


class TestPasses:
    def test_on_the_middleware_with_a_valid_key(
        self, app: APIKeyMiddleware, make_key: KeyFactory
    ) -> None:
        created = make_key.sync(scopes=["contacts:read"])
        assert_rejects_bad_credentials(
            app, "/api/contacts", valid_key=created.key, max_examples=EXAMPLES
        )

    def test_on_the_middleware_without_a_key(self, app: APIKeyMiddleware) -> None:
        assert_rejects_bad_credentials(app, "/api/contacts?limit=5", max_examples=EXAMPLES)

    def test_with_another_method_and_prefix(self) -> None:
        manager = in_memory_manager(prefix="acme_live")
        try:
            key = KeyFactory(manager).sync(full_access=True).key
            assert_rejects_bad_credentials(
                protected(manager), "/api/contacts", method="post", valid_key=key, max_examples=50
            )
            assert_rejects_bad_credentials(
                protected(manager), "/api/contacts", prefix="acme_live", max_examples=50
            )
        finally:
            close_manager(manager)

    def test_when_the_store_is_down_503_auth_unavailable_is_failing_closed(self) -> None:
        class DownStore(MemoryStore):
            def get_for_verification_now(self, key_id: str) -> StoredKey | None:
                raise ConnectionError("down")

        manager = KeyManager(DownStore())
        try:
            assert_rejects_bad_credentials(protected(manager), "/api/contacts", max_examples=50)
        finally:
            close_manager(manager)

    async def test_async_variant_runs_on_the_tests_loop(
        self, app: APIKeyMiddleware, make_key: KeyFactory
    ) -> None:
        created = await make_key(scopes=["contacts:read"])
        loops: set[asyncio.AbstractEventLoop] = set()

        async def spy(scope: Scope, receive: Receive, send: Send) -> None:
            loops.add(asyncio.get_running_loop())
            await app(scope, receive, send)

        await async_assert_rejects_bad_credentials(
            spy, "/api/contacts", valid_key=created.key, max_examples=50
        )
        assert loops == {asyncio.get_running_loop()}
        # The key still works: nothing above counted against it or changed it.
        assert (await app.manager.verify(created.key)).status == "active"


def failure(app: object, **options: object) -> AssertionError:
    options.setdefault("max_examples", EXAMPLES)
    with pytest.raises(AssertionError) as info:
        assert_rejects_bad_credentials(app, "/api/contacts", **options)  # type: ignore[arg-type]
    return info.value


def full_report(error: AssertionError) -> str:
    return str(error) + "\n".join(getattr(error, "__notes__", []))


class TestFails:
    def test_when_any_bearer_is_admitted(self, make_key: KeyFactory) -> None:
        key = make_key.sync().key
        error = failure(admits_any_bearer, valid_key=key)
        report = full_report(error)
        assert "GET /api/contacts let the request through: 200" in report
        # The offending header is shown, the key is not.
        assert "Authorization: b'" in report
        assert parse_key(key).secret[:16] not in report
        assert key not in report

    def test_when_the_app_crashes(self) -> None:
        error = failure(crashes_on_odd_bytes)
        assert "raised UnicodeDecodeError" in str(error)
        assert isinstance(error.__cause__, UnicodeDecodeError)

    def test_when_starlette_answers_500(self) -> None:
        error = failure(crashing_starlette_app())
        assert "raised IndexError (after starting a 500 response)" in str(error)

    def test_when_the_app_answers_503_without_auth_unavailable(self) -> None:
        async def unavailable(scope: Scope, receive: Receive, send: Send) -> None:
            await respond(send, 503, b'{"code": "maintenance"}', b"application/json")

        error = failure(unavailable)
        assert "answered 503 (only 503 auth_unavailable may fail closed)" in str(error)

    def test_when_the_app_echoes_the_credentials(self) -> None:
        async def echo(scope: Scope, receive: Receive, send: Send) -> None:
            body = json.dumps({"detail": f"bad key: {authorization(scope)!r}"}).encode()
            await respond(send, 401, body, b"application/json")

        error = failure(echo)
        assert "echoed the credentials it was sent in its 401 response" in str(error)

    def test_when_the_key_is_read_from_the_query_string(
        self, app: APIKeyMiddleware, make_key: KeyFactory
    ) -> None:
        key = make_key.sync().key

        async def query_too(scope: Scope, receive: Receive, send: Send) -> None:
            query = scope["query_string"].decode()
            if "=" in query and not authorization(scope):
                value = query.split("=", 1)[1]
                scope["headers"] = [
                    *scope["headers"],
                    (b"authorization", b"Bearer " + value.encode()),
                ]
            await app(scope, receive, send)

        report = full_report(failure(query_too, valid_key=key))
        assert "key in the query string" in report
        assert key not in report

    def test_when_the_first_of_two_headers_wins(
        self, app: APIKeyMiddleware, make_key: KeyFactory
    ) -> None:
        key = make_key.sync().key

        async def first_wins(scope: Scope, receive: Receive, send: Send) -> None:
            values = authorization(scope)
            if len(values) > 1:
                scope["headers"] = [(b"authorization", values[0])]
            await app(scope, receive, send)

        report = full_report(failure(first_wins, valid_key=key))
        assert "two Authorization headers" in report

    def test_when_the_app_never_answers(self) -> None:
        async def silent(scope: Scope, receive: Receive, send: Send) -> None:
            await asyncio.sleep(10)

        error = failure(silent, request_timeout=0.01, max_examples=2)
        assert "gave no answer within 0.01 seconds" in str(error)

    def test_when_the_app_sends_nothing(self) -> None:
        async def mute(scope: Scope, receive: Receive, send: Send) -> None:
            return None

        assert "sent no response" in str(failure(mute, max_examples=2))

    async def test_async_variant_fails_too(self) -> None:
        with pytest.raises(AssertionError, match="let the request through"):
            await async_assert_rejects_bad_credentials(
                admits_any_bearer, "/api/contacts", max_examples=EXAMPLES
            )


class TestUsage:
    async def test_sync_variant_in_a_running_loop_says_what_to_use(
        self, app: APIKeyMiddleware
    ) -> None:
        with pytest.raises(RuntimeError, match="await async_assert_rejects_bad_credentials"):
            assert_rejects_bad_credentials(app, "/api/contacts")

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"valid_key": "ak_nope"}, "valid_key is not a well-formed key"),
            ({"path": "api/contacts"}, "path must start with '/'"),
        ],
    )
    def test_bad_arguments(
        self, app: APIKeyMiddleware, options: dict[str, str], message: str
    ) -> None:
        path = options.pop("path", "/api/contacts")
        with pytest.raises(ValueError, match=message):
            assert_rejects_bad_credentials(app, path, **options)  # type: ignore[arg-type]

    def test_bad_credentials_repr_masks_keys(self) -> None:
        key = "ak_3xK9pQ2mZ7aB_Vd2hR8sLk4NwQ1e9TfYb6GcJ0uMiPzXaQ1w2e3"
        credentials = BadCredentials(
            "label",
            (b"Bearer " + key.encode(),),
            ((b"x-api-key", key.encode()),),
            b"k=" + key.encode(),
        )
        text = repr(credentials)
        assert key not in text
        assert "Vd2hR8sL" not in text
        assert text.count("ak_3xK9…_Vd2h…") == 3
        assert credentials.headers()[1] == (b"authorization", b"Bearer " + key.encode())


def test_messages_are_received(app: APIKeyMiddleware) -> None:
    """An app that reads the body before answering gets it, then a disconnect."""
    seen: list[Message] = []

    async def reader(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(await receive())
        await respond(send, 401)
        seen.append(await receive())

    assert_rejects_bad_credentials(reader, "/api/contacts", max_examples=3)
    assert seen[0]["type"] == "http.request"
    assert seen[1]["type"] == "http.disconnect"
