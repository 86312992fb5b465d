"""What the Redis store asks of its servers, on private `redis-server` processes.

- `WAIT` is decided at each change from the replicas connected then: a process that started
  while its replica was down waits for it once it is back (the CLI too, each command being
  a process of its own).
- `setup()` refuses a server whose `maxmemory-policy` may evict keys without a TTL, on every
  master, and logs a warning for one without persistence.

Each test starts its own servers on free ports (`tests/redis_servers.py`) and stops them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.errors import ChangeNotConfirmed, ConfigurationError
from apikeys.stores.redis import RedisStore
from apikeys.ui import KeysPage, PageUser
from tests import redis_servers

pytestmark = pytest.mark.redis

PEPPER = "VPMmumKv-fNB5l2vu9Xlw-1j0wycWBvAdotXvbPuGj0"


class Servers:
    """Private Redis servers in a folder of their own; `close()` stops every one."""

    def __init__(self) -> None:
        redis_servers.require_redis_binaries()
        self.root = Path(tempfile.mkdtemp(prefix="apikeys-durability-"))
        self.taken: set[int] = set()
        self.nodes: list[redis_servers.Node] = []

    def node(self, *args: str) -> redis_servers.Node:
        node = redis_servers.Node(self.root, redis_servers.free_port(self.taken), list(args))
        self.nodes.append(node)
        return node

    def replica_of(self, master: redis_servers.Node) -> redis_servers.Node:
        return self.node("--replicaof", "127.0.0.1", str(master.port))

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def servers() -> Iterator[Servers]:
    made = Servers()
    try:
        yield made
    finally:
        made.close()


def url_of(node: redis_servers.Node, query: str = "") -> str:
    return f"redis://127.0.0.1:{node.port}/0{query}"


def wait_calls(node: redis_servers.Node) -> int:
    """How many `WAIT` commands the server has run."""
    stats = redis_servers.info(node.port, "commandstats").get("cmdstat_wait", "calls=0")
    return int(dict(item.split("=", 1) for item in stats.split(","))["calls"])


def wait_replica_in_sync(master: redis_servers.Node) -> None:
    redis_servers.wait_until(
        lambda: redis_servers._replicas_in_sync(master.port), "the replica to sync", timeout=60
    )


def wait_replica_gone(master: redis_servers.Node) -> None:
    redis_servers.wait_until(
        lambda: redis_servers.info(master.port, "replication")["connected_slaves"] == "0",
        "the master to lose its replica",
    )


def apikeys_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, as an operator runs it."""
    env = {**os.environ, "APIKEYS_STORE_URL": url, "APIKEYS_PEPPER": PEPPER}
    return subprocess.run(
        [sys.executable, "-m", "apikeys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- WAIT, decided at each change ---------------------------------------------------------------


async def test_a_process_started_while_the_replica_was_down_waits_for_it_once_it_is_back(
    servers: Servers,
) -> None:
    master = servers.node()
    master.start()
    replica = servers.replica_of(master)  # configured, not running yet
    manager = KeyManager(store_from_url(url_of(master)), hasher=Hasher(pepper=PEPPER))
    try:
        await manager.setup()
        created = await manager.create(name="during the outage", full_access=True)
        assert wait_calls(master) == 0  # no replica connected: nothing to wait for

        replica.start()
        wait_replica_in_sync(master)
        await manager.revoke(created.record.id)
        assert wait_calls(master) >= 1  # the revoke waited for the replica that came back
        # ... and the replica had it when revoke returned.
        stored = redis_servers.cli(
            replica.port, "HGET", f"apikeys:key:{{{created.record.id}}}", "state"
        )
        assert stored.strip() == "revoked"
    finally:
        await manager.aclose()


def test_the_cli_during_a_replica_outage_does_what_the_docs_say(servers: Servers) -> None:
    master = servers.node()
    master.start()
    replica = servers.replica_of(master)
    replica.start()
    wait_replica_in_sync(master)
    auto = url_of(master, "?wait_timeout=0.2")
    strict = url_of(master, "?wait_replicas=1&wait_timeout=0.2")

    made = apikeys_cli(auto, "create", "--name", "ci", "--full-access", "--json")
    assert made.returncode == 0, made.stderr
    key_id = json.loads(made.stdout)["id"]
    assert wait_calls(master) >= 1  # a replica is connected: the create waited for it

    replica.stop()
    wait_replica_gone(master)
    # wait_replicas=1: the change is made on the master, and the command says it was not
    # confirmed (exit 1), never a silent success.
    refused = apikeys_cli(strict, "disable", key_id)
    assert refused.returncode == 1
    assert "committed on the Redis master" in refused.stderr
    assert "0 of 1 replicas" in refused.stderr
    # auto: no replica is connected now, so there is none to wait for (docs/deploying.md).
    before = wait_calls(master)
    done = apikeys_cli(auto, "revoke", key_id, "--yes")
    assert done.returncode == 0, done.stderr
    assert wait_calls(master) == before

    # Back: a new process waits for it again.
    replica.start()
    wait_replica_in_sync(master)
    listed = apikeys_cli(auto, "show", key_id, "--json")
    assert json.loads(listed.stdout)["status"] == "revoked"
    again = apikeys_cli(auto, "create", "--name", "after", "--full-access")
    assert again.returncode == 0, again.stderr
    assert wait_calls(master) > before


# -- maxmemory-policy and persistence, at setup ----------------------------------------------


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
async def test_setup_refuses_a_server_that_evicts_keys_without_a_ttl(
    servers: Servers, policy: str
) -> None:
    node = servers.node("--maxmemory-policy", policy)
    node.start()
    store = store_from_url(url_of(node))
    try:
        with pytest.raises(ConfigurationError, match="maxmemory-policy") as caught:
            await store.setup()
        assert policy in str(caught.value)
        assert "noeviction" in str(caught.value)
        assert "volatile-lru" in str(caught.value)
        with pytest.raises(ConfigurationError, match="maxmemory-policy"):
            async with KeyManager(store_from_url(url_of(node)), hasher=Hasher(pepper=PEPPER)):
                pass  # pragma: no cover
    finally:
        await store.aclose()
    assert redis_servers.cli(node.port, "DBSIZE").strip() == "0"  # nothing written


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru", "volatile-ttl"])
async def test_setup_accepts_a_policy_that_never_evicts_keys_without_a_ttl(
    servers: Servers, policy: str
) -> None:
    node = servers.node("--maxmemory-policy", policy)
    node.start()
    async with KeyManager(store_from_url(url_of(node)), hasher=Hasher(pepper=PEPPER)) as manager:
        created = await manager.create(name="kept", full_access=True)
        assert (await manager.verify(created.key)).id == created.record.id


async def test_setup_reads_the_policy_from_info_where_config_is_renamed(servers: Servers) -> None:
    node = servers.node("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "")
    node.start()
    store = store_from_url(url_of(node))
    try:
        with pytest.raises(ConfigurationError, match="allkeys-lru"):
            await store.setup()
    finally:
        await store.aclose()


async def test_setup_warns_when_neither_config_nor_info_answers(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    node = servers.node("--rename-command", "CONFIG", "", "--rename-command", "INFO", "")
    node.start()
    store = store_from_url(url_of(node))
    try:
        with caplog.at_level(logging.WARNING, logger="apikeys"):
            await store.setup()
    finally:
        await store.aclose()
    assert any("could not read the maxmemory-policy" in r.getMessage() for r in caplog.records)


def test_the_cli_refuses_an_evicting_server_with_a_clear_reason(servers: Servers) -> None:
    node = servers.node("--maxmemory-policy", "allkeys-lru")
    node.start()
    refused = apikeys_cli(url_of(node), "create", "--name", "x", "--full-access")
    assert refused.returncode == 1
    assert "maxmemory-policy allkeys-lru" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert redis_servers.cli(node.port, "DBSIZE").strip() == "0"


async def test_setup_warns_when_the_server_keeps_nothing_across_a_restart(
    servers: Servers, caplog: pytest.LogCaptureFixture
) -> None:
    bare = servers.node()  # --save "" --appendonly no, as tests/redis_servers.py starts them
    kept = servers.node("--appendonly", "yes")
    bare.start()
    kept.start()
    for node, warned in ((bare, True), (kept, False)):
        caplog.clear()
        store = store_from_url(url_of(node))
        try:
            with caplog.at_level(logging.WARNING, logger="apikeys"):
                await store.setup()
        finally:
            await store.aclose()
        said = [r.getMessage() for r in caplog.records if "restart" in r.getMessage()]
        assert bool(said) is warned, said


async def test_setup_checks_every_master_of_a_cluster(
    redis_cluster: redis_servers.LocalCluster,
) -> None:
    victim = redis_cluster.masters()[-1]
    redis_servers.cli(victim.port, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    try:
        store = store_from_url(redis_cluster.url)
        assert isinstance(store, RedisStore)
        try:
            with pytest.raises(ConfigurationError, match=rf"{victim.port}\) has maxmemory-policy"):
                await store.setup()
        finally:
            await store.aclose()
    finally:
        redis_servers.cli(victim.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")


# -- a new key whose replicas did not confirm it ------------------------------------------------


@pytest.fixture
def lonely(servers: Servers) -> str:
    """A master with no replica, asked for one: no change is ever confirmed."""
    node = servers.node()
    node.start()
    return url_of(node, "?wait_replicas=1&wait_timeout=0.05")


async def test_an_explicit_wait_replicas_with_too_few_connected_is_an_error(
    servers: Servers,
) -> None:
    master = servers.node()
    master.start()
    replica = servers.replica_of(master)
    replica.start()
    wait_replica_in_sync(master)
    # Two asked for, one connected: never confirmed, never a silent success. The wait is long
    # enough for the connected one to answer on a busy machine (each change waits it out).
    store = store_from_url(url_of(master, "?wait_replicas=2&wait_timeout=1&socket_timeout=5"))
    async with KeyManager(store, hasher=Hasher(pepper=PEPPER)) as manager:
        created = await manager.create(name="two", full_access=True)
        assert created.confirmed is False
        with pytest.raises(ChangeNotConfirmed, match="1 of 2 replicas"):
            await manager.disable(created.record.id)


async def test_an_unconfirmed_create_still_gives_the_key_once_with_a_warning(
    lonely: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with KeyManager(store_from_url(lonely), hasher=Hasher(pepper=PEPPER)) as manager:
        created = await manager.create(name="unconfirmed", scopes=["contacts:read"])
        assert created.confirmed is False
        assert created.warning is not None
        assert "committed on the Redis master" in created.warning
        assert (await manager.verify(created.key)).id == created.record.id  # it works
        # Shown to this caller only: never in a repr, a log line or the warning.
        assert created.key not in repr(created)
        assert "confirmed=False" in repr(created)
        assert created.key not in created.warning
        assert all(created.key not in record.getMessage() for record in caplog.records)
        assert created.to_dict()["confirmed"] is False
        [listed] = await manager.list()
        assert listed.id == created.record.id


async def test_an_unconfirmed_roll_still_gives_the_new_key_and_ends_the_old_one(
    lonely: str,
) -> None:
    async with KeyManager(store_from_url(lonely), hasher=Hasher(pepper=PEPPER)) as manager:
        old = await manager.create(name="rolled", full_access=True, credits=10)
        rolled = await manager.roll(old.record.id, grace=timedelta(0))
        assert rolled.confirmed is False
        assert rolled.record.replaces == old.record.id
        assert rolled.record.credits == 10  # the balance moved, unconfirmed all the same
        assert (await manager.verify(rolled.key)).id == rolled.record.id
        assert (await manager.get(old.record.id)).replaced_by == rolled.record.id


def test_an_unconfirmed_cli_create_or_roll_prints_the_key_warns_and_exits_0(lonely: str) -> None:
    made = apikeys_cli(lonely, "create", "--name", "ci", "--full-access")
    assert made.returncode == 0, made.stderr
    [key] = made.stdout.split()
    assert "Warning:" in made.stderr
    assert "committed on the Redis master" in made.stderr
    assert key not in made.stderr
    as_json = apikeys_cli(lonely, "create", "--name", "ci2", "--full-access", "--json")
    assert as_json.returncode == 0
    data = json.loads(as_json.stdout)
    assert data["confirmed"] is False
    assert "committed on the Redis master" in data["warning"]
    rolled = apikeys_cli(lonely, "roll", data["id"], "--json")
    assert rolled.returncode == 0, rolled.stderr
    assert json.loads(rolled.stdout)["replaces"] == data["id"]
    assert "Warning:" in rolled.stderr
    shown = apikeys_cli(lonely, "show", data["id"], "--json")
    assert json.loads(shown.stdout)["replaced_by"] == json.loads(rolled.stdout)["id"]


async def _page_user(request: Any) -> PageUser:
    return PageUser("user-1", "Ada", "acme")


async def test_the_settings_page_shows_an_unconfirmed_key_with_a_warning(lonely: str) -> None:
    async with KeyManager(store_from_url(lonely), hasher=Hasher(pepper=PEPPER)) as manager:
        page = KeysPage(manager, user=_page_user, secret_key="test-secret-key-0123456789")
        transport = httpx.ASGITransport(app=page)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            listed = await client.get("/")
            token = re.search(r'name="csrf_token" value="([^"]+)"', listed.text)
            assert token is not None
            form = {"csrf_token": token.group(1), "name": "page", "access": "full"}
            made = await client.post("/", data=form, follow_redirects=True)
            assert made.status_code == 200
            shown = re.search(r'id="new-key-value"[^>]*value="([^"]+)"', made.text)
            assert shown is not None
            assert 'id="unconfirmed-note"' in made.text
            assert "may not survive a failover" in made.text
            [record] = await manager.list()
            assert (await manager.verify(shown.group(1))).id == record.id

            rolled = await client.post(
                f"/{record.id}/roll",
                data={"csrf_token": token.group(1), "grace": "0"},
                follow_redirects=True,
            )
            assert rolled.status_code == 200, rolled.text[:500]
            assert 'id="unconfirmed-note"' in rolled.text


async def test_setup_checks_the_master_sentinel_names(
    redis_sentinel: redis_servers.LocalSentinel,
) -> None:
    port = redis_sentinel.master_port()
    redis_servers.cli(port, "CONFIG", "SET", "maxmemory-policy", "allkeys-lfu")
    try:
        store = store_from_url(redis_sentinel.url)
        try:
            with pytest.raises(ConfigurationError, match="has maxmemory-policy allkeys-lfu"):
                await store.setup()
        finally:
            await store.aclose()
    finally:
        redis_servers.cli(port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
