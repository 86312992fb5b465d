"""The SQL store on PostgreSQL behind PgBouncer (Debian's `pgbouncer`, started by the tests).

- Transaction mode, with `?prepared_statements=false` in the URL, and session mode, with
  the defaults: every store conformance behaviour holds.
- What goes wrong behind a pooler (prepared statements left on in transaction mode, a pooler
  that refuses clients, cannot reach its server, or loses a server connection mid-statement)
  raises `StoreUnavailable` with a hint that says what to do, never the driver's error.
- The key cache in front of the store, in both modes: keys verify, and a revoked key is
  refused by every manager from the next request on.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest

from apikeys import Hasher, KeyManager, store_from_url
from apikeys.errors import KeyRevoked, StoreUnavailable
from apikeys.stores import KeyStore
from apikeys.types import StoredKey
from tests import services
from tests.conftest import TEST_PEPPER
from tests.pgbouncer import PgBouncer, free_port
from tests.stores import test_store_conformance as conformance
from tests.stores.test_store_conformance import T0

pytestmark = pytest.mark.postgres

NO_PREPARED = "prepared_statements=false"


def unique_table() -> str:
    return f"apikeys_pgb_{uuid.uuid4().hex[:10]}"


def with_query(url: str, query: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}{query}"


@pytest.fixture(params=["transaction", "session"])
def bouncer_url(request: pytest.FixtureRequest, postgres_url: str) -> str:
    """The session's database through PgBouncer: in transaction mode with prepared
    statements off (what docs/stores.md says to do), in session mode as it is."""
    if request.param == "transaction":
        bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
        return with_query(bouncer.via(postgres_url), NO_PREPARED)
    bouncer = request.getfixturevalue("pgbouncer_session")
    return bouncer.via(postgres_url)


@pytest.fixture
async def store(bouncer_url: str) -> AsyncIterator[KeyStore]:
    """Overrides the suite's `store`: the conformance classes below run through PgBouncer."""
    key_store = store_from_url(bouncer_url, table_name=unique_table())
    await key_store.setup()
    try:
        yield key_store
    finally:
        await key_store.aclose()


# --- every store behaviour, through PgBouncer ---------------------------------------------


class TestInsertAndGetThroughPgBouncer(conformance.TestInsertAndGet):
    pass


class TestListThroughPgBouncer(conformance.TestList):
    pass


class TestSetStateThroughPgBouncer(conformance.TestSetState):
    pass


class TestShortenExpiryThroughPgBouncer(conformance.TestShortenExpiry):
    pass


class TestReplaceHashThroughPgBouncer(conformance.TestReplaceHash):
    pass


class TestAddUsageThroughPgBouncer(conformance.TestAddUsage):
    pass


class TestAddUsageBatchIdsThroughPgBouncer(conformance.TestAddUsageBatchIds):
    pass


class TestUsageBatchRetentionThroughPgBouncer(conformance.TestUsageBatchRetention):
    pass


async def test_if_many_reads_and_writes_interleave_in_transaction_mode_then_all_succeed(
    pgbouncer: PgBouncer, postgres_url: str
) -> None:
    # More concurrent statements than the store has connections, and more client
    # connections than PgBouncer has server connections: each transaction lands on
    # whichever server connection is free.
    url = with_query(pgbouncer.via(postgres_url), f"{NO_PREPARED}&pool_size=4&max_overflow=4")
    stores = [store_from_url(url, table_name=unique_table()) for _ in range(3)]
    try:
        for key_store in stores:
            await key_store.setup()
        keys = [conformance.make_key() for _ in range(30)]

        async def work(key_store: KeyStore, key: StoredKey) -> None:
            await key_store.insert(key)
            assert await key_store.get(key.record.id) is not None
            await key_store.set_state(key.record.id, "disabled", allowed_from={"active"}, at=T0)
            assert len(await key_store.list()) >= 1

        await asyncio.gather(*(work(s, k) for s in stores for k in keys))
        for key_store in stores:
            records = await key_store.list()
            assert {r.id for r in records} == {k.record.id for k in keys}
            assert {r.state for r in records} == {"disabled"}
    finally:
        for key_store in stores:
            await key_store.aclose()


