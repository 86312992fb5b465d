"""Revocations written back to djangorestframework-api-key while a migration lasts.

While both services answer (some clients still call the old one), a key revoked in apikeys
must be refused by the old service too. `write_revocations` marks `revoked = true` on the
old table's row of every key imported from it into a workspace and revoked in apikeys since.
It is the one write apikeys makes to the old table, run by the operator
(`apikeys sync-revocations`, after a revoke or on a schedule), and it only ever revokes:
drf-api-key's revocation is irreversible, as apikeys' is.

An imported key's record does not name its old prefix (its id is derived from it, under the
store's secret: `apikeys.importing.foreign`), so each old row's prefix is looked up the way
a request looks it up: the ids of its lookup handle, and the workspace's key among them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from apikeys.errors import ConfigurationError
from apikeys.importing.foreign import lookup_ids, prefix_handle
from apikeys.importing.sources import DRF_TABLE
from apikeys.types import REVOKED

if TYPE_CHECKING:
    from apikeys.manager import KeyManager

__all__ = ["RevocationReport", "write_revocations"]

# A table name as Django writes them: an SQL identifier, quoted by nobody.
_TABLE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


@dataclass(frozen=True, slots=True)
class RevocationReport:
    """What `write_revocations` did: the apikeys ids whose old rows it marked revoked
    (`revoked`, never an old prefix or key), and how many rows it read (`checked`)."""

    revoked: list[str] = field(default_factory=list)
    checked: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"revoked": list(self.revoked), "checked": self.checked, "dry_run": self.dry_run}


def _engine(url: str) -> Any:
    try:
        from sqlalchemy.ext.asyncio import create_async_engine

        from apikeys.redaction import hide_values_in_driver_logs
        from apikeys.stores.sql.engine import async_url
    except ImportError as exc:
        raise ConfigurationError(
            f"writing a database needs SQLAlchemy: pip install 'apikeys[import]' ({exc.name})"
        ) from exc
    try:
        hide_values_in_driver_logs()
        return create_async_engine(async_url(url), hide_parameters=True)
    except ModuleNotFoundError as exc:
        extra = "postgres" if exc.name == "asyncpg" else "sql"
        raise ConfigurationError(
            f"writing that database needs {exc.name}: pip install 'apikeys[{extra}]'"
        ) from exc


async def _revoked_here(manager: KeyManager, secret: str, prefix: str, workspace: str) -> str:
    """The id of `workspace`'s key imported under the old `prefix` when it is revoked in
    apikeys; "" otherwise (not imported there, or still usable)."""
    for key_id in lookup_ids(secret, prefix_handle(prefix)):
        stored = await manager.store.get(key_id)
        if stored is not None and stored.record.workspace == workspace:
            return key_id if stored.record.state == REVOKED else ""
    return ""


async def write_revocations(
    manager: KeyManager,
    url: str,
    *,
    workspace: str = "default",
    table: str = DRF_TABLE,
    dry_run: bool = False,
) -> RevocationReport:
    """Mark revoked, in the djangorestframework-api-key table at `url` (`sqlite:///path` or
    `postgresql://…`; `table` for a custom `AbstractAPIKey` model's), the row of every key
    imported from it into `workspace` and revoked in apikeys. Rows revoked there already
    are left alone; nothing else of the table changes. `dry_run` reports without writing.
    """
    if _TABLE_RE.fullmatch(table) is None:
        raise ConfigurationError(f"table {table!r} is not a table name")
    secret = await manager.import_lookup_secret(create=False)
    if secret is None:  # this store holds no imported keys
        return RevocationReport(dry_run=dry_run)
    import sqlalchemy as sa

    engine = _engine(url)
    try:
        async with engine.begin() as connection:
            rows = await connection.execute(
                sa.text(f"SELECT prefix FROM {table} WHERE NOT revoked")  # noqa: S608
            )
            prefixes = [str(prefix) for (prefix,) in rows.all() if prefix]
            marked: dict[str, str] = {}
            for prefix in prefixes:
                key_id = await _revoked_here(manager, secret, prefix, workspace)
                if key_id:
                    marked[prefix] = key_id
            if marked and not dry_run:
                update = sa.text(
                    f"UPDATE {table} SET revoked = :yes WHERE prefix IN :prefixes"  # noqa: S608
                ).bindparams(sa.bindparam("prefixes", expanding=True))
                await connection.execute(update, {"yes": True, "prefixes": list(marked)})
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise ConfigurationError(
            f"could not write {table}: {reason[0] if reason else type(exc).__name__}"
        ) from None
    finally:
        await engine.dispose()
    return RevocationReport(sorted(marked.values()), len(prefixes), dry_run)
