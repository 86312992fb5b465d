"""A migration's legacy scheme (`Authorization: Api-Key <key>`, djangorestframework-api-key's
default): off by default; when a deployment turns it on, read for imported keys only, and
counted in the key's usage history so the operator sees who still sends it."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import pytest

from apikeys import APIKeyMiddleware, KeyManager
from apikeys.errors import ConfigurationError
from apikeys.gate import Gate
from apikeys.importing import ForeignKey, import_keys
from apikeys.telemetry import TelemetryEvent

OLD_KEY = "Xb3kPq9Z.Lk2mN8pQ4rS6tU0vW2xY4zA6bC8dE0f"


def drf_hash(key: str) -> str:
    """djangorestframework-api-key 2's hash of a key: SHA-512 of the whole key."""
    return "sha512$$" + hashlib.sha512(key.encode()).hexdigest()


async def imported(manager: KeyManager, key: str = OLD_KEY, **fields: Any) -> str:
    row = ForeignKey(row=1, name="Zapier", hashed=drf_hash(key), prefix=key.split(".")[0], **fields)
    report = await import_keys(
        manager, [row], source="drf-api-key", workspace="acme", full_access=True
    )
    return report.imported[0].id


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope["apikey"].id.encode()})


def client(manager: KeyManager, **options: Any) -> httpx.AsyncClient:
    app = APIKeyMiddleware(_ok, manager=manager, protect="/api/", **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def test_if_legacy_scheme_not_turned_on_then_api_key_header_is_malformed(
    memory_manager: KeyManager,
) -> None:
    await imported(memory_manager)
    async with client(memory_manager) as http:
        answer = await http.get("/api/x", headers={"Authorization": f"Api-Key {OLD_KEY}"})
    assert answer.status_code == 401
    assert answer.json()["code"] == "malformed_api_key"


async def test_if_legacy_scheme_on_then_imported_key_admitted_and_counted(
    memory_manager: KeyManager,
) -> None:
    key_id = await imported(memory_manager)
    async with client(memory_manager, legacy_schemes=("Api-Key",)) as http:
        for header in (f"Api-Key {OLD_KEY}", f"api-key {OLD_KEY}", f"  API-KEY {OLD_KEY}\t"):
            answer = await http.get("/api/x", headers={"Authorization": header})
            assert answer.status_code == 200, answer.text
            assert answer.text == key_id
            assert answer.headers["RateLimit"].startswith('"default";r=')
        # The same key as Bearer: admitted, and not counted as the legacy scheme.
        bearer = await http.get("/api/x", headers={"Authorization": f"Bearer {OLD_KEY}"})
        assert bearer.status_code == 200
    await memory_manager.flush()
    today = (await memory_manager.usage(key_id, days=1))[-1]
    assert (today.admitted, today.legacy_scheme, dict(today.refused)) == (4, 3, {})
    assert today.to_dict()["legacy_scheme"] == 3
    assert (await memory_manager.get(key_id)).request_count == 4


async def test_if_key_issued_by_apikeys_sent_under_legacy_scheme_then_clear_401(
    memory_manager: KeyManager,
) -> None:
    await imported(memory_manager)
    own = await memory_manager.create(name="new", workspace="acme", full_access=True)
    async with client(memory_manager, legacy_schemes=("Api-Key",)) as http:
        answer = await http.get("/api/x", headers={"Authorization": f"Api-Key {own.key}"})
        assert answer.status_code == 401
        body = answer.json()
        assert body["code"] == "malformed_api_key"
        assert "Bearer" in body["detail"]
        assert "imported" in body["detail"]
        assert own.key not in answer.text
        # As Bearer it works.
        assert (await http.get("/api/x", headers={"Authorization": f"Bearer {own.key}"})).is_success
    await memory_manager.flush()
    assert (await memory_manager.get(own.record.id)).request_count == 1


BAD_LEGACY = [
    pytest.param("Api-Key ", id="empty"),
    pytest.param("Api-Key  " + OLD_KEY, id="two-spaces"),
    pytest.param("Api-Key short", id="too-short"),
    pytest.param("Api-Key " + "x" * 300, id="oversized"),
    pytest.param("Api-Key Xb3kPq9Z.wrong-secret-entirely", id="wrong-secret"),
    pytest.param("Api-Key ZZZZZZZZ.Lk2mN8pQ4rS6tU0vW2xY4zA6bC8dE0f", id="unknown-prefix"),
    pytest.param("Api-Key ak_live_0000000000000000000000000", id="damaged-own-key"),
    pytest.param("Api-KeyX" + OLD_KEY, id="no-space"),
    pytest.param("Token " + OLD_KEY, id="another-scheme"),
]


@pytest.mark.parametrize("header", BAD_LEGACY)
async def test_if_bad_input_under_legacy_scheme_then_4xx_never_500(
    memory_manager: KeyManager, header: str
) -> None:
    await imported(memory_manager)
    async with client(memory_manager, legacy_schemes=("Api-Key",)) as http:
        answer = await http.get("/api/x", headers={"Authorization": header})
    assert answer.status_code == 401
    assert answer.json()["code"] in {"malformed_api_key", "invalid_api_key"}
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")


async def test_if_imported_key_revoked_then_refused_under_legacy_scheme(
    memory_manager: KeyManager,
) -> None:
    key_id = await imported(memory_manager)
    await memory_manager.revoke(key_id)
    async with client(memory_manager, legacy_schemes=("Api-Key",)) as http:
        answer = await http.get("/api/x", headers={"Authorization": f"Api-Key {OLD_KEY}"})
    assert answer.status_code == 401
    assert answer.json()["code"] == "key_revoked"


async def test_legacy_scheme_in_telemetry(hasher: Any) -> None:
    from apikeys.stores.memory import MemoryStore

    events: list[TelemetryEvent] = []
    async with KeyManager(MemoryStore(), hasher=hasher, on_event=events.append) as manager:
        key_id = await imported(manager)
        async with client(manager, legacy_schemes=("Api-Key",)) as http:
            answer = await http.get("/api/x", headers={"Authorization": f"Api-Key {OLD_KEY}"})
            assert answer.status_code == 200
    assert [event.key_id for event in events if event.kind == "legacy_scheme"] == [key_id]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"legacy_schemes": "Api-Key"}, "list of scheme words"),
        ({"legacy_schemes": ["Api Key"]}, "not an Authorization scheme word"),
        ({"legacy_schemes": ["bearer"]}, "Bearer is always read"),
        ({"legacy_schemes": ["Api-Key"], "header": "X-API-Key"}, "words of the Authorization"),
    ],
)
async def test_legacy_schemes_checked_when_built(
    memory_manager: KeyManager, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Gate(memory_manager, **options)


async def test_gate_reads_only_its_schemes(memory_manager: KeyManager) -> None:
    plain = Gate(memory_manager)
    legacy = Gate(memory_manager, legacy_schemes=["Api-Key"])
    other = Gate(memory_manager, header="X-API-Key")
    cases = {
        b"Bearer x": (True, True),
        b"bearer x": (True, True),
        b"Api-Key x": (False, True),
        b"Token x": (False, False),
        b"Basic dXNlcg==": (False, False),
        b"": (False, False),
    }
    for value, (by_plain, by_legacy) in cases.items():
        headers = [(b"authorization", value)]
        assert plain.reads(headers) is by_plain, value
        assert legacy.reads(headers) is by_legacy, value
        assert other.reads(headers) is False
    assert other.reads([(b"x-api-key", b"anything")]) is True
    assert plain.reads([]) is False


async def test_legacy_scheme_in_metrics(hasher: Any) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from apikeys.stores.memory import MemoryStore
    from tests.test_telemetry import points

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    async with KeyManager(MemoryStore(), hasher=hasher, metrics=provider) as manager:
        await imported(manager)
        async with client(manager, legacy_schemes=("Api-Key",)) as http:
            for _ in range(2):
                answer = await http.get("/api/x", headers={"Authorization": f"Api-Key {OLD_KEY}"})
                assert answer.status_code == 200
    assert [value for _, value in points(reader)["apikeys.legacy_scheme"]] == [2]


def test_a_key_scheme_in_any_authorization_header_is_the_gates_to_read() -> None:
    from apikeys.credentials import carries_key

    auth = b"authorization"
    assert not carries_key([(auth, b"Basic x")], auth)
    assert not carries_key([(auth, b"Token x"), (auth, b"Basic y")], auth)
    # Ours beside another's, in either order: the gate reads them (and refuses two headers).
    assert carries_key([(auth, b"Basic x"), (auth, b"Bearer k")], auth)
    assert carries_key([(auth, b"Bearer k"), (auth, b"Basic x")], auth)
    assert carries_key([(auth, b"Bearer\tk")], auth)  # any whitespace after the scheme
    assert carries_key([(auth, b"Api-Key k")], auth, (b"api-key ",))
    assert not carries_key([(auth, b"Api-Key k")], auth)
    assert not carries_key([(auth, b"")], auth)