# --- errors behind a pooler ---------------------------------------------------------------


@pytest.fixture
def small_bouncer() -> Iterator[PgBouncer]:
    """A PgBouncer in transaction mode of the test's own, with two server connections per
    database at most (it lends the one used last first)."""
    with PgBouncer(settings={"default_pool_size": 2, "max_client_conn": 20}) as bouncer:
        yield bouncer


@pytest.fixture
async def admin() -> AsyncIterator[asyncpg.Connection]:
    """A connection straight to the PostgreSQL server, past PgBouncer."""
    connection = await asyncpg.connect(services.POSTGRES_URL)
    try:
        yield connection
    finally:
        await connection.close()


async def test_if_prepared_statements_are_left_on_in_transaction_mode_then_store_unavailable(
    small_bouncer: PgBouncer, postgres_url: str
) -> None:
    # The store prepares and keeps its statements on the server connection PgBouncer lends
    # it; the next time, PgBouncer lends it another one (the first is busy with another
    # client), where they do not exist: `prepared statement "__asyncpg_stmt_…__" does not
    # exist`.
    url = small_bouncer.via(postgres_url)
    key_store = store_from_url(with_query(url, "pool_size=1"), table_name=unique_table())
    other = await asyncpg.connect(url)
    try:
        await key_store.setup()
        await key_store.list()  # prepared on the one server connection there is
        async with other.transaction():
            await other.execute("SELECT 1")  # ... which this transaction now holds
            with pytest.raises(StoreUnavailable) as caught:
                await key_store.list()
    finally:
        await other.close()
        await key_store.aclose()
    error = caught.value
    assert "does not exist" in str(error.original)
    assert error.hint is not None
    assert "?prepared_statements=false" in error.hint
    assert "prepared_statements=false" in str(error)


@pytest.fixture
async def taken_statement_names(small_bouncer: PgBouncer, postgres_url: str) -> AsyncIterator[str]:
    """The server connection used last already holds asyncpg's first statement names, prepared
    by another client (as another process's statements stay on a server connection that
    PgBouncer then lends to the next client). Yields the URL of the session's database
    through that PgBouncer: a new process that prepares statements there collides."""
    url = small_bouncer.via(postgres_url)
    other = await asyncpg.connect(url)
    try:
        # Kept referenced: asyncpg closes a prepared statement it no longer holds.
        statements = [
            await other.prepare("SELECT 1", name=f"__asyncpg_stmt_{number:x}__")
            for number in range(1, 257)
        ]
        # asyncpg ends a prepare with Flush, not Sync: until a statement completes, PgBouncer
        # keeps the server connection linked to this client.
        await other.execute("SELECT 1")
        yield url
        del statements
    finally:
        await other.close()


