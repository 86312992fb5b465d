"""The whole customer goes off at once, whoever writes: an identity disabled or revoked under
load refuses every one of its keys in every caching process (CONTRACT sections 3 and 13).

Two uvicorn processes that cache keys (the default) serve a client loop sending requests
with all three keys of an identity; then a writer turns the identity off:

- the command line (`apikeys identities disable|revoke`), in a process of its own;
- a `KeyManager(store, cache=False)` (a job, a back office);
- a writer that is not apikeys: a plain SQL `UPDATE <keys>_identities SET state =
  'disabled'` (sqlite3, asyncpg), or `HSET <prefix>{i:<id>} state disabled` from redis-cli;
  for a revoke, its row deleted (`DELETE`) or its hash (`DEL`).

Once an apikeys writer has returned, no request sent afterwards is admitted; a writer that
is not apikeys cannot wait for the processes, so its change holds once a lease has passed
(`LEASE_WAIT`). What was admitted while the change was under way is printed, never asserted
(it depends on the machine's speed). Enabling the identity again (by apikeys) lets its keys
in at once, except a key revoked on its own meanwhile.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager

import httpx
import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.errors import IdentityNotFound
from tests.test_cache_servers import LEASE_WAIT, Load, cli, each, health, wait_until_fresh
from tests.test_identity_processes import KINDS as ALL_KINDS
from tests.test_identity_processes import Pool, Pools
from tests.test_middleware import assert_problem
from tests.test_multiprocess import TEST_PEPPER, Config
from tests.test_whoever_writes import redis_cli

pytestmark = pytest.mark.slow

# The stores whose processes cache keys, as tests/test_cache_servers.py runs them.
KINDS = [param for param in ALL_KINDS if param.id in ("sqlite", "postgres", "redis")]
# Requests each key must have been sent after the change held, in the loop, before it stops.
SENT_AFTER = 5
WITHIN = 20.0


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    made = Pools(tmp_path_factory.mktemp("identity-writers"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def pool(pools: Pools, kind: str, request: pytest.FixtureRequest) -> Pool:
    return pools.get(kind, request)


@asynccontextmanager
async def job(config: Config) -> AsyncIterator[KeyManager]:
    """A manager that caches nothing, on the servers' store."""
    store = store_from_url(config.store_url, **config.store_options)
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), cache=False) as manager:
        yield manager


async def by_cli(config: Config, *args: str) -> None:
    done = await asyncio.to_thread(cli, config, "identities", *args)
    assert done.returncode == 0, done.stderr


async def by_hand(config: Config, identity: str, verb: str) -> None:
    """What sqlite3, psql or redis-cli would do, no apikeys code at all: `disable` is
    `UPDATE <keys>_identities SET state = 'disabled'` or `HSET <prefix>{i:<id>} state
    disabled`; `revoke` deletes the identity's row or hash (its keys are then refused as
    revoked, as of an identity that is gone)."""
    assert verb in ("disable", "revoke")
    if config.kind == "sqlite":
        path = config.store_url.removeprefix("sqlite:///")
        sql = {
            "disable": "UPDATE apikeys_keys_identities SET state = 'disabled' WHERE id = ?",
            "revoke": "DELETE FROM apikeys_keys_identities WHERE id = ?",
        }[verb]
        with sqlite3.connect(path) as connection:
            connection.execute(sql, (identity,))
    elif config.kind == "postgres":
        import asyncpg

        table = f"{config.store_options['table_name']}_identities"
        sql = {
            "disable": f"UPDATE \"{table}\" SET state = 'disabled' WHERE id = $1",  # noqa: S608
            "revoke": f'DELETE FROM "{table}" WHERE id = $1',  # noqa: S608
        }[verb]
        connection = await asyncpg.connect(config.store_url)
        try:
            await connection.execute(sql, identity)
        finally:
            await connection.close()
    else:
        name = f"{config.store_options['key_prefix']}{{i:{identity}}}"
        if verb == "disable":
            redis_cli(config.store_url, "HSET", name, "state", "disabled")
        else:
            redis_cli(config.store_url, "DEL", name)


async def change(config: Config, identity: str, writer: str, verb: str) -> None:
    """`verb` (disable, enable, revoke) the identity by `writer`."""
    if writer == "cli":
        await by_cli(config, verb, identity, *(["--yes"] if verb == "revoke" else []))
    elif writer == "job":
        async with job(config) as manager:
            await getattr(manager, f"{verb}_identity")(identity)
    else:
        await by_hand(config, identity, verb)


async def identity_with_keys(config: Config) -> tuple[str, list[str], list[str]]:
    """A new identity with three keys: its id, the keys' ids and their secrets."""
    identity = f"acme-{uuid.uuid4().hex[:8]}"
    async with config.manager() as manager:
        await manager.create_identity(identity, workspace="mp")
        made = [
            await manager.create(
                name=f"{identity}-{n}", workspace="mp", scopes=["contacts:read"], identity=identity
            )
            for n in range(3)
        ]
    return identity, [one.record.id for one in made], [one.key for one in made]


async def served(urls: Sequence[str], tokens: Sequence[str]) -> None:
    """Every process has proven its cache fresh and served every token from it."""
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens:  # a process's cache starts with its first request
            assert [a.status_code for a in await each(client, urls, token)] == [200, 200]
        await wait_until_fresh(urls)
        before = [(await health(client, url))["cache"]["hits"] for url in urls]  # type: ignore[index]
        deadline = time.monotonic() + WITHIN
        while time.monotonic() < deadline:
            for token in tokens:
                assert [a.status_code for a in await each(client, urls, token)] == [200, 200]
            after = [(await health(client, url))["cache"]["hits"] for url in urls]  # type: ignore[index]
            if all(now - then >= len(tokens) for then, now in zip(before, after, strict=True)):
                return
            await asyncio.sleep(0.05)
    pytest.fail("the caches did not serve the keys")


