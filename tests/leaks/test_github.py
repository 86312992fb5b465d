"""`SecretScanningReceiver` in process: mounted or routed in an app of the user's, and the
parts it is made of (GitHub's key list, signatures, alerts).

The example service's tests (tests/examples/test_secret_scanning.py) drive the same app
over HTTP in a real server; these show it where users put it, next to their own routes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from apikeys import ConfigurationError, Hasher, KeyManager, generate_key, parse_key
from apikeys.errors import InvalidPayload, SigningKeysUnavailable
from apikeys.leaks import BulkRevoke, SecretScanningReceiver
from apikeys.leaks.github import GitHubKeys, parse_key_list, validate_alerts
from tests.conftest import TEST_PEPPER
from tests.leaks.github_side import TOKEN_TYPE, KeyListServer, Signer, alerts

PROBLEM = "application/problem+json"


def unknown_token() -> str:
    return generate_key().token


@pytest.fixture(scope="module")
def signer() -> Signer:
    return Signer()


@pytest.fixture(scope="module")
def key_list(signer: Signer) -> Iterator[KeyListServer]:
    with KeyListServer([signer.entry()]) as server:
        yield server


def users_app(manager: KeyManager, receiver: SecretScanningReceiver) -> Starlette:
    """An application of the user's: its own route, and the receiver mounted and routed."""

    async def home(request: Any) -> PlainTextResponse:
        return PlainTextResponse("home")

    return Starlette(
        routes=[
            Route("/", home),
            Mount("/github/secret-scanning", receiver),
            Route("/hooks/secret-scanning", receiver),
        ]
    )


@pytest.fixture
async def client(
    memory_manager: KeyManager, key_list: KeyListServer
) -> AsyncIterator[httpx.AsyncClient]:
    receiver = SecretScanningReceiver(memory_manager, keys_url=key_list.url)
    transport = httpx.ASGITransport(app=users_app(memory_manager, receiver))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def signed_post(
    client: httpx.AsyncClient, path: str, body: bytes, signer: Signer
) -> httpx.Response:
    return await client.post(
        path,
        content=body,
        headers={"Content-Type": "application/json", **signer.headers(body)},
    )


@pytest.mark.parametrize("path", ["/github/secret-scanning/", "/hooks/secret-scanning"])
async def test_mounted_or_routed_a_reported_key_is_revoked_as_leaked(
    client: httpx.AsyncClient, memory_manager: KeyManager, signer: Signer, path: str
) -> None:
    key = (await memory_manager.create(name="leaky", full_access=True)).key
    unknown = unknown_token()

    response = await signed_post(client, path, alerts(key, unknown), signer)

    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json() == [
        {"token_raw": key, "token_type": TOKEN_TYPE, "label": "true_positive"},
        {"token_raw": unknown, "token_type": TOKEN_TYPE, "label": "false_positive"},
    ]
    record = await memory_manager.get(parse_key(key).id)
    assert record.status == "revoked"
    [*_, event] = await memory_manager.audit(key_id=record.id)
    assert (event.action, event.actor) == ("leak_revoked", "github-secret-scanning")
    assert (await client.get("/")).text == "home"


async def test_mounted_the_path_without_its_slash_is_redirected_to_it(
    client: httpx.AsyncClient, signer: Signer
) -> None:
    # Starlette's Mount serves the paths under the prefix: register the URL with GitHub
    # with the slash, or route the exact path to the receiver.
    response = await signed_post(client, "/github/secret-scanning", b"[]", signer)
    assert response.status_code == 307
    assert response.headers["location"] == "http://testserver/github/secret-scanning/"


async def test_unsigned_then_401_and_nothing_revoked(
    client: httpx.AsyncClient, memory_manager: KeyManager, signer: Signer
) -> None:
    key = (await memory_manager.create(name="leaky", full_access=True)).key
    body = alerts(key)
    response = await client.post(
        "/hooks/secret-scanning", content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 401
    assert response.headers["content-type"] == PROBLEM
    assert response.json()["code"] == "missing_signature"
    assert "www-authenticate" not in response.headers  # not a Bearer challenge
    forged = {**signer.headers(alerts(unknown_token())), "Content-Type": "application/json"}
    response = await client.post("/hooks/secret-scanning", content=body, headers=forged)
    assert (response.status_code, response.json()["code"]) == (401, "invalid_signature")
    assert (await memory_manager.get(parse_key(key).id)).status == "active"


async def test_with_action_disable_the_key_is_disabled_with_reason_leaked(
    memory_manager: KeyManager, key_list: KeyListServer, signer: Signer
) -> None:
    receiver = SecretScanningReceiver(memory_manager, action="disable", keys_url=key_list.url)
    key = (await memory_manager.create(name="leaky", full_access=True)).key
    transport = httpx.ASGITransport(app=users_app(memory_manager, receiver))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        response = await signed_post(client, "/hooks/secret-scanning", alerts(key), signer)
    assert response.json()[0]["label"] == "true_positive"
    record = await memory_manager.get(parse_key(key).id)
    assert record.status == "disabled"
    [*_, event] = await memory_manager.audit(key_id=record.id)
    assert event.action == "disabled"
    assert event.changes.get("reason") == "leaked"


def test_a_bad_configuration_is_refused_when_the_app_is_made(memory_manager: KeyManager) -> None:
    with pytest.raises(ConfigurationError, match="revoke"):
        SecretScanningReceiver(memory_manager, action="delete")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="https"):
        SecretScanningReceiver(memory_manager, keys_url="ftp://example.com/keys")
    with pytest.raises(ConfigurationError):
        BulkRevoke(memory_manager, trusted_proxies=-1)
    with pytest.raises(ValueError, match="rate limit"):
        BulkRevoke(memory_manager, rate_limit="lots")


