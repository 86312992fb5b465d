"""Another workspace's ids (and, for keys, another environment's) answer exactly as unknown
ids do, on SQLite and PostgreSQL: for every operation that takes a `{key_id}` or an
`{identity_id}`, the same status, the same body byte for byte, the same headers, and the
same work: the same store calls, in the same order (counted on the real store by wrapping
its methods, as tests/test_manager.py counts hash work). Nothing the suite can count tells
a caller that an id exists elsewhere."""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import re
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest

from apikeys import Hasher, KeyManager
from apikeys.api import OPERATIONS, ManagementAPI
from apikeys.stores import KeyStore
from apikeys.types import Message, Receive, Scope, Send

# Set while the API's router runs: the endpoint's work, after the middleware admitted the
# caller (whose cached record a first call loads).
INSIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("inside", default=False)
UNKNOWN_KEY = "Zz9Zz9Zz9Zz9"
UNKNOWN_IDENTITY = "idn_Zz9Zz9Zz9Zz9Zz9Zz9Zz9Zz"
# A body each operation accepts from the caller: the answer must come from the id alone.
BODIES: dict[str, Any] = {
    "update_key": {"name": "renamed"},
    "roll_key": {"grace_seconds": 0},
    "update_identity": {"name": "renamed"},
}


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def count_calls(target: object, calls: list[str], prefix: str) -> None:
    """Wrap each public coroutine method of `target` (on the instance: the real method runs
    underneath) so that a call made inside the router is noted in `calls` by name."""
    for name in dir(type(target)):
        method = getattr(target, name, None)
        if name.startswith("_") or not inspect.iscoroutinefunction(method):
            continue

        def wrap(real: Callable[..., Any], label: str) -> Callable[..., Any]:
            @functools.wraps(real)
            async def counted(*args: Any, **kwargs: Any) -> Any:
                if INSIDE.get():
                    calls.append(label)
                return await real(*args, **kwargs)

            return counted

        setattr(target, name, wrap(method, prefix + name))


def recorded(app: Any) -> Any:
    """`app`, run with `INSIDE` set."""

    async def record(scope: Scope, receive: Receive, send: Send) -> None:
        token = INSIDE.set(True)
        try:
            await app(scope, receive, send)
        finally:
            INSIDE.reset(token)

    return record


