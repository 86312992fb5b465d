"""URLs, engines and errors of the SQL store: which driver, which settings, and which
failures mean "the database cannot serve us now" (`StoreUnavailable`, failing closed)."""

from __future__ import annotations

import sqlite3
from typing import Any, Final, NoReturn

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from apikeys.errors import ConfigurationError

__all__ = [
    "MissingTable",
    "async_url",
    "engine_or_hint",
    "is_duplicate",
    "is_missing_table",
    "is_sqlite_memory",
    "is_unavailable",
    "make_engine",
    "raise_translated",
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
) -> AsyncEngine:
    if url.get_backend_name() == "sqlite":
        options: dict[str, Any] = {}
        if not is_sqlite_memory(url):
            options.update(
                pool_size=pool_size,
                max_overflow=max_overflow,
                pool_timeout=pool_timeout,
                pool_recycle=pool_recycle,
            )
        engine = create_async_engine(url, echo=echo, **options)
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
    return create_async_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_timeout,
        pool_recycle=pool_recycle,
        pool_pre_ping=pool_pre_ping,
        connect_args={
            "timeout": connect_timeout,
            "command_timeout": command_timeout,
            "server_settings": server_settings,
        },
    )


# --- errors -------------------------------------------------------------------------------

# SQLSTATE classes that mean "the server cannot serve us now": connection exception,
# insufficient resources, operator intervention (shutdown, cancelled statement), system error.
_UNAVAILABLE_SQLSTATE_CLASSES: Final = ("08", "53", "57", "58")


def _asyncpg_unavailable_types() -> tuple[type[BaseException], ...]:
    try:
        import asyncpg
    except ImportError:  # pragma: no cover - the postgres extra is not installed
        return ()
    return (asyncpg.PostgresConnectionError, asyncpg.InterfaceError)


_ASYNCPG_UNAVAILABLE: Final = _asyncpg_unavailable_types()


def is_unavailable(exc: BaseException) -> bool:
    """Whether `exc` means the database cannot be reached or cannot serve us right now."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated or isinstance(
            exc, sa_exc.OperationalError | sa_exc.InterfaceError
        ):
            return True
        orig = exc.orig
        sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if isinstance(sqlstate, str) and sqlstate[:2] in _UNAVAILABLE_SQLSTATE_CLASSES:
            return True
        cause = orig.__cause__ if orig is not None else None
        return cause is not None and is_unavailable(cause)
    return isinstance(
        exc,
        OSError  # ConnectionError, socket errors, and TimeoutError (= asyncio.TimeoutError)
        | sa_exc.TimeoutError  # no connection free in the pool within pool_timeout
        | sa_exc.DisconnectionError
        | sqlite3.OperationalError  # "database is locked", "unable to open database file"
        | sqlite3.InterfaceError,
    ) or (bool(_ASYNCPG_UNAVAILABLE) and isinstance(exc, _ASYNCPG_UNAVAILABLE))


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
