"""The contacts service mounts the management API at `/v1/api-keys`, and `make demo`'s key
manages the workspace's keys there: the demo's printed `curl` line makes a key, as pasted.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from examples.contacts_service.api import MANAGEMENT_PATH

from apikeys import Hasher, KeyManager
from tests.examples.conftest import PEPPER, service_env, start_service, stop_service
from tests.examples.test_contacts_service import _serve_demo, assert_problem

CONTACTS = "/api/v1/contacts"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """The service on SQLite files of its own: its base URL and its key store's URL."""
    tmp = tmp_path_factory.mktemp("management-api")
    store_url = f"sqlite:///{tmp / 'apikeys.db'}"
    env = service_env(
        APIKEYS_STORE_URL=store_url, EXAMPLE_DATABASE_URL=f"sqlite:///{tmp / 'example.db'}"
    )
    process, base_url = start_service(env, tmp / "service.log")
    try:
        yield base_url, store_url
    finally:
        stop_service(process, tmp / "service.log")


def full_access_key(store_url: str, workspace: str) -> str:
    async def create() -> str:
        async with KeyManager(store_url, hasher=Hasher(pepper=PEPPER), webhooks=False) as manager:
            made = await manager.create(name="ops", workspace=workspace, full_access=True)
        return made.key

    return asyncio.run(create())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_service_mounts_the_management_api_for_its_workspaces_keys(
    service: tuple[str, str],
) -> None:
    base_url, store_url = service
    api = base_url + MANAGEMENT_PATH
    workspace, other = f"ws-{uuid.uuid4().hex[:8]}", f"ws-{uuid.uuid4().hex[:8]}"
    key, others = full_access_key(store_url, workspace), full_access_key(store_url, other)

    document = httpx.get(api + "/openapi.json")
    assert document.status_code == 200
    assert "/keys" in document.json()["paths"]
    assert_problem(httpx.get(api + "/keys"), 401, "missing_api_key")

    made = httpx.post(
        api + "/keys",
        headers={**bearer(key), "Idempotency-Key": "made-once"},
        json={"name": "zapier", "scopes": ["contacts:read"]},
    )
    assert made.status_code == 201, made.text
    new = made.json()
    assert new["workspace"] == workspace
    assert httpx.get(base_url + CONTACTS, headers=bearer(new["key"])).status_code == 200
    # A key of the workspace, not the management API's: it may not manage keys.
    assert_problem(httpx.get(api + "/keys", headers=bearer(new["key"])), 403, "insufficient_scope")
    # Another workspace's key sees it as no key at all.
    assert_problem(httpx.get(api + f"/keys/{new['id']}", headers=bearer(others)), 404, "not_found")

    revoked = httpx.post(api + f"/keys/{new['id']}/revoke", headers=bearer(key))
    assert revoked.status_code == 200, revoked.text
    assert_problem(httpx.get(base_url + CONTACTS, headers=bearer(new["key"])), 401, "key_revoked")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="the demo prints a curl command line")
def test_if_make_demo_serves_then_its_printed_curl_line_makes_a_key_through_the_api(
    tmp_path: Path,
) -> None:
    with _serve_demo(tmp_path) as base_url:
        [log] = tmp_path.glob("demo-*.log")
        printed = [line.strip() for line in log.read_text().splitlines()]
        demo_key = next(line for line in printed if line.startswith("ak_"))
        [command] = [line for line in printed if line.endswith(f"{MANAGEMENT_PATH}/keys")]
        assert command.startswith(f'curl -H "Authorization: Bearer {demo_key}"')
        assert f"{base_url}{MANAGEMENT_PATH}" in command

        ran = subprocess.run(
            shlex.split(command), capture_output=True, text=True, timeout=30, check=False
        )
        assert ran.returncode == 0, ran.stderr
        made = json.loads(ran.stdout)
        assert made["name"] == "zapier"
        assert made["scopes"] == ["contacts:read"]
        assert made["workspace"] == "acme"
        with httpx.Client(base_url=base_url) as client:
            assert client.get(CONTACTS, headers=bearer(made["key"])).status_code == 200
            assert_problem(
                client.post(CONTACTS, headers=bearer(made["key"]), json={"name": "Ada"}),
                403,
                "insufficient_scope",
            )
            revoke = f"{MANAGEMENT_PATH}/keys/{made['id']}/revoke"
            assert client.post(revoke, headers=bearer(demo_key)).status_code == 200
            assert_problem(client.get(CONTACTS, headers=bearer(made["key"])), 401, "key_revoked")
