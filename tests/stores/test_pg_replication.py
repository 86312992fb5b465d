"""PostgreSQL with a streaming replica: `setup()` warns when a failover could lose a revoke.

A revoke committed on the primary reaches an asynchronous replica after it returned; a
failover to that replica loses it, and every process admits the key again (CONTRACT section
15). These tests start a private primary and a streaming replica of their own (a copy of
one data folder that initdb made for the module, pg_basebackup -R, pg_ctl) in a temporary
folder on free ports, and remove them after.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from apikeys.stores.sql.store import SQLStore
from tests import services
from tests.test_multiprocess import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


@dataclass
class Cluster:
    """A private primary and its streaming replica."""

    bin: Path
    root: Path
    primary_port: int
    replica_port: int
    prefix: list[str]

    @property
    def primary_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.primary_port}/postgres"

    def run(self, tool: str, *args: str) -> str:
        done = subprocess.run(
            [*self.prefix, str(self.bin / tool), *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (tool, done.stdout, done.stderr)
        return done.stdout

    def sql(self, statement: str, port: int | None = None) -> str:
        return self.run(
            "psql",
            "-h",
            "127.0.0.1",
            "-p",
            str(port or self.primary_port),
            "-U",
            "postgres",
            "-d",
            "postgres",
            "-Atc",
            statement,
        ).strip()

    def start(self, data: Path, port: int) -> None:
        options = f"-p {port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self.run("pg_ctl", "-D", str(data), "-l", str(data) + ".log", "-o", options, "-w", "start")

    def wait_for(self, statement: str, expected: str) -> None:
        deadline = time.monotonic() + 60
        while (answer := self.sql(statement)) != expected:
            if time.monotonic() > deadline:
                pytest.fail(f"{statement!r} answered {answer!r}, not {expected!r}")
            time.sleep(0.1)


def _prefix() -> list[str]:
    """Run the server's tools as the `postgres` OS user when this is root (initdb refuses)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return []
    runuser = shutil.which("runuser")
    return [runuser, "-u", "postgres", "--"] if runuser else []


def _require_binaries() -> tuple[Path, list[str]]:
    binaries = _binaries()
    if binaries is None:
        message = "PostgreSQL's server binaries (/usr/lib/postgresql/*/bin) are not installed"
        if services.REQUIRE_SERVICES:
            pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
        pytest.skip(message)
    prefix = _prefix()
    if os.geteuid() == 0 and not prefix:
        pytest.skip("running as root without a postgres user to run initdb as")
    return binaries, prefix


def _private_folder(prefix: str, tools: list[str]) -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    if tools:
        entry = pwd.getpwnam("postgres")
        os.chown(root, entry.pw_uid, entry.pw_gid)
    return root


