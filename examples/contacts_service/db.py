"""The service's data: workspaces, contacts, campaigns, campaign runs, and the settings
UI's users and their sessions.

SQLAlchemy 2 Core on its own `MetaData`, async, on SQLite (aiosqlite) or PostgreSQL
(asyncpg). Every query that reads or writes a workspace's data takes the workspace as an
argument and filters on it: a request can only ever reach its own key's workspace.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from apikeys.stores.sql import (
    UTCDateTime,
    async_url,
    create_concurrently,
    create_private_file,
)
from apikeys.types import isoformat, utcnow

__all__ = [
    "DEMO_CAMPAIGNS",
    "Database",
    "Page",
    "campaign_runs",
    "campaigns",
    "contacts",
    "metadata",
    "sessions",
    "users",
    "workspaces",
]

metadata = sa.MetaData()

workspaces = sa.Table(
    "workspaces",
    metadata,
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
)

contacts = sa.Table(
    "contacts",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("workspace", sa.String(200), sa.ForeignKey("workspaces.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("phone", sa.String(32), nullable=True),
    sa.Column("email", sa.String(320), nullable=True),
    sa.Column("company", sa.String(200), nullable=True),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    # Pages of a workspace's contacts, oldest first, read this index in order.
    sa.Index("ix_contacts_workspace_created", "workspace", "created_at", "id"),
)

campaigns = sa.Table(
    "campaigns",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("workspace", sa.String(200), sa.ForeignKey("workspaces.id"), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("channel", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Index("ix_campaigns_workspace_created", "workspace", "created_at", "id"),
)

campaign_runs = sa.Table(
    "campaign_runs",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("campaign_id", sa.String(32), sa.ForeignKey("campaigns.id"), nullable=False),
    sa.Column("workspace", sa.String(200), sa.ForeignKey("workspaces.id"), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
)

users = sa.Table(
    "users",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("workspace", sa.String(200), sa.ForeignKey("workspaces.id"), nullable=False),
    # Stored lower-cased: the login form finds a user whatever case was typed.
    sa.Column("email", sa.String(320), nullable=False, unique=True),
    # A passlib hash string (`$argon2id$…`); the password itself is never stored.
    sa.Column("password_hash", sa.String(255), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
)

sessions = sa.Table(
    "sessions",
    metadata,
    # SHA-256 of the session token: the database alone cannot be used to log in.
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("user_id", sa.String(32), sa.ForeignKey("users.id"), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=False),
    sa.Index("ix_sessions_user", "user_id"),
)

DEMO_CAMPAIGNS: tuple[tuple[str, str], ...] = (
    ("Welcome series", "email"),
    ("Spring sale", "sms"),
)
"""(name, channel) of the campaigns every new workspace starts with."""

_ALPHABET = string.digits + string.ascii_letters


def new_id(prefix: str) -> str:
    """`c_` and 20 random base62 characters (about 119 bits): unguessable across workspaces."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(20))


