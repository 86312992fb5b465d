"""URLs, engines and errors of the SQL store: which driver, which settings, and which
failures mean "the database cannot serve us now" (`StoreUnavailable`, failing closed)."""

from __future__ import annotations

import dataclasses
import sqlite3
import sys
from typing import Any, Final, NoReturn

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from apikeys.errors import ConfigurationError
from apikeys.redaction import hide_values_in_driver_logs

__all__ = [
    "URL_OPTIONS",
    "MissingTable",
    "PoolOptions",
    "async_url",
    "engine_or_hint",
    "is_duplicate",
    "is_missing_table",
    "is_sqlite_memory",
    "is_unavailable",
    "make_engine",
    "raise_translated",
    "replication_risk",
    "split_url_options",
    "unavailable_hint",
]

# --- URLs and engines ---------------------------------------------------------------------

_DRIVERS: Final = {
    "sqlite": "sqlite+aiosqlite",
    "sqlite+aiosqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+asyncpg": "postgresql+asyncpg",
}


def async_url(url: str | URL) -> URL:
    """The URL with its async driver: `sqlite://` → aiosqlite, `postgresql://` → asyncpg.

    A libpq-style `sslmode=` query parameter becomes asyncpg's `ssl=`.
    """
    try:
        parsed = make_url(url) if isinstance(url, str) else url
    except sa_exc.ArgumentError:
        raise ConfigurationError("not a valid SQL database URL") from None
    driver = _DRIVERS.get(parsed.drivername.lower())
    if driver is None:
        known = ", ".join(f"{scheme}://" for scheme in _DRIVERS)
        raise ConfigurationError(
            f"the SQL store does not serve {parsed.drivername}:// URLs; known: {known}"
        )
    parsed = parsed.set(drivername=driver)
    if driver == "postgresql+asyncpg" and "sslmode" in parsed.query:
        query = dict(parsed.query)
        sslmode = query.pop("sslmode")
        query.setdefault("ssl", sslmode)
        parsed = parsed.set(query=query)
    return parsed


# --- the store's options in the URL --------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class PoolOptions:
    """How a store built from a URL pools its connections (see `split_url_options`)."""

    pool_size: int
    max_overflow: int
    pool_timeout: float
    pool_recycle: float
    prepared_statements: bool


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise ValueError(text)
    return value


