"""With every logger at DEBUG, no log record shows a key, its secret or its stored hash.

The drivers under the stores log at DEBUG: aiosqlite each call it runs with its arguments (a
statement's parameters hold the hash), SQLAlchemy each row a statement returns. An
application that turns its root logger to DEBUG to chase a bug must not write its keys' hashes
into its log files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta

import pytest

from apikeys import Hasher, KeyManager, redaction
from apikeys.errors import AuthenticationError, KeyRevoked
from apikeys.importing import ForeignKey, read_drf
from apikeys.stores import KeyStore
from apikeys.testing import TEST_PEPPER
from tests.drf_databases import drf_database  # noqa: F401 - the `drf` fixture

# Every logger a store's dependencies log under, besides the root: set to DEBUG explicitly
# in case a library (or an earlier test) set a level of its own on one of them.
_LOGGERS = ("aiosqlite", "sqlalchemy", "sqlalchemy.engine", "asyncpg", "redis", "apikeys")


@pytest.fixture(
    params=[
        pytest.param("sqlite", marks=pytest.mark.sqlite, id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
        pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    ]
)
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every logger at DEBUG, as in a fresh process: without the filter an earlier test's
    engine installed, so each test shows that its own path installs it."""
    caplog.set_level(logging.DEBUG)
    for name in _LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    filtered = [
        logger
        for logger in map(logging.getLogger, ("aiosqlite", "sqlalchemy.engine.Engine"))
        if redaction._FILTER in logger.filters
    ]
    for logger in filtered:
        logger.removeFilter(redaction._FILTER)
    try:
        yield caplog
    finally:
        for logger in filtered:
            logger.addFilter(redaction._FILTER)


def _texts(records: list[logging.LogRecord]) -> Iterator[str]:
    for record in records:
        yield record.getMessage()
        yield repr(record.args)
        if record.exc_info and record.exc_info[1] is not None:
            yield repr(record.exc_info[1])
        if record.exc_text:
            yield record.exc_text


async def test_no_log_record_at_debug_shows_a_secret_or_a_hash(
    debug_log: pytest.LogCaptureFixture, store: KeyStore, store_kind: str
) -> None:
    tokens: list[str] = []
    hashes: list[str] = []
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False) as manager:
        created = await manager.create(name="logged", full_access=True)
        tokens.append(created.key)
        for _ in range(3):  # a store read, then the cache's hits
            await manager.verify(created.key)
        with pytest.raises(AuthenticationError):
            await manager.verify(created.key[:-12] + "A" * 6 + created.key[-6:])
        rolled = await manager.roll(created.record.id, grace=timedelta(hours=1))
        tokens.append(rolled.key)
        await manager.verify(rolled.key)
        await manager.disable(rolled.record.id)
        await manager.enable(rolled.record.id)
        for key_id in (created.record.id, rolled.record.id):
            stored = await store.get(key_id)
            assert stored is not None
            hashes.append(stored.secret_hash)
            await manager.revoke(key_id)
        with pytest.raises(KeyRevoked):
            await manager.verify(rolled.key)
    records = debug_log.records
    if store_kind != "redis":  # redis-py logs nothing of a command at DEBUG
        names = {record.name for record in records}
        assert {"aiosqlite", "sqlalchemy.engine.Engine"} & names, "the drivers logged nothing"
    secrets = [token.rsplit("_", 1)[1][:-6] for token in tokens]
    digests = [stored_hash.rsplit("$", 1)[1] for stored_hash in hashes]
    for text in _texts(records):
        for secret in (*tokens, *secrets, *hashes, *digests):
            assert secret not in text, text[:300]


async def test_reading_a_drf_table_at_debug_logs_no_hash(
    drf: tuple[str, dict[str, str]], debug_log: pytest.LogCaptureFixture
) -> None:
    url, keys = drf
    found = [item for item in await read_drf(url) if isinstance(item, ForeignKey)]
    assert found
    names = {record.name for record in debug_log.records}
    assert {"aiosqlite", "sqlalchemy.engine.Engine"} & names, "the drivers logged nothing"
    for text in _texts(debug_log.records):
        for key in found:
            assert key.hashed not in text, text[:300]
            assert key.hashed.rsplit("$", 1)[-1] not in text, text[:300]
        for token in keys.values():
            assert token not in text
