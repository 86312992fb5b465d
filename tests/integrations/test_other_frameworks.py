"""Litestar (with its own test client) behind the middleware, and the Django example project
(with Django's own test client, over WSGI and ASGI)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
from litestar import Litestar, Request, get
from litestar.testing import TestClient

from apikeys import APIKeyMiddleware, Hasher, KeyManager
from tests.conftest import TEST_PEPPER

ROOT = Path(__file__).resolve().parents[2]


@get("/api/v1/contacts")
async def list_contacts(request: Request) -> dict[str, object]:  # type: ignore[type-arg]
    key = request.scope["apikey"]
    return {"workspace": key.workspace, "data": []}


def test_litestar_behind_the_middleware_with_its_own_test_client() -> None:
    manager = KeyManager("memory://", hasher=Hasher(pepper=TEST_PEPPER))
    app = APIKeyMiddleware(
        Litestar(route_handlers=[list_contacts], on_shutdown=[manager.aclose]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
    )
    with TestClient(app=app) as client:
        created = client.blocking_portal.call(
            lambda: manager.create(name="n", workspace="acme", scopes=["contacts:read"])
        )
        other = client.blocking_portal.call(
            lambda: manager.create(name="o", workspace="acme", scopes=["campaigns:read"])
        )
        headers = {"Authorization": f"Bearer {created.key}"}
        answer = client.get("/api/v1/contacts", headers=headers)
        assert answer.status_code == 200
        assert answer.json() == {"workspace": "acme", "data": []}
        assert "ratelimit" in answer.headers
        assert client.get("/api/v1/contacts").status_code == 401
        refused = client.get("/api/v1/contacts", headers={"Authorization": f"Bearer {other.key}"})
        assert refused.status_code == 403
        assert refused.json()["code"] == "insufficient_scope"
    # Litestar's shutdown ran through the middleware: the count was written.
    stored = asyncio.run(manager.store.get(created.record.id))
    assert stored is not None
    assert stored.record.request_count == 1


DJANGO_TEST = """
import asyncio, json
import httpx
from django.test import Client

from examples import django_app

key = {key!r}
bearer = {{"Authorization": f"Bearer {{key}}"}}
seen = {{}}

# Over WSGI, with Django's own test client.
client = Client()
ok = client.get("/api/v1/contacts", headers=bearer)
seen["wsgi_ok"] = [ok.status_code, ok.json()["workspace"], "RateLimit" in ok]
missing = client.get("/api/v1/contacts")
seen["wsgi_missing"] = [missing.status_code, missing["Content-Type"], missing.json()["code"]]
notes = client.get("/rest/v1/notes", headers=bearer)
seen["drf_read"] = [notes.status_code, notes.json()["workspace"]]
write = client.post("/rest/v1/notes", {{"text": "hi"}}, headers=bearer)
seen["drf_write"] = [write.status_code, write.json()["code"], write.json()["required_scopes"]]
seen["drf_missing"] = client.get("/rest/v1/notes").json()["code"]

# Over ASGI, the same project.
async def over_asgi():
    transport = httpx.ASGITransport(app=django_app.application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        ok = await http.get("/api/v1/contacts", headers=bearer)
        malformed = await http.get(
            "/api/v1/contacts", headers={{"Authorization": "Bearer nonsense"}}
        )
    refused = [malformed.status_code, malformed.json()["code"]]
    return [ok.status_code, "ratelimit" in ok.headers], refused

seen["asgi_ok"], seen["asgi_malformed"] = asyncio.run(over_asgi())
print(json.dumps(seen))
# Not closed: the usage counts are written as the process exits.
"""


@pytest.mark.sqlite
def test_the_django_example_over_wsgi_and_asgi(tmp_path: Path) -> None:
    # In processes of their own: Django's settings are global to a process.
    import json
    import os

    from apikeys.sync import KeyManager as SyncKeyManager

    url = f"sqlite:///{tmp_path / 'keys.db'}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "APIKEYS_PEPPER": TEST_PEPPER,
        "APIKEYS_STORE_URL": url,
    }

    def run(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip().splitlines()[-1]

    # The example's key-making command: the synchronous manager, as a management command.
    key = run("-m", "examples.django_app", "create-key", "acme", "contacts:read", "notes:read")
    seen = json.loads(run("-c", DJANGO_TEST.format(key=key)))
    assert seen["wsgi_ok"] == [200, "acme", True]
    assert seen["wsgi_missing"] == [401, "application/problem+json", "missing_api_key"]
    assert seen["drf_read"] == [200, "acme"]
    assert seen["drf_write"] == [403, "insufficient_scope", ["notes:write"]]
    assert seen["drf_missing"] == "missing_api_key"
    assert seen["asgi_ok"] == [200, True]
    assert seen["asgi_malformed"] == [401, "malformed_api_key"]
    with SyncKeyManager(url, hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        (record,) = manager.list("acme")
        day = manager.usage(record.id, days=1)[-1]
    assert day.admitted == 3  # contacts twice and notes once, written at exit
    assert day.refused == {"insufficient_scope": 1}
