"""The settings page against forms a browser never sends: a field sent twice is refused with
400 and changes nothing, whichever copy comes first (CONTRACT §12: a clear 4xx, nothing
changed). Only the scope checkboxes may repeat."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request

from apikeys import Hasher, KeyManager
from apikeys.stores import MemoryStore
from apikeys.testing import TEST_PEPPER
from apikeys.ui import KeysPage, PageUser

FORM = {"Content-Type": "application/x-www-form-urlencoded"}
SCOPES = {"items:read": "Read items", "items:write": "Write items"}


async def user(request: Request) -> PageUser | None:
    return PageUser("user_1", "acme", "user_1@acme.example")


def client_of(manager: KeyManager) -> httpx.AsyncClient:
    page = KeysPage(manager, user=user, secret_key="test-secret-key-0123456789", scopes=SCOPES)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=page), base_url="http://test")


def csrf(html: str) -> str:
    found = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert found is not None
    return found.group(1)


@pytest.fixture
async def memory_manager() -> AsyncIterator[KeyManager]:
    async with KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as made:
        yield made


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/{id}/disable", "csrf_token=x&csrf_token={token}"),
        ("/{id}/disable", "csrf_token={token}&csrf_token={token}"),
        ("/{id}/revoke", "csrf_token={token}&csrf_token=x"),
        ("/{id}/edit", "csrf_token={token}&name=a&name=b&access=restricted&scopes=items:read"),
        ("/{id}/edit", "csrf_token={token}&name=a&access=restricted&access=full"),
        ("/{id}/roll", "csrf_token={token}&grace=24h&grace=0"),
        ("/", "csrf_token={token}&name=a&name=b&access=full"),
        ("/", "csrf_token={token}&name=a&access=restricted&scopes=items:read&expires=&expires=1d"),
    ],
)
async def test_if_a_field_is_sent_twice_then_400_and_nothing_changes(
    memory_manager: KeyManager, path: str, body: str
) -> None:
    created = await memory_manager.create(name="mine", workspace="acme", scopes=["items:read"])
    before = await memory_manager.list("acme")
    async with client_of(memory_manager) as client:
        token = csrf((await client.get("/")).text)
        answer = await client.post(
            path.format(id=created.record.id),
            content=body.format(token=token),
            headers=FORM,
        )
    assert answer.status_code == 400, answer.text
    assert "holds a field twice" in answer.text
    assert await memory_manager.list("acme") == before


async def test_scope_checkboxes_may_repeat(memory_manager: KeyManager) -> None:
    async with client_of(memory_manager) as client:
        token = csrf((await client.get("/")).text)
        answer = await client.post(
            "/",
            content=f"csrf_token={token}&name=two&access=restricted"
            "&scopes=items:read&scopes=items:write&expires=",
            headers=FORM,
        )
    assert answer.status_code == 303, answer.text
    (record,) = await memory_manager.list("acme")
    assert record.scopes == ("items:read", "items:write")


async def test_if_the_client_cuts_a_form_off_then_400_to_no_one_never_an_application_error(
    memory_manager: KeyManager,
) -> None:
    # Part of the body, then the client is gone: Starlette raises ClientDisconnect, which
    # reached the server as an application error logged with its traceback.
    page = KeysPage(
        memory_manager, user=user, secret_key="test-secret-key-0123456789", scopes=SCOPES
    )
    messages = iter(
        [
            {"type": "http.request", "body": b"csrf_token=x&name=a", "more_body": True},
            {"type": "http.disconnect"},
        ]
    )
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        return next(messages)

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/",
        "raw_path": b"/",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"test"),
            (b"content-type", b"application/x-www-form-urlencoded"),
            (b"content-length", b"100"),
        ],
        "client": ("127.0.0.1", 1234),
        "server": ("test", 80),
    }
    await page(scope, receive, send)
    assert sent[0]["status"] == 400
    assert await memory_manager.list("acme") == []