async def sent_after(load: Load, moment: float, tokens: Sequence[str]) -> None:
    """Until the loop has sent `SENT_AFTER` requests with each token after `moment`."""
    deadline = time.monotonic() + WITHIN
    while time.monotonic() < deadline:
        sent = [sum(s.token == t and s.sent_at > moment for s in load.sent) for t in tokens]
        if min(sent) >= SENT_AFTER:
            return
        await asyncio.sleep(0.02)
    pytest.fail("the load stopped sending")


async def off_under_load(pool: Pool, writer: str, verb: str) -> tuple[str, list[str], list[str]]:
    """Turn a new identity off by `writer` while every process serves its three keys: no
    request sent once the change holds is admitted. Its id, its keys' ids and secrets."""
    identity, ids, tokens = await identity_with_keys(pool.config)
    await served(pool.urls, tokens)
    load = Load(pool.urls, tokens)
    load.start()
    try:
        await sent_after(load, time.monotonic(), tokens)
        began = time.monotonic()
        await change(pool.config, identity, writer, verb)
        returned = time.monotonic()
        # A writer that is not apikeys waits for nobody: every proof older than its change
        # has run out a lease later.
        held = returned + (LEASE_WAIT if writer == "by_hand" else 0.0)
        await sent_after(load, held, tokens)
    finally:
        await load.stop()
    during = [s for s in load.sent if began < s.sent_at <= held and s.status == 200]
    print(
        f"{pool.config.kind}, {verb} by {writer}: {len(during)} admitted while the change was "
        f"under way ({returned - began:.2f} s to return)"
    )
    after = [s.status for s in load.sent if s.sent_at > held]
    assert after.count(200) == 0, f"{after.count(200)} admitted after the change held"
    assert set(after) == {401}, sorted(set(after))
    code = "key_revoked" if verb == "revoke" else "key_disabled"
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens:
            for answer in await each(client, pool.urls, token):
                assert_problem(answer, 401, code)
    return identity, ids, tokens


@pytest.mark.parametrize("writer", ["cli", "job", "by_hand"])
@pytest.mark.parametrize("kind", KINDS)
async def test_if_an_identity_is_disabled_by_any_writer_then_no_key_of_it_is_admitted_until_enabled(
    pool: Pool, writer: str
) -> None:
    identity, ids, tokens = await off_under_load(pool, writer, "disable")
    # A key revoked on its own while its identity is off stays revoked when it comes back.
    async with pool.config.manager() as manager:
        await manager.revoke(ids[0])
    await change(pool.config, identity, "job" if writer == "by_hand" else writer, "enable")
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens[1:]:
            assert [a.status_code for a in await each(client, pool.urls, token)] == [200, 200]
        for answer in await each(client, pool.urls, tokens[0]):
            assert_problem(answer, 401, "key_revoked")


@pytest.mark.parametrize("writer", ["cli", "job", "by_hand"])
@pytest.mark.parametrize("kind", KINDS)
async def test_if_an_identity_is_revoked_or_deleted_then_no_key_of_it_is_admitted_anywhere(
    pool: Pool, writer: str
) -> None:
    identity, _, _ = await off_under_load(pool, writer, "revoke")
    async with job(pool.config) as manager:
        if writer == "by_hand":
            with pytest.raises(IdentityNotFound):
                await manager.get_identity(identity)
        else:
            assert (await manager.get_identity(identity)).state == "revoked"


async def refused_everywhere(urls: Sequence[str], tokens: Sequence[str], code: str) -> None:
    """The next request with each token is refused with `code` by every process."""
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens:
            for answer in await each(client, urls, token):
                assert_problem(answer, 429, code)


@pytest.mark.parametrize("writer", ["cli", "job"])
@pytest.mark.parametrize("kind", KINDS)
async def test_if_an_identitys_credits_are_lowered_then_the_next_request_of_each_key_sees_it(
    pool: Pool, writer: str
) -> None:
    """An identity without credits (cached as unlimited by every process) is given none
    left: once the writer returns, the next request with any of its keys, in any process,
    is refused; nothing cached lets one through."""
    identity, _, tokens = await identity_with_keys(pool.config)
    await served(pool.urls, tokens)
    if writer == "cli":
        await by_cli(pool.config, "update", identity, "--credits", "0")
    else:
        async with job(pool.config) as manager:
            await manager.update_identity(identity, credits=0)
    await refused_everywhere(pool.urls, tokens, "credits_exhausted")


@pytest.mark.parametrize("kind", KINDS)
async def test_if_a_key_is_moved_into_an_identity_then_the_next_request_is_charged_to_it(
    pool: Pool,
) -> None:
    """A key every process caches on its own is moved into an identity with no credits left
    by a job: its next request, in any process, is the identity's, and refused."""
    identity, _, _ = await identity_with_keys(pool.config)
    async with pool.config.manager() as manager:
        await manager.update_identity(identity, credits=0)
        alone = await manager.create(name="alone", workspace="mp", scopes=["contacts:read"])
    await served(pool.urls, [alone.key])
    async with job(pool.config) as manager:
        await manager.update(alone.record.id, identity=identity)
    await refused_everywhere(pool.urls, [alone.key], "credits_exhausted")
