"""Webhooks end to end: a receiver started here gets every event, in order, signed.

The changes are made by `apikeys` commands in processes of their own, the last one by a
process killed right after its change committed; another process delivers; the receiver
is down while the changes are made, and comes up afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook

from tests import services
from tests.conftest import _create_database, _drop_database
from tests.pgbouncer import free_port
from tests.webhooks.receiver import Receiver

PEPPER = "pre-7bqNiAHpdWl2BEmn0e07UD12aNp3DKVUPSEv904"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["sqlite", "postgres", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'keys.db'}"
        return
    if request.param == "redis":
        prefix = request.getfixturevalue("redis_key_prefix")  # its keys deleted at the end
        yield f"{request.getfixturevalue('redis_url')}?key_prefix={prefix}"
        return
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    name = f"apikeys_wh_{uuid.uuid4().hex[:12]}"
    asyncio.run(_create_database(services.POSTGRES_URL, name))
    try:
        yield f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        asyncio.run(_drop_database(services.POSTGRES_URL, name))


def _env(url: str) -> dict[str, str]:
    return {**os.environ, "APIKEYS_STORE_URL": url, "APIKEYS_PEPPER": PEPPER}


async def cli(url: str, *args: str) -> str:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "apikeys",
        *args,
        env=_env(url),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode()


# Revokes a key, then kills its own process at once: no exit handler, no flush, no goodbye.
_KILLED_WRITER = """
import asyncio, os, signal, sys
from apikeys import KeyManager

async def main():
    manager = KeyManager(sys.argv[1], webhooks=False)
    await manager.revoke(sys.argv[2])
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


@pytest.fixture
async def deliverer(url: str) -> AsyncIterator[asyncio.subprocess.Process]:
    await cli(url, "list")  # the tables exist before the deliverer starts
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.webhooks.deliverer",
        url,
        env=_env(url),
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        assert (await process.stdout.readline()).strip() == b"ready"
        yield process
    finally:
        process.terminate()
        await process.wait()


def _events(receiver: Receiver, secret: str) -> list[dict[str, Any]]:
    verifier = Webhook(secret)
    return [verifier.verify(item.body, item.headers) for item in receiver.received]


# The receiver down (tries again, later events behind the first) on every store; up on one:
# sending at once does not depend on the store.
@pytest.mark.parametrize(
    ("url", "down"),
    [
        pytest.param("sqlite", True, id="sqlite-receiver-down"),
        pytest.param("postgres", True, id="postgres-receiver-down"),
        pytest.param("redis", True, id="redis-receiver-down"),
        pytest.param("sqlite", False, id="sqlite-receiver-up"),
    ],
    indirect=["url"],
)
async def test_a_receiver_gets_every_event_in_order_with_valid_signatures(
    url: str, deliverer: asyncio.subprocess.Process, down: bool
) -> None:
    receiver = Receiver(free_port())
    added = json.loads(await cli(url, "webhooks", "add", receiver.url, "--json"))
    assert added["secret"].startswith("whsec_")
    if not down:
        await receiver.start()
    try:
        created = json.loads(
            await cli(url, "create", "--name", "zapier", "--full-access", "--json")
        )
        key_id = created["id"]
        await cli(url, "update", key_id, "--name", "zapier-eu")
        await cli(url, "disable", key_id)
        await cli(url, "enable", key_id)
        rolled = json.loads(await cli(url, "roll", key_id, "--json"))
        new_id = rolled["record"]["id"] if "record" in rolled else rolled["id"]
        writer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _KILLED_WRITER, url, key_id, env=_env(url), cwd=ROOT
        )
        assert await writer.wait() == -9
        if down:
            # The deliverer tried (and tried again) while the receiver was down; the later
            # events of a key wait behind its first.
            async with asyncio.timeout(30):
                while True:
                    listed = json.loads(await cli(url, "webhooks", "deliveries", "--json"))
                    if len(listed) == 7 and max(d["attempts"] for d in listed) >= 2:
                        break
                    await asyncio.sleep(0.2)
            assert {d["status"] for d in listed} == {"pending"}
            assert {d["last_error"] for d in listed if d["attempts"]} == {"ConnectError"}
            assert receiver.received == []
            await receiver.start()
        async with asyncio.timeout(60):
            await receiver.wait_for(7)
        await asyncio.sleep(0.5)  # nothing more comes
    finally:
        await receiver.stop()

    events = _events(receiver, added["secret"])
    assert len(events) == 7
    of_key = [
        (e["type"], e["data"]["key"]["id"]) for e in events if e["data"]["key"]["id"] == key_id
    ]
    assert [kind for kind, _ in of_key] == [
        "key.created",
        "key.updated",
        "key.disabled",
        "key.enabled",
        "key.rolled",
        "key.revoked",
    ]
    records = [e["data"]["key"] for e in events if e["data"]["key"]["id"] == key_id]
    assert [r["name"] for r in records] == ["zapier"] + ["zapier-eu"] * 5
    assert [r["status"] for r in records] == [
        "active",
        "active",
        "disabled",
        "active",
        "active",
        "revoked",
    ]
    assert records[4]["replaced_by"] == new_id
    successor = [e for e in events if e["data"]["key"]["id"] == new_id]
    assert [e["type"] for e in successor] == ["key.created"]
    assert successor[0]["data"]["key"]["replaces"] == key_id
    # Never a secret or a hash in a body.
    for item in receiver.received:
        assert b"secret_hash" not in item.body
        assert created["key"].encode() not in item.body
        assert rolled["key"].encode() not in item.body
    listed = json.loads(await cli(url, "webhooks", "deliveries", "--json"))
    assert len(listed) == 7
    assert {d["status"] for d in listed} == {"delivered"}