_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def _flag(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(text)


def _cache_size(text: str) -> bool:
    # asyncpg's `statement_cache_size` and SQLAlchemy's `prepared_statement_cache_size`:
    # 0 is what their documentation says to set behind PgBouncer.
    return _count(text) != 0


URL_OPTIONS: Final = {
    "pool_size": ("pool_size", _count),
    "max_overflow": ("max_overflow", _count),
    "pool_timeout": ("pool_timeout", _seconds),
    "pool_recycle": ("pool_recycle", _seconds),
    "prepared_statements": ("prepared_statements", _flag),
    "statement_cache_size": ("prepared_statements", _cache_size),
    "prepared_statement_cache_size": ("prepared_statements", _cache_size),
}
"""The query string parameters a store's URL may carry, and the option each one sets."""


def split_url_options(url: URL, defaults: PoolOptions) -> tuple[URL, PoolOptions]:
    """The URL without the store's own query parameters, and the options they give.

    `?pool_size=5&max_overflow=0&prepared_statements=false` (CONTRACT section 10): a URL
    sizes its store's pools wherever only a URL can be given (`APIKEYS_STORE_URL`, the
    command line's `--store`). A parameter in the URL wins over the keyword argument of the
    same name, as in redis-py's `from_url`. The parameters are taken out of the URL, so the
    driver never sees them.
    """
    query = dict(url.query)
    changes: dict[str, Any] = {}
    for name, (option, parse) in URL_OPTIONS.items():
        if name not in query:
            continue
        text = query.pop(name)
        if not isinstance(text, str):  # given twice: ?pool_size=5&pool_size=6
            raise ConfigurationError(f"the SQL store URL gives {name} more than once")
        try:
            changes[option] = parse(text)
        except ValueError:
            raise ConfigurationError(
                f"the SQL store URL's {name}={text!r} is not a valid value"
            ) from None
    if not changes:
        return url, defaults
    return url.set(query=query), dataclasses.replace(defaults, **changes)


def is_sqlite_memory(url: URL) -> bool:
    database = url.database or ""
    return (
        database in ("", ":memory:")
        or "mode=memory" in database
        or (url.query.get("mode") == "memory")
    )


# The driver each dialect imports, and the extra that brings it.
_DRIVER_EXTRAS: Final = {"aiosqlite": "sql", "asyncpg": "postgres"}


def engine_or_hint(url: URL, **options: Any) -> AsyncEngine:
    """`make_engine`, or a `ConfigurationError` naming the extra whose driver is missing."""
    try:
        return make_engine(url, **options)
    except ModuleNotFoundError as exc:
        extra = _DRIVER_EXTRAS.get(exc.name or "")
        if extra is None:
            raise
        raise ConfigurationError(
            f"the {url.get_backend_name()} key store needs {exc.name}, which is not installed. "
            f"Install it with: pip install 'apikeys[{extra}]'"
        ) from exc


def make_engine(
    url: URL,
    *,
    pool_size: int,
    max_overflow: int,
    pool_timeout: float,
    pool_recycle: float,
    pool_pre_ping: bool,
    connect_timeout: float,
    command_timeout: float | None,
    busy_timeout: float,
    application_name: str,
    echo: bool,
    prepared_statements: bool = True,
) -> AsyncEngine:
    # Statements carry hashes and webhook secrets: none in an error or any log, at any level.
    hide_values_in_driver_logs()
    if url.get_backend_name() == "sqlite":
        options: dict[str, Any] = {}
        if not is_sqlite_memory(url):
            options.update(
                pool_size=pool_size,
                max_overflow=max_overflow,
                pool_timeout=pool_timeout,
                pool_recycle=pool_recycle,
            )
        engine = create_async_engine(url, echo=echo, hide_parameters=True, **options)
        busy_ms = int(busy_timeout * 1000)

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
                cursor.execute("PRAGMA journal_mode = WAL")
            finally:
                cursor.close()

        return engine
    server_settings = {"application_name": application_name}
    connect_args: dict[str, Any] = {
        "timeout": connect_timeout,
        "command_timeout": command_timeout,
        "server_settings": server_settings,
    }
    if not prepared_statements:
        # Behind a pooler in transaction mode, each transaction may run on another server
        # connection: a statement prepared on one is unknown on the next, and two clients'
        # `__asyncpg_stmt_1__` collide on a shared one. With both caches off, asyncpg
        # prepares every statement unnamed and parses it again with its Bind, in one
        # exchange on one server connection (asyncpg's FAQ, SQLAlchemy's asyncpg notes).
        connect_args["statement_cache_size"] = 0
        connect_args["prepared_statement_cache_size"] = 0
    return create_async_engine(
        url,
        echo=echo,
        # Statements carry hashes and webhook secrets: none in an error or the echo log.
        hide_parameters=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_timeout,
        pool_recycle=pool_recycle,
        pool_pre_ping=pool_pre_ping,
        connect_args=connect_args,
    )


# --- errors -------------------------------------------------------------------------------

# SQLSTATE classes that mean "the server cannot serve us now": connection exception,
# insufficient resources, operator intervention (shutdown, cancelled statement), system error.
# (PgBouncer reports its own refusals as class 08 too: "no more connections allowed",
# "query_wait_timeout", "server login has been failing", "server conn crashed?".)
_UNAVAILABLE_SQLSTATE_CLASSES: Final = ("08", "53", "57", "58")

# A prepared statement that is gone (26000) or taken (42P05): behind a pooler in transaction
# mode, one client's statements land on different server connections, and several clients'
# on one. The store cannot serve until its URL says so (`?prepared_statements=false`).
_PREPARED_STATEMENT_SQLSTATES: Final = ("26000", "42P05")


def _asyncpg_unavailable(exc: BaseException) -> bool:
    # An asyncpg error exists only once asyncpg was imported: looked up, never imported here,
    # so a SQLite store (and each `apikeys` command on one) does not load it.
    asyncpg = sys.modules.get("asyncpg")
    return asyncpg is not None and isinstance(
        exc, (asyncpg.PostgresConnectionError, asyncpg.InterfaceError)
    )


def _sqlstate(exc: BaseException | None) -> str | None:
    """The SQLSTATE of a driver error (asyncpg's `sqlstate`, psycopg's `pgcode`), if any."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    return sqlstate if isinstance(sqlstate, str) else None


def _unavailable_sqlstate(exc: BaseException | None) -> bool:
    sqlstate = _sqlstate(exc)
    return sqlstate is not None and (
        sqlstate[:2] in _UNAVAILABLE_SQLSTATE_CLASSES or sqlstate in _PREPARED_STATEMENT_SQLSTATES
    )


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means the database cannot be reached or cannot serve us right now."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated or isinstance(
            exc, sa_exc.OperationalError | sa_exc.InterfaceError
        ):
            return True
        orig = exc.orig
        if _unavailable_sqlstate(orig):
            return True
        cause = orig.__cause__ if orig is not None else None
        return cause is not None and is_unavailable(cause)
    return (
        isinstance(
            exc,
            OSError  # ConnectionError, socket errors, and TimeoutError (= asyncio.TimeoutError)
            | sa_exc.TimeoutError  # no connection free in the pool within pool_timeout
            | sa_exc.DisconnectionError
            | sqlite3.OperationalError  # "database is locked", "unable to open database file"
            | sqlite3.InterfaceError,
        )
        or _asyncpg_unavailable(exc)
        or _unavailable_sqlstate(exc)  # asyncpg's own errors, on the direct read path
    )


_PREPARED_STATEMENTS_HINT: Final = (
    "statements prepared on one server connection are missing or taken on another: behind "
    "PgBouncer in transaction mode, add ?prepared_statements=false to the store URL"
)

# What to do about PgBouncer's refusals, found by their message (all of SQLSTATE class 08).
_POOLER_HINTS: Final = (
    (
        "no more connections allowed",
        "the pooler refuses more clients: raise its max_client_conn, or lower pool_size and "
        "max_overflow in the store URL",
    ),
    (
        "query_wait_timeout",
        "the pooler got no server connection in time: check that PostgreSQL is up and "
        "reachable from the pooler, and that the pooler's default_pool_size suffices",
    ),
    (
        "server login",
        "the pooler cannot log in to PostgreSQL: check that the server is up and that the "
        "pooler's [databases] entry and credentials are right",
    ),
    (
        "does not exist",  # the server refused the pooler's login: no such database or role
        "PostgreSQL refused the pooler's login: check the database and user in the store URL "
        "and the pooler's [databases] entry",
    ),
    (
        "cannot connect to server",
        "the pooler cannot reach PostgreSQL: check that the server is up and the pooler's "
        "[databases] entry",
    ),
    (
        "transaction blocks not allowed",
        "the pooler runs in statement mode, which cannot run the store's transactions: use "
        "transaction mode (with ?prepared_statements=false in the store URL) or session mode",
    ),
    (
        "server conn crashed",
        "the pooler lost its server connection mid-statement (a server restart?); "
        "retry once it is back",
    ),
)


def unavailable_hint(exc: BaseException) -> str | None:
    """What to do about `exc`, when apikeys knows: the URL option a pooler needs, or
    which setting of the pooler refused us. None for everything else."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, sa_exc.DBAPIError):
            current = current.orig
            continue
        if _sqlstate(current) in _PREPARED_STATEMENT_SQLSTATES:
            return _PREPARED_STATEMENTS_HINT
        if (_sqlstate(current) or "").startswith("08"):
            message = str(current)
            for phrase, hint in _POOLER_HINTS:
                if phrase in message:
                    return hint
        current = current.__cause__
    return None


class MissingTable(ConfigurationError):
    """The keys table does not exist (and the store may not create it)."""


def raise_translated(error: Exception, original: Exception) -> NoReturn:
    """Raise `error`, translated from `original`, or `original` itself unchained."""
    if error is original:
        raise original
    raise error from original


def is_missing_table(exc: BaseException) -> bool:
    """Whether `exc` says the table does not exist (PostgreSQL 42P01, SQLite's message)."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    if isinstance(orig, sqlite3.OperationalError):
        return str(orig).startswith("no such table")
    return "42P01" in (getattr(orig, "sqlstate", None), getattr(orig, "pgcode", None))


def is_duplicate(exc: sa_exc.IntegrityError) -> bool:
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate is not None:
        return bool(sqlstate == "23505")  # unique_violation
    message = str(orig)
    return "UNIQUE constraint failed" in message or "PRIMARY KEY" in message


# --- replication ---------------------------------------------------------------------------

# `synchronous_commit` values that wait for no standby: a commit is not on any replica yet.
_LOCAL_COMMIT: Final = frozenset({"off", "local"})


def replication_risk(connection: sa.Connection) -> str | None:
    """What a failover could lose on this PostgreSQL server, or None.

    Streaming replicas (physical `pg_stat_replication` rows; logical subscribers are no
    failover target) without synchronous replication receive a commit after it returned: a
    failover to one loses a revoke that had returned, and every process admits the key
    again. None when there are no replicas, or when `synchronous_standby_names` names them
    and `synchronous_commit` (as this connection has it) waits for at least `remote_write`.
    """
    row = connection.execute(
        sa.text(
            "SELECT count(*), count(*) FILTER (WHERE r.sync_state = 'async'), "
            "current_setting('synchronous_standby_names'), current_setting('synchronous_commit') "
            "FROM pg_stat_replication r LEFT JOIN pg_stat_activity a ON a.pid = r.pid "
            "WHERE a.datid IS NULL"
        )
    ).one()
    replicas, unsynced, names, commit = int(row[0]), int(row[1]), str(row[2]), str(row[3])
    if replicas == 0:
        return None
    if not names.strip():
        why = "synchronous_standby_names is empty"
    elif commit in _LOCAL_COMMIT:
        why = f"synchronous_commit is {commit}"
    elif unsynced:
        why = f"{unsynced} of them not named in synchronous_standby_names"
    else:
        return None
    return (
        f"PostgreSQL streams to {replicas} replica(s) without synchronous replication ({why}): "
        "a failover to one can lose a revoke that already returned, and every process would "
        "admit the key again. Set synchronous_standby_names to name the replicas you fail "
        "over to and synchronous_commit to remote_write, on or remote_apply "
        "(docs/deploying.md, PostgreSQL replication)."
    )
