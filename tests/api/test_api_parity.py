"""A change made through the management API is the change the command line makes: the same
sequence of changes (create, update, roll, disable, enable and revoke a key; create,
update, disable, enable and revoke an identity), once with `apikeys …` in workspace `cli`
and once through the API in workspace `api`, on one SQLite store, leaves the same audit
events (the API's with the calling key as actor) and the same webhook events, body for
body (read from the store's outbox: no network), ids, times and actors aside. And a key
the API revokes is refused at once by another manager that held it in its cache."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.api import ManagementAPI
from apikeys.errors import KeyRevoked
from apikeys.types import utcnow
from apikeys.webhooks.admin import add_endpoint
from tests.test_cli import ok

pytestmark = pytest.mark.sqlite

PEPPER = "Yq3vT8rW1zB6nK0pL5mX9cD2fG7hJ4sA-uE_iO8tR3w"
CALLER_SCOPES = ["apikeys:read", "apikeys:write", "apikeys:admin", "contacts:read"]
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)


def cli_json(store_url: str, *args: str) -> Any:
    return json.loads(ok(store_url, *args, "--json").stdout)


def through_the_cli(store_url: str) -> None:
    made = cli_json(
        store_url, "create", "--name", "Zapier", "--workspace", "cli", "--scope", "contacts:read"
    )
    ok(store_url, "update", made["id"], "--name", "Zapier (CI)")
    rolled = cli_json(store_url, "roll", made["id"], "--grace", "1h")
    for verb in ("disable", "enable"):
        ok(store_url, verb, rolled["id"])
    ok(store_url, "revoke", rolled["id"], "--yes")
    ok(store_url, "identities", "create", "cust-7", "--workspace", "cli", "--name", "Cust")
    ok(store_url, "identities", "update", "cust-7", "--name", "Customer")
    for verb in ("disable", "enable"):
        ok(store_url, "identities", verb, "cust-7")
    ok(store_url, "identities", "revoke", "cust-7", "--yes")


async def through_the_api(manager: KeyManager) -> str:
    """The same changes, through the API; the calling key's id."""
    caller = await manager.create(name="ops", workspace="api", scopes=CALLER_SCOPES)
    api = ManagementAPI(manager, rate_limit="100000/minute")
    headers = {"Authorization": f"Bearer {caller.key}"}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=api), base_url="http://test", headers=headers
    ) as client:

        async def call(method: str, path: str, body: Any = None) -> Any:
            answer = await client.request(method, path, json=body)
            assert answer.status_code in (200, 201), answer.text
            return answer.json()

        made = await call("POST", "/keys", {"name": "Zapier", "scopes": ["contacts:read"]})
        await call("PATCH", f"/keys/{made['id']}", {"name": "Zapier (CI)"})
        rolled = await call("POST", f"/keys/{made['id']}/roll", {"grace_seconds": 3600})
        for verb in ("disable", "enable", "revoke"):
            await call("POST", f"/keys/{rolled['id']}/{verb}")
        identity = await call("POST", "/identities", {"name": "Cust"})
        await call("PATCH", f"/identities/{identity['id']}", {"name": "Customer"})
        for verb in ("disable", "enable", "revoke"):
            await call("POST", f"/identities/{identity['id']}/{verb}")
    return caller.record.id