def run_cli(url: str, *args: str, table: str | None = None) -> tuple[int, str]:
    """`apikeys --store URL ARGS…` in a process of its own (asyncpg numbers its statements
    per process, from 1), on the keys table `table` (the default one when None)."""
    options = json.dumps({"table_name": table} if table else {})
    result = subprocess.run(
        [sys.executable, "-m", "tests.cli_with_options", "--store", url, *args],
        env={**os.environ, "APIKEYS_PEPPER": TEST_PEPPER, "APIKEYS_TEST_STORE_OPTIONS": options},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.returncode, result.stdout + result.stderr


async def test_if_prepared_statements_are_left_on_then_the_cli_says_what_to_do_in_one_line(
    taken_statement_names: str,
) -> None:
    # `prepared statement "__asyncpg_stmt_1__" already exists`, in the CLI's own process.
    code, output = await asyncio.to_thread(run_cli, taken_statement_names, "list")
    assert code == 1, output
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert lines[0].startswith("Error: key store unavailable: ")
    assert "already exists" in lines[0]
    assert "?prepared_statements=false" in lines[0]


async def test_if_prepared_statements_are_off_then_taken_statement_names_do_not_matter(
    taken_statement_names: str,
) -> None:
    url = with_query(taken_statement_names, NO_PREPARED)
    code, output = await asyncio.to_thread(run_cli, url, "list")
    assert code == 0, output
    key_store = store_from_url(url, table_name=unique_table())
    try:
        await key_store.setup()
        key = await conformance.inserted(key_store)
        assert (await conformance.record_of(key_store, key.id)) == key
        assert [r.id for r in await key_store.list()] == [key.id]
    finally:
        await key_store.aclose()


def test_the_cli_works_through_transaction_mode_with_the_url_options(
    pgbouncer: PgBouncer, postgres_url: str
) -> None:
    url = with_query(pgbouncer.via(postgres_url), f"{NO_PREPARED}&pool_size=1&max_overflow=0")
    table = f"cli_keys_{uuid.uuid4().hex[:10]}"  # a table of its own: a pepper of its own
    args = ("create", "--name", "cli through pgbouncer", "--full-access")
    code, output = run_cli(url, *args, table=table)
    assert code == 0, output
    code, output = run_cli(url, "list", table=table)
    assert code == 0, output
    assert "cli through pgbouncer" in output


async def test_if_the_pooler_cannot_reach_postgresql_then_store_unavailable() -> None:
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    with PgBouncer(server=dead, settings={"query_wait_timeout": 1}) as bouncer:
        key_store = store_from_url(with_query(bouncer.url(), NO_PREPARED), connect_timeout=30)
        try:
            with pytest.raises(StoreUnavailable) as caught:
                await key_store.get("0123456789ab")
        finally:
            await key_store.aclose()
    assert caught.value.hint is not None
    assert "PostgreSQL is up" in caught.value.hint


def test_if_the_pooler_cannot_reach_postgresql_then_the_cli_exits_1_with_one_line() -> None:
    dead = f"127.0.0.1:{free_port()}"
    with PgBouncer(server=dead, settings={"query_wait_timeout": 1}) as bouncer:
        code, output = run_cli(with_query(bouncer.url(), NO_PREPARED), "list")
    assert code == 1
    lines = output.strip().splitlines()
    assert len(lines) == 1, output
    assert "key store unavailable" in lines[0]
    assert "query_wait_timeout" in lines[0]
    assert "PostgreSQL is up" in lines[0]


async def test_if_the_pooler_is_refused_by_postgresql_then_store_unavailable(
    pgbouncer: PgBouncer,
) -> None:
    url = with_query(pgbouncer.url(f"no_such_database_{uuid.uuid4().hex[:8]}"), NO_PREPARED)
    key_store = store_from_url(url)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            await key_store.get("0123456789ab")
    finally:
        await key_store.aclose()
    assert "does not exist" in str(caught.value.original)
    assert caught.value.hint is not None
    assert "[databases]" in caught.value.hint


async def test_if_the_pooler_refuses_more_clients_then_store_unavailable(
    postgres_url: str,
) -> None:
    with PgBouncer(settings={"max_client_conn": 1}) as bouncer:
        holder = await asyncpg.connect(bouncer.via(postgres_url))
        try:
            key_store = store_from_url(with_query(bouncer.via(postgres_url), NO_PREPARED))
            try:
                with pytest.raises(StoreUnavailable) as caught:
                    await key_store.get("0123456789ab")
                with pytest.raises(StoreUnavailable):
                    await key_store.list()
            finally:
                await key_store.aclose()
        finally:
            await holder.close()
    assert caught.value.hint is not None
    assert "max_client_conn" in caught.value.hint


async def test_if_the_pooler_is_in_statement_mode_then_store_unavailable_naming_the_modes(
    postgres_url: str,
) -> None:
    with PgBouncer(pool_mode="statement") as bouncer:
        url = with_query(bouncer.via(postgres_url), NO_PREPARED)
        key_store = store_from_url(url, table_name=unique_table())
        try:
            with pytest.raises(StoreUnavailable) as caught:
                await key_store.setup()
        finally:
            await key_store.aclose()
    assert caught.value.hint is not None
    assert "transaction mode" in caught.value.hint
    assert "session mode" in caught.value.hint


async def test_if_the_pooler_loses_its_server_connection_mid_statement_then_unavailable(
    pgbouncer: PgBouncer, postgres_url: str, admin: asyncpg.Connection
) -> None:
    # A change waits for a row lock; its server connection is ended under it, twice (the
    # store tries a statement that met a dead connection once more): PgBouncer answers
    # "server conn crashed?", and the store raises StoreUnavailable saying so.
    name = f"apikeys-crash-{uuid.uuid4().hex[:8]}"
    table = unique_table()
    url = with_query(pgbouncer.via(postgres_url), f"{NO_PREPARED}&pool_size=1")
    key_store = store_from_url(url, table_name=table, application_name=name)
    locker = await asyncpg.connect(postgres_url)  # straight to the server
    try:
        await key_store.setup()
        key = await conformance.inserted(key_store)
        async with locker.transaction():
            lock = f'SELECT 1 FROM "{table}" WHERE id = $1 FOR UPDATE'  # noqa: S608 - our table
            await locker.execute(lock, key.id)
            change = asyncio.ensure_future(
                key_store.set_state(key.id, "disabled", allowed_from={"active"}, at=T0)
            )
            while not change.done():
                await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE application_name = $1 AND wait_event_type = 'Lock'",
                    name,
                )
                await asyncio.sleep(0.05)
            with pytest.raises(StoreUnavailable) as caught:
                await change
    finally:
        await locker.close()
        await key_store.aclose()
    assert "server conn crashed" in str(caught.value.original)
    assert caught.value.hint is not None
    assert "lost its server connection" in caught.value.hint