@pytest.fixture(scope="module")
def initialized() -> Iterator[Path]:
    """A data folder fresh from `initdb`, never started: each test's primary is a copy of it
    (a copy takes a fraction of an initdb)."""
    binaries, prefix = _require_binaries()
    root = _private_folder("apikeys-pgrepl-initdb-", prefix)
    try:
        data = root / "initialized"
        initdb = [str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"]
        done = subprocess.run(
            [*prefix, *initdb, "-E", "UTF8"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        yield data
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def replicated(initialized: Path) -> Iterator[Cluster]:
    binaries, prefix = _require_binaries()
    root = _private_folder("apikeys-pgrepl-", prefix)
    cluster = Cluster(binaries, root, free_port(), free_port(), prefix)
    primary, replica = root / "primary", root / "replica"
    started: list[Path] = []
    try:
        copied = subprocess.run(
            [*prefix, "cp", "-a", str(initialized), str(primary)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert copied.returncode == 0, copied.stderr
        cluster.start(primary, cluster.primary_port)
        started.append(primary)
        cluster.run(
            "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(cluster.primary_port),
            "-U",
            "postgres",
            "-D",
            str(replica),
            "-R",
            "-X",
            "stream",
        )
        cluster.start(replica, cluster.replica_port)
        started.append(replica)
        cluster.wait_for("SELECT count(*) FROM pg_stat_replication", "1")
        yield cluster
    finally:
        for data in reversed(started):
            subprocess.run(
                [*prefix, str(binaries / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)


def _setup_warnings(url: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    async def setup() -> None:
        store = SQLStore(url)
        try:
            await store.setup()
        finally:
            await store.aclose()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apikeys"):
        asyncio.run(setup())
    return [record.getMessage() for record in caplog.records if "replica" in record.getMessage()]


def test_setup_warns_of_an_asynchronous_replica_and_not_of_a_synchronous_one(
    replicated: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    (warning,) = _setup_warnings(replicated.primary_url, caplog)
    assert "synchronous_standby_names" in warning
    assert "synchronous_commit" in warning
    assert "failover" in warning
    # Synchronous replication: a commit returns once the replica has it.
    replicated.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
    replicated.sql("SELECT pg_reload_conf()")
    replicated.wait_for("SELECT string_agg(sync_state, ',') FROM pg_stat_replication", "sync")
    assert _setup_warnings(replicated.primary_url, caplog) == []
    # ... unless the store's own sessions commit locally.
    replicated.sql("ALTER ROLE postgres SET synchronous_commit = local")
    (local,) = _setup_warnings(replicated.primary_url, caplog)
    assert "synchronous_commit is local" in local


def test_setup_says_nothing_of_replication_without_replicas(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import psycopg

    with psycopg.connect(postgres_url) as connection:
        replicas = connection.execute("SELECT count(*) FROM pg_stat_replication").fetchone()
    if replicas != (0,):
        pytest.skip("the shared PostgreSQL server has replicas")
    assert _setup_warnings(postgres_url, caplog) == []


# --- the failover itself ----------------------------------------------------------------------

PEPPER = "xa-hMG99uyGrfed7F5aU8JKDScr9Cj6XyHPl7Pg0ydI"


async def _create(url: str) -> tuple[str, str]:
    from apikeys import Hasher, KeyManager

    async with KeyManager(SQLStore(url), hasher=Hasher(pepper=PEPPER), cache=False) as manager:
        await manager.setup()
        created = await manager.create(name="failover", workspace="w", scopes=["a:read"])
        return created.key, created.record.id


async def _revoke(url: str, key_id: str) -> None:
    from apikeys import Hasher, KeyManager

    async with KeyManager(SQLStore(url), hasher=Hasher(pepper=PEPPER), cache=False) as manager:
        await manager.revoke(key_id)


async def _admitted(url: str, token: str) -> bool:
    from apikeys import Hasher, KeyManager
    from apikeys.errors import KeyRevoked

    async with KeyManager(SQLStore(url), hasher=Hasher(pepper=PEPPER), cache=False) as manager:
        try:
            await manager.verify(token, record_usage=False)
        except KeyRevoked:
            return False
        return True


def _fail_over(cluster: Cluster) -> str:
    """The primary lost at once (no shutdown), the replica promoted: its URL."""
    cluster.run("pg_ctl", "-D", str(cluster.root / "primary"), "-m", "immediate", "stop")
    cluster.run("pg_ctl", "-D", str(cluster.root / "replica"), "-w", "promote")
    return f"postgresql://postgres@127.0.0.1:{cluster.replica_port}/postgres"


def _replica_answer(cluster: Cluster, statement: str) -> str | None:
    """`statement` on the replica, or None while it fails (a table not replayed yet)."""
    try:
        return cluster.sql(statement, cluster.replica_port)
    except AssertionError:
        return None


def _on_replica(cluster: Cluster, key_id: str) -> None:
    cluster_sql = f"SELECT count(*) FROM apikeys_keys WHERE id = '{key_id}'"  # noqa: S608
    deadline = time.monotonic() + 60
    # Until the replica has replayed the table's creation, the query fails: ask again.
    while _replica_answer(cluster, cluster_sql) != "1":
        if time.monotonic() > deadline:
            pytest.fail("the key never reached the replica")
        time.sleep(0.1)


def test_a_failover_to_an_asynchronous_replica_that_lags_loses_a_revoke(
    replicated: Cluster,
) -> None:
    token, key_id = asyncio.run(_create(replicated.primary_url))
    _on_replica(replicated, key_id)
    # The replica falls behind (here: it is stopped), which asynchronous replication
    # allows: the revoke returns all the same.
    replicated.run("pg_ctl", "-D", str(replicated.root / "replica"), "-m", "fast", "stop")
    asyncio.run(_revoke(replicated.primary_url, key_id))
    replicated.run("pg_ctl", "-D", str(replicated.root / "primary"), "-m", "immediate", "stop")
    replicated.start(replicated.root / "replica", replicated.replica_port)
    replicated.run("pg_ctl", "-D", str(replicated.root / "replica"), "-w", "promote")
    promoted = f"postgresql://postgres@127.0.0.1:{replicated.replica_port}/postgres"
    assert asyncio.run(_admitted(promoted, token))  # the revoke is lost


def test_a_failover_to_a_synchronous_replica_keeps_a_revoke(replicated: Cluster) -> None:
    replicated.sql("ALTER SYSTEM SET synchronous_standby_names = '*'")
    replicated.sql("SELECT pg_reload_conf()")
    replicated.wait_for("SELECT string_agg(sync_state, ',') FROM pg_stat_replication", "sync")
    token, key_id = asyncio.run(_create(replicated.primary_url))
    asyncio.run(_revoke(replicated.primary_url, key_id))
    promoted = _fail_over(replicated)
    assert not asyncio.run(_admitted(promoted, token))
