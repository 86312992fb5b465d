"""Litestar (with its own test client) and Django (its ASGI application) behind the middleware."""

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
import asyncio, json, os, sys
import httpx

from apikeys import Hasher
from examples import django_app

async def main():
    manager = django_app.manager
    manager.hasher = Hasher(pepper=os.environ["APIKEYS_PEPPER"])
    created = await manager.create(name="n", workspace="acme", scopes=["contacts:read"])
    transport = httpx.ASGITransport(app=django_app.application)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        bearer = {"Authorization": f"Bearer {created.key}"}
        ok = await client.get("/api/v1/contacts", headers=bearer)
        malformed = await client.request(
            "get", "/api/v1/contacts", headers={"Authorization": "Bearer nonsense"}
        )
        missing = await client.get("/api/v1/contacts")
    await manager.aclose()
    print(json.dumps({
        "ok": [ok.status_code, ok.json(), "ratelimit" in ok.headers],
        "malformed": [malformed.status_code, malformed.json()["code"]],
        "missing": [missing.status_code, missing.json()["code"]],
        "id": created.record.id,
    }))

asyncio.run(main())
"""


@pytest.mark.sqlite
def test_django_asgi_behind_the_middleware(tmp_path: Path) -> None:
    # In a process of its own: Django's settings are global to a process.
    import json
    import os

    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "APIKEYS_PEPPER": TEST_PEPPER,
        "APIKEYS_STORE_URL": f"sqlite:///{tmp_path / 'keys.db'}",
    }
    result = subprocess.run(
        [sys.executable, "-c", DJANGO_TEST],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["ok"] == [200, {"workspace": "acme", "key": seen["id"], "data": []}, True]
    assert seen["malformed"] == [401, "malformed_api_key"]
    assert seen["missing"] == [401, "missing_api_key"]