class Names:
    """Ids, times and key prefixes as placeholders in order of first sight, so that two
    runs of the same changes compare equal."""

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self.seen: dict[str, str] = {}

    def of(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: self.of(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.of(item) for item in value]
        if not isinstance(value, str):
            return value
        if value == self.workspace:
            return "<workspace>"
        if _TIME.fullmatch(value):
            return "<time>"
        for known, name in self.seen.items():
            value = value.replace(known, name)
        return value

    def learn(self, value: str) -> None:
        if value not in self.seen:
            self.seen[value] = f"<id{len(self.seen)}>"


def audit_of(events: list[Any], workspace: str, skip: str | None) -> tuple[list[Any], Names]:
    """The events of `workspace` but those about `skip` (the calling key), ids and times
    as placeholders, with the actors apart; and the placeholders, named in change order."""
    names = Names(workspace)
    shown = []
    for event in events:
        if event.workspace != workspace or event.key_id == skip:
            continue
        names.learn(event.identity or event.key_id)
        changes = names.of(dict(event.changes))
        shown.append((event.action, names.of(event.key_id), changes, event.actor))
    return shown, names


async def outbox(store_url: str) -> dict[str, list[dict[str, Any]]]:
    """Every webhook body the store holds, by the workspace it is about, in the order of
    their deliveries: taken from the outbox as a deliverer would, and marked delivered."""
    store = store_from_url(store_url)
    await store.setup()
    hooks = store.webhooks()
    assert hooks is not None
    bodies: dict[str, list[dict[str, Any]]] = {}
    try:
        while await hooks.take(utcnow()):
            pass
        while True:
            now = utcnow()
            claimed = await hooks.claim("parity", now, now + timedelta(minutes=5), 100)
            if not claimed:
                return bodies
            for one in claimed:
                body = json.loads(one.body)
                subject = body["data"].get("key") or body["data"]["identity"]
                bodies.setdefault(subject["workspace"], []).append(body)
                await hooks.finish(
                    one.id,
                    "parity",
                    now=now,
                    status="delivered",
                    next_attempt_at=now,
                    response=200,
                    error=None,
                )
    finally:
        await store.aclose()


def webhooks_of(bodies: list[dict[str, Any]], names: Names) -> dict[str, list[Any]]:
    """The bodies about each subject but the calling key, in the order they are delivered
    (in order per subject), with the audit trail's placeholders; no other subject."""
    shown: dict[str, list[Any]] = {}
    for body in bodies:
        subject = body["data"].get("key") or body["data"]["identity"]
        if subject["id"] in names.seen:
            shown.setdefault(names.seen[subject["id"]], []).append(names.of(body))
        else:
            assert subject["name"] == "ops", subject  # the calling key
    return shown


def test_a_change_through_the_api_is_the_change_the_cli_makes(tmp_path: Path) -> None:
    store_url = f"sqlite:///{tmp_path / 'keys.db'}"

    async def endpoint() -> None:
        async with KeyManager(store_url, hasher=Hasher(pepper=PEPPER)) as manager:
            hooks = manager.store.webhooks()
            assert hooks is not None
            await add_endpoint(hooks, "http://127.0.0.1:9/hooks", allow_private=True)

    asyncio.run(endpoint())
    through_the_cli(store_url)

    async def api_side() -> tuple[str, list[Any]]:
        async with KeyManager(store_url, hasher=Hasher(pepper=PEPPER)) as manager:
            caller_id = await through_the_api(manager)
            return caller_id, await manager.audit(limit=1000)

    caller_id, events = asyncio.run(api_side())
    cli_audit, cli_names = audit_of(events, "cli", None)
    api_audit, api_names = audit_of(events, "api", caller_id)
    assert [action for action, *_ in api_audit] == [
        "created",
        "updated",
        "created",
        "rolled",
        "disabled",
        "enabled",
        "revoked",
        "identity.created",
        "identity.updated",
        "identity.disabled",
        "identity.enabled",
        "identity.revoked",
    ]
    assert [event[:3] for event in api_audit] == [event[:3] for event in cli_audit]
    assert {event[3] for event in api_audit} == {f"key:{caller_id}"}
    cli_actors = {event[3] for event in cli_audit}
    assert len(cli_actors) == 1
    assert next(iter(cli_actors)).startswith("cli:")

    bodies = asyncio.run(outbox(store_url))
    cli_hooks = webhooks_of(bodies["cli"], cli_names)
    api_hooks = webhooks_of(bodies["api"], api_names)
    assert sum(map(len, api_hooks.values())) == len(api_audit)
    assert api_hooks == cli_hooks
    assert [body["type"] for body in api_hooks["<id0>"]] == [
        "key.created",
        "key.updated",
        "key.rolled",
    ]


async def test_a_key_the_api_revokes_is_refused_at_once_by_a_manager_that_cached_it(
    tmp_path: Path,
) -> None:
    store_url = f"sqlite:///{tmp_path / 'keys.db'}"
    hasher = Hasher(pepper=PEPPER)
    async with (
        KeyManager(store_url, hasher=hasher) as writer,
        KeyManager(store_url, hasher=hasher) as reader,
    ):
        await writer.setup()
        caller = await writer.create(name="ops", workspace="acme", scopes=CALLER_SCOPES)
        target = await writer.create(name="t", workspace="acme", scopes=["contacts:read"])
        assert (await reader.verify(target.key)).id == target.record.id  # now in its cache
        api = ManagementAPI(writer)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=api), base_url="http://test"
        ) as client:
            answer = await client.post(
                f"/keys/{target.record.id}/revoke",
                headers={"Authorization": f"Bearer {caller.key}"},
            )
        assert answer.status_code == 200, answer.text
        with pytest.raises(KeyRevoked):
            await reader.verify(target.key)
