"""A replay never takes a delivery from the process sending it: while its lease is held, a
replay is refused (`DeliveryInProgress`) and changes nothing, so no two processes send one
delivery at once; a lease that ran out is cleared, and its late holder records nothing."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from apikeys import DeliveryInProgress, Hasher, KeyManager
from apikeys.cli import main
from apikeys.stores import KeyStore
from apikeys.stores.contract import WebhookStore
from apikeys.types import utcnow
from apikeys.ui import KeysPage, PageUser
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.model import Delivery

PEPPER = "yaNVDK-deq21qfKBkzb_MZganU3GTxnBp4XtjrGqnuE"


@pytest.fixture
async def manager(store: KeyStore) -> AsyncIterator[KeyManager]:
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER), webhooks=False) as made:
        yield made


async def one_delivery(manager: KeyManager, workspace: str = "default") -> WebhookStore:
    """An endpoint of `workspace`'s `key.created` events, and one delivery for it."""
    hooks = manager.store.webhooks()
    assert hooks is not None
    await add_endpoint(
        hooks,
        "http://127.0.0.1:9/hooks",
        events=["key.created"],
        workspace=workspace,
        hasher=manager.hasher,
    )
    await manager.create(name="a", workspace=workspace, full_access=True)
    assert await hooks.take(utcnow()) == 1
    return hooks


async def the_delivery(hooks: WebhookStore) -> Delivery:
    (delivery,) = await hooks.deliveries()
    return delivery


async def finish(hooks: WebhookStore, delivery_id: str, holder: str) -> None:
    now = utcnow()
    await hooks.finish(
        delivery_id,
        holder,
        now=now,
        status="delivered",
        next_attempt_at=now,
        response=200,
        error=None,
    )


async def test_a_replay_of_a_delivery_being_sent_is_refused_and_its_sender_finishes_it(
    manager: KeyManager,
) -> None:
    hooks = await one_delivery(manager)
    now = utcnow()
    (sending,) = await hooks.claim("sender", now, now + timedelta(minutes=1), 10)
    before = await the_delivery(hooks)
    with pytest.raises(DeliveryInProgress, match="being sent now") as refused:
        await hooks.replay(sending.id, utcnow())
    assert refused.value.delivery_id == sending.id
    assert await the_delivery(hooks) == before
    # Nobody else may send it meanwhile, and its sender's attempt is recorded.
    assert await hooks.claim("other", utcnow(), utcnow() + timedelta(minutes=1), 10) == []
    await finish(hooks, sending.id, "sender")
    sent = await the_delivery(hooks)
    assert (sent.status, sent.attempts, sent.last_status) == ("delivered", 1, 200)
    # Once that attempt has ended, a replay sends it again, by whoever claims it.
    assert await hooks.replay(sending.id, utcnow())
    assert (await the_delivery(hooks)).status == "pending"
    (again,) = await hooks.claim("other", utcnow(), utcnow() + timedelta(minutes=1), 10)
    assert again.id == sending.id
    assert again.body == sending.body


async def test_a_replay_clears_a_lease_that_ran_out_and_its_late_holder_records_nothing(
    manager: KeyManager,
) -> None:
    hooks = await one_delivery(manager)
    now = utcnow()
    (claimed,) = await hooks.claim("gone", now, now + timedelta(milliseconds=1), 10)
    await asyncio.sleep(0.05)  # the lease's millisecond is over (on Redis, too: PX)
    assert await hooks.replay(claimed.id, utcnow())
    await finish(hooks, claimed.id, "gone")  # the holder it was taken from, too late
    assert (await the_delivery(hooks)).attempts == 0
    (again,) = await hooks.claim("other", utcnow(), utcnow() + timedelta(minutes=1), 10)
    await finish(hooks, again.id, "other")
    sent = await the_delivery(hooks)
    assert (sent.status, sent.attempts) == ("delivered", 1)


def test_the_command_line_refuses_a_replay_of_a_delivery_being_sent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'keys.db'}"

    async def prepare() -> str:
        async with KeyManager(url, hasher=Hasher(pepper=PEPPER), webhooks=False) as made:
            hooks = await one_delivery(made)
            now = utcnow()
            (claimed,) = await hooks.claim("sender", now, now + timedelta(minutes=1), 10)
            return claimed.id

    delivery_id = asyncio.run(prepare())
    result = CliRunner().invoke(main, ["--store", url, "webhooks", "replay", delivery_id])
    assert result.exit_code == 1, result.output
    assert "being sent now" in result.output
    listed = CliRunner().invoke(main, ["--store", url, "webhooks", "deliveries", "--json"])
    (delivery,) = json.loads(listed.output)
    assert (delivery["status"], delivery["attempts"]) == ("pending", 0)


async def test_the_settings_page_says_a_delivery_being_sent_cannot_be_replayed_yet(
    manager: KeyManager,
) -> None:
    hooks = await one_delivery(manager, workspace="acme")
    now = utcnow()
    (claimed,) = await hooks.claim("sender", now, now + timedelta(minutes=1), 10)
    before = await the_delivery(hooks)

    async def user(request: object) -> PageUser:
        return PageUser("user-acme", "acme", "acme")

    page = KeysPage(manager, user=user, secret_key="test-secret-key-0123456789")
    transport = httpx.ASGITransport(app=page)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        listed = await client.get("/webhooks")
        found = re.search(r'name="csrf_token" value="([^"]+)"', listed.text)
        assert found is not None
        answer = await client.post(
            f"/webhooks/{claimed.id}/replay",
            data={"csrf_token": found.group(1)},
            follow_redirects=True,
        )
    assert answer.status_code == 200
    assert "is being sent now: try again in a minute" in answer.text
    assert await the_delivery(hooks) == before