def contact_json(row: Mapping[Any, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "phone": row["phone"],
        "email": row["email"],
        "company": row["company"],
        "created_at": isoformat(row["created_at"]),
    }


def campaign_json(row: Mapping[Any, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "channel": row["channel"],
        "created_at": isoformat(row["created_at"]),
    }


@dataclass(frozen=True, slots=True)
class Page:
    """One page of a list, oldest first, and the position after its last row (if more)."""

    rows: list[sa.RowMapping]
    after: tuple[datetime, str] | None


def _make_engine(url: str) -> AsyncEngine:
    parsed = async_url(url)  # sqlite:// → aiosqlite, postgresql:// → asyncpg
    engine = create_async_engine(parsed)
    if parsed.get_backend_name() == "sqlite":

        @sa.event.listens_for(engine.sync_engine, "connect")
        def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
            # WAL lets readers and a writer work at once; writers wait for each other.
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA busy_timeout = 5000")
            finally:
                cursor.close()

    return engine


class Database:
    """The service's queries. `workspace` is the first argument of each, and never optional."""

    def __init__(self, url: str) -> None:
        self.engine = _make_engine(url)
        postgres = self.engine.dialect.name == "postgresql"
        self._insert = postgresql.insert if postgres else sqlite.insert
        self._known_workspaces: set[str] = set()

    async def create_tables(self) -> None:
        """Create the tables that are missing. Idempotent, and safe when several workers
        start on a fresh database at once. A new SQLite file is readable by its owner only
        (it holds password hashes)."""
        url = self.engine.url
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            create_private_file(url.database)
        await create_concurrently(
            self.engine, lambda connection: metadata.create_all(connection, checkfirst=True)
        )

    async def aclose(self) -> None:
        await self.engine.dispose()

    # -- workspaces ------------------------------------------------------------------------

    async def ensure_workspace(self, workspace: str) -> bool:
        """Create the workspace with its demo campaigns, once. True if it was created now."""
        if workspace in self._known_workspaces:
            return False
        now = utcnow()
        statement = (
            self._insert(workspaces)
            .values(id=workspace, created_at=now)
            .on_conflict_do_nothing(index_elements=["id"])
        )
        async with self.engine.begin() as conn:
            created = (await conn.execute(statement)).rowcount == 1
            if created:
                # In the same transaction: a workspace never exists without its campaigns.
                await conn.execute(
                    sa.insert(campaigns),
                    [
                        {
                            "id": new_id("cmp_"),
                            "workspace": workspace,
                            "name": name,
                            "channel": channel,
                            "created_at": now + timedelta(microseconds=position),
                        }
                        for position, (name, channel) in enumerate(DEMO_CAMPAIGNS)
                    ],
                )
        self._known_workspaces.add(workspace)
        return created

    # -- lists -----------------------------------------------------------------------------

    @staticmethod
    async def _page(
        conn: AsyncConnection,
        table: sa.Table,
        workspace: str,
        limit: int,
        after: tuple[datetime, str] | None,
    ) -> Page:
        statement = sa.select(table).where(table.c.workspace == workspace)
        if after is not None:
            created_at, row_id = after
            statement = statement.where(
                sa.or_(
                    table.c.created_at > created_at,
                    sa.and_(table.c.created_at == created_at, table.c.id > row_id),
                )
            )
        # One row more than asked tells whether another page follows.
        statement = statement.order_by(table.c.created_at, table.c.id).limit(limit + 1)
        rows = [row._mapping for row in await conn.execute(statement)]
        if len(rows) <= limit:
            return Page(rows, None)
        last = rows[limit - 1]
        return Page(rows[:limit], (last["created_at"], last["id"]))

    async def list_contacts(
        self, workspace: str, limit: int, after: tuple[datetime, str] | None = None
    ) -> Page:
        async with self.engine.connect() as conn:
            return await self._page(conn, contacts, workspace, limit, after)

    async def list_campaigns(
        self, workspace: str, limit: int, after: tuple[datetime, str] | None = None
    ) -> Page:
        async with self.engine.connect() as conn:
            return await self._page(conn, campaigns, workspace, limit, after)

    # -- contacts --------------------------------------------------------------------------

    async def get_contact(self, workspace: str, contact_id: str) -> sa.RowMapping | None:
        statement = sa.select(contacts).where(
            contacts.c.workspace == workspace, contacts.c.id == contact_id
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(statement)).first()
        return None if row is None else row._mapping

    async def add_contact(self, workspace: str, fields: Mapping[str, str | None]) -> dict[str, Any]:
        """Store a validated contact; return it as stored."""
        row: dict[str, Any] = {
            "id": new_id("c_"),
            "workspace": workspace,
            "name": fields["name"],
            "phone": fields.get("phone"),
            "email": fields.get("email"),
            "company": fields.get("company"),
            "created_at": utcnow(),
        }
        async with self.engine.begin() as conn:
            await conn.execute(sa.insert(contacts).values(row))
        return row

    async def find_contact_by_email(self, workspace: str, email: str) -> sa.RowMapping | None:
        statement = sa.select(contacts).where(
            contacts.c.workspace == workspace, contacts.c.email == email
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(statement)).first()
        return None if row is None else row._mapping

    # -- campaigns -------------------------------------------------------------------------

    async def trigger_campaign(self, workspace: str, campaign_id: str) -> str | None:
        """Queue a run of the workspace's campaign; its run id, or None if there is none."""
        found = sa.select(campaigns.c.id).where(
            campaigns.c.workspace == workspace, campaigns.c.id == campaign_id
        )
        run_id = new_id("run_")
        async with self.engine.begin() as conn:
            if (await conn.execute(found)).first() is None:
                return None
            await conn.execute(
                sa.insert(campaign_runs).values(
                    id=run_id,
                    campaign_id=campaign_id,
                    workspace=workspace,
                    status="queued",
                    created_at=utcnow(),
                )
            )
        return run_id

    # -- users and sessions (the settings UI) ----------------------------------------------

    async def get_user_by_email(self, email: str) -> sa.RowMapping | None:
        """The user with this (lower-cased) e-mail address, or None."""
        statement = sa.select(users).where(users.c.email == email)
        async with self.engine.connect() as conn:
            row = (await conn.execute(statement)).first()
        return None if row is None else row._mapping

    async def save_user(self, workspace: str, email: str, password_hash: str) -> str:
        """Create the user, or move it to `workspace` with a new hash; return its id.

        Its sessions end when its hash changes: a new password logs everyone out.
        """
        now = utcnow()
        statement = (
            self._insert(users)
            .values(
                id=new_id("u_"),
                workspace=workspace,
                email=email,
                password_hash=password_hash,
                created_at=now,
                updated_at=now,
            )
            .on_conflict_do_nothing(index_elements=["email"])
        )
        async with self.engine.begin() as conn:
            await conn.execute(statement)
            row = (await conn.execute(sa.select(users).where(users.c.email == email))).one()
            user_id: str = row.id
            if row.password_hash != password_hash:
                await conn.execute(sa.delete(sessions).where(sessions.c.user_id == user_id))
            if row.password_hash != password_hash or row.workspace != workspace:
                await conn.execute(
                    sa.update(users)
                    .where(users.c.id == user_id)
                    .values(workspace=workspace, password_hash=password_hash, updated_at=now)
                )
        return user_id

    async def create_session(self, session_hash: str, user_id: str, expires_at: datetime) -> None:
        """Store a new session (by its token's hash); sessions past their time are dropped."""
        now = utcnow()
        async with self.engine.begin() as conn:
            await conn.execute(sa.delete(sessions).where(sessions.c.expires_at <= now))
            await conn.execute(
                sa.insert(sessions).values(
                    id=session_hash, user_id=user_id, created_at=now, expires_at=expires_at
                )
            )

    async def session_user(self, session_hash: str) -> sa.RowMapping | None:
        """The user of an unexpired session: `id`, `email`, `workspace`; or None."""
        statement = (
            sa.select(users.c.id, users.c.email, users.c.workspace)
            .join(sessions, sessions.c.user_id == users.c.id)
            .where(sessions.c.id == session_hash, sessions.c.expires_at > utcnow())
        )
        async with self.engine.connect() as conn:
            row = (await conn.execute(statement)).first()
        return None if row is None else row._mapping

    async def delete_session(self, session_hash: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(sa.delete(sessions).where(sessions.c.id == session_hash))