async def test_if_the_key_store_is_unreachable_then_503_never_500(
    tmp_path: Any, key_list: KeyListServer, signer: Signer
) -> None:
    # A SQLite file in a directory that does not exist: every store call fails.
    url = f"sqlite:///{tmp_path / 'missing' / 'keys.db'}"
    manager = KeyManager(url, hasher=Hasher(pepper=TEST_PEPPER), cache=False)
    try:
        token = unknown_token()
        receiver = SecretScanningReceiver(manager, keys_url=key_list.url)
        bulk = BulkRevoke(manager)
        app = Starlette(routes=[Route("/alerts", receiver), Route("/revoke", bulk)])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answers = [
                await signed_post(client, "/alerts", alerts(token), signer),
                await client.post("/revoke", json=[token]),
            ]
        for response in answers:
            assert response.status_code == 503, response.text
            assert response.headers["content-type"] == PROBLEM
            assert response.json()["code"] == "auth_unavailable"
            assert response.headers["retry-after"] == "1"
    finally:
        await manager.aclose()


# -- GitHub's keys, signatures, alerts -------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_keys_are_refetched_for_an_unknown_identifier_at_most_once_a_minute() -> None:
    first, rotated = Signer(), Signer()
    clock = Clock()
    with KeyListServer([first.entry()]) as server:
        keys = GitHubKeys(server.url, clock=clock)

        async def scenario() -> None:
            assert await keys.get(first.identifier) is not None
            assert await keys.get(first.identifier) is not None
            assert server.fetches == 1
            server.keys = [first.entry(current=False), rotated.entry()]  # GitHub rotates
            clock.now += 30
            assert await keys.get(rotated.identifier) is None  # fetched 30 s ago: not yet
            assert server.fetches == 1
            clock.now += 31
            assert await keys.get(rotated.identifier) is not None
            assert server.fetches == 2
            assert await keys.get("unknown") is None
            assert await keys.get("unknown") is None
            assert server.fetches == 2

        asyncio.run(scenario())


def test_keys_too_old_are_refetched_and_never_used_when_that_fails() -> None:
    signer = Signer()
    clock = Clock()
    with KeyListServer([signer.entry()]) as server:
        keys = GitHubKeys(server.url, clock=clock)

        async def scenario() -> None:
            assert await keys.get(signer.identifier) is not None
            clock.now += keys.max_age
            server.status = 503
            with pytest.raises(SigningKeysUnavailable):
                await keys.get(signer.identifier)
            # Within the minute the failure stands, without another fetch.
            with pytest.raises(SigningKeysUnavailable):
                await keys.get(signer.identifier)
            assert server.fetches == 2
            server.status = 200
            clock.now += keys.refetch_interval
            assert await keys.get(signer.identifier) is not None
            assert server.fetches == 3

        asyncio.run(scenario())


def test_a_key_list_that_never_answers_times_out() -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts connections into the backlog, never answers
        keys = GitHubKeys(f"http://127.0.0.1:{silent.getsockname()[1]}/", timeout=0.3)
        started = time.monotonic()
        with pytest.raises(SigningKeysUnavailable):
            asyncio.run(keys.get("any"))
        assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"public_keys": {}}',
        b'{"public_keys": []}',
        b'{"public_keys": [{"key_identifier": "a", "key": "not a pem"}]}',
    ],
)
def test_a_key_list_without_a_usable_key_is_unavailable(body: bytes) -> None:
    with pytest.raises(SigningKeysUnavailable):
        parse_key_list(body)


def test_a_key_list_keeps_only_p256_keys() -> None:
    p384 = ec.generate_private_key(ec.SECP384R1()).public_key()
    pem = p384.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    ed25519_pem = (
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    signer = Signer()
    entries = [
        {"key_identifier": "p384", "key": pem},
        {"key_identifier": "ed25519", "key": ed25519_pem},
        7,
        signer.entry(),
    ]
    body = json.dumps({"public_keys": entries}).encode()
    assert set(parse_key_list(body)) == {signer.identifier}


def test_validated_alerts_keep_the_token_out_of_their_repr() -> None:
    token = unknown_token()
    [alert] = validate_alerts([{"token": token, "type": "t", "url": "", "extra": 1}])
    assert alert.token == token
    assert token not in repr(alert)
    with pytest.raises(InvalidPayload):
        validate_alerts({"token": token})