def without_count(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`headers` with the caller's requests left and seconds to the window's end taken out
    of `RateLimit` (`;r=N;t=T`): they move with every call and the clock, whatever the id."""
    return [
        (name, re.sub(rb";([rt])=[0-9]+", rb";\1=N", value) if name == b"ratelimit" else value)
        for name, value in headers
    ]


@dataclass
class Answer:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    calls: list[str]


class Service:
    def __init__(self, manager: KeyManager, auth: str, calls: list[str]) -> None:
        self.manager = manager
        self.calls = calls
        self.api = ManagementAPI(manager, rate_limit="100000/minute")
        self.api.middleware.app = recorded(self.api.middleware.app)
        self.auth = auth

    async def call(
        self, method: str, path: str, body: Any = None, idempotency_key: str | None = None
    ) -> Answer:
        """One request, as raw as the wire: status, header list, body bytes, store calls."""
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path.partition("?")[0],
            "raw_path": path.partition("?")[0].encode(),
            "query_string": path.partition("?")[2].encode(),
            "root_path": "",
            "headers": [
                (b"authorization", f"Bearer {self.auth}".encode()),
                (b"content-type", b"application/json"),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("test", 80),
        }
        if idempotency_key is not None:
            scope["headers"].append((b"idempotency-key", idempotency_key.encode()))
        content = b"" if body is None else httpx.Request("POST", "/", json=body).read()
        sent: list[Message] = []
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": content, "more_body": False}

        async def send(message: Message) -> None:
            sent.append(message)

        self.calls.clear()
        await self.api(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        answer_body = b"".join(
            m.get("body", b"") for m in sent if m["type"] == "http.response.body"
        )
        headers = without_count(list(start["headers"]))
        return Answer(start["status"], headers, answer_body, list(self.calls))


@pytest.fixture
async def service(store: KeyStore, hasher: Hasher) -> AsyncIterator[Service]:
    calls: list[str] = []
    count_calls(store, calls, "")
    identities = store.identities()
    assert identities is not None
    count_calls(identities, calls, "identities.")
    manager = KeyManager(store, hasher=hasher, usage_flush_interval=3600)
    try:
        made = await manager.create(
            name="ops",
            workspace="acme",
            scopes=["apikeys:read", "apikeys:write", "apikeys:admin", "contacts:read"],
        )
        yield Service(manager, made.key, calls)
    finally:
        await manager.aclose()


async def elsewhere(manager: KeyManager) -> dict[str, str]:
    """Ids the caller (a live key of `acme`) must not see: a key and an identity of
    `globex`, and a test key of `acme`; each key rolled once, with credits and usage, so
    that anything read past the record (a successor's balance, usage) would show."""
    await manager.create_identity("globex-cust", workspace="globex", credits=50)
    theirs = await manager.create(
        name="theirs", workspace="globex", scopes=["contacts:read"], credits=10
    )
    test_key = await manager.create(
        name="test", workspace="acme", environment="test", scopes=["contacts:read"], credits=10
    )
    ids = {}
    for label, created in (("other_workspace", theirs), ("other_environment", test_key)):
        await manager.verify(created.key)
        rolled = await manager.roll(created.record.id, grace=timedelta(hours=1))
        ids[label] = created.record.id
        assert rolled.record.id != created.record.id
    await manager.flush()
    ids["identity"] = "globex-cust"
    return ids


def id_operations() -> list[tuple[str, str, str, str]]:
    """(operation id, method, path template, the name of the id it takes) of every
    operation whose path takes an id, and `GET /audit?key_id=`."""
    found = []
    for operation in OPERATIONS:
        for name in ("key_id", "identity_id"):
            if "{" + name + "}" in operation.path:
                found.append((operation.id, operation.method, operation.path, name))
    found.append(("audit", "GET", "/audit?key_id={key_id}", "key_id"))
    found.append(("list_keys", "GET", "/keys?identity={identity_id}", "identity_id"))
    return found


def test_the_table_covers_every_operation_that_takes_an_id() -> None:
    covered = {operation_id for operation_id, *_ in id_operations()}
    # (The webhook operations are operators', who see every workspace's.)
    takes_an_id = {
        op.id for op in OPERATIONS if "{key_id}" in op.path or "{identity_id}" in op.path
    }
    assert takes_an_id <= covered
    assert len(takes_an_id) == 12
    assert set(BODIES) <= covered


async def test_an_id_of_another_workspace_or_environment_answers_and_works_as_an_unknown_one(
    service: Service,
) -> None:
    ids = await elsewhere(service.manager)
    before = {
        key_id: await service.manager.get(key_id)
        for key_id in (ids["other_workspace"], ids["other_environment"])
    }
    identity_before = await service.manager.get_identity(ids["identity"])
    # A first call warms whatever a first call warms (the caller's cached record).
    await service.call("GET", "/keys?limit=1")
    checked = 0
    for operation_id, method, template, name in id_operations():
        unknown = UNKNOWN_KEY if name == "key_id" else UNKNOWN_IDENTITY
        hidden = (
            [ids["other_workspace"], ids["other_environment"]]
            if name == "key_id"
            else [ids["identity"]]
        )
        body = BODIES.get(operation_id)
        # A POST also with an Idempotency-Key (a new one each time): kept, then let go.
        for idempotent, other in itertools.product(
            (False, True) if method == "POST" else (False,), hidden
        ):
            # Other, unknown, other: nothing the first call leaves behind is credited to
            # the id.
            answers = [
                await service.call(
                    method,
                    template.format(**{name: one}),
                    body,
                    uuid.uuid4().hex if idempotent else None,
                )
                for one in (other, unknown, other)
            ]
            first = answers[0]
            where = f"{operation_id} {other} {idempotent}"
            assert first.status in (200, 404), (where, first.status, first.body)
            assert first.calls, where
            for answer in answers[1:]:
                assert answer.status == first.status, where
                assert answer.body == first.body, where
                assert answer.headers == first.headers, where
                assert answer.calls == first.calls, (where, first.calls, answer.calls)
            checked += 1
    # 8 key operations (4 of them POSTs) by 2 ids; 6 identity ones (3 POSTs) by 1.
    assert checked == (8 + 4) * 2 + 6 + 3
    for key_id, record in before.items():
        assert await service.manager.get(key_id) == record
    assert await service.manager.get_identity(ids["identity"]) == identity_before


async def test_a_control_character_in_an_id_or_a_parameter_is_a_4xx_that_asks_no_store(
    manager: KeyManager,
) -> None:
    # A NUL is an error to PostgreSQL, not an unknown id: it answered 500.
    operator = await manager.create(
        name="ops", workspace="ops", scopes=["apikeys:read", "apikeys:write", "apikeys:admin"]
    )
    api = ManagementAPI(manager, operators={"ops"})
    headers = {"Authorization": f"Bearer {operator.key}"}
    transport = httpx.ASGITransport(app=api)
    cases = [
        ("GET", "/keys/%00", 404),
        ("GET", "/keys/a%00b", 404),
        ("PATCH", "/keys/%00", 404),
        ("GET", "/keys/%00/usage", 404),
        ("POST", "/keys/%00/roll", 404),
        ("GET", "/identities/%00", 404),
        ("GET", "/webhooks/deliveries/%00", 404),
        ("POST", "/webhooks/deliveries/%00/replay", 404),
        ("GET", "/audit?key_id=%00", 400),
        ("GET", "/keys?owner=%00", 400),
        ("GET", "/webhooks/deliveries?workspace=%00", 400),
    ]
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for method, path, status in cases:
            answer = await client.request(method, path, json={"name": "n"}, headers=headers)
            assert answer.status_code == status, (method, path, answer.text)