# --- the key cache, through PgBouncer -------------------------------------------------------


async def test_if_a_key_is_revoked_through_pgbouncer_then_every_manager_refuses_it(
    bouncer_url: str,
) -> None:
    # Transaction mode drops the notifications a reader's connection would get while idle;
    # the readers' probes read the store's change log, so a revoke still holds at the next
    # request (it waits a lease for acknowledgements that cannot come).
    url = bouncer_url
    table = unique_table()
    hasher = Hasher(pepper=TEST_PEPPER)
    writer = KeyManager(store_from_url(url, table_name=table), hasher=hasher)
    reader = KeyManager(store_from_url(url, table_name=table), hasher=hasher)
    stale = 0
    try:
        for round_ in range(10):
            created = await writer.create(name=f"through pgbouncer {round_}", full_access=True)
            await reader.verify(created.key)
            assert reader.cache is not None
            for _ in range(200):  # until a probe through the pooler has proven it fresh
                if reader.cache.fresh:
                    break
                await asyncio.sleep(0.05)
            for _ in range(3):  # verified, then served from the reader's cache
                verified = await reader.verify(created.key)
                assert verified.id == created.record.id
            await writer.revoke(created.record.id)
            try:
                await reader.verify(created.key)
            except KeyRevoked:
                pass
            else:
                stale += 1
            with pytest.raises(KeyRevoked):
                await writer.verify(created.key)
        # The cache works through the pooler: keys were served from it, not only read.
        assert reader.cache.hits > 0
    finally:
        await reader.aclose()
        await writer.aclose()
    assert stale == 0


def test_behind_a_transaction_mode_pooler_the_cache_does_not_listen(postgres_url: str) -> None:
    # A LISTEN there lands on a server connection no client holds when notifications come,
    # and the pooler drops them ("got packet 'A' from server when not linked").
    pooled = store_from_url(with_query(postgres_url, NO_PREPARED)).channel()
    direct = store_from_url(postgres_url).channel()
    assert pooled is not None
    assert direct is not None
    assert (pooled._listen, direct._listen) == (False, True)  # type: ignore[attr-defined]
