"""Where imported keys come from: a djangorestframework-api-key table, or a CSV file.

Each source yields `ForeignKey`s (a row apikeys may import) and `Refusal`s (a row it cannot
read, with why), in the source's order.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TextIO

from apikeys.errors import ConfigurationError
from apikeys.types import ENVIRONMENTS, LIVE, Environment

__all__ = [
    "DRF_TABLE",
    "MAX_CSV_LINE",
    "ForeignKey",
    "Refusal",
    "check_column",
    "check_table",
    "check_workspace_column",
    "read_csv",
    "read_drf",
]

DRF_TABLE: Final = "rest_framework_api_key_apikey"
"""The table djangorestframework-api-key keeps its keys in."""
CSV_COLUMNS: Final = (
    "name",
    "hash",
    "expires_at",
    "prefix",
    "created_at",
    "revoked",
    "environment",
    "identity",
)
_DRF_COLUMNS: Final = ("prefix", "hashed_key", "created", "name", "revoked", "expiry_date")
_IDENTIFIER: Final = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
_IDENTIFIER_RE: Final = re.compile(_IDENTIFIER)
_TABLE_RE: Final = re.compile(rf"(?:{_IDENTIFIER}\.)?{_IDENTIFIER}")
# The columns that hold a key's hash: never a workspace, which every list, audit event and
# webhook body shows.
MAX_CSV_LINE: Final = 1024 * 1024
"""The longest line of a CSV file read, in characters."""
_HASH_COLUMNS: Final = frozenset({"hash", "hashed_key"})


@dataclass(frozen=True, slots=True)
class ForeignKey:
    """One key of another system, as read: never the key, only its hash.

    `row` numbers it in its source (the CSV line, or the table row from 1); `prefix` is the
    old prefix that finds a key whose hash is salted (the part of the key before its `.`).
    """

    row: int
    name: str
    hashed: str
    prefix: str | None = None
    created_at: datetime | None = None
    expires_at: datetime | None = None
    revoked: bool = False
    workspace: str | None = None
    """The workspace named by the row (a workspace column), or None: the import's own."""
    environment: Environment = LIVE
    """`live` or `test` (the CSV's `environment` column; live when it is empty or absent)."""
    identity: str | None = None
    """The id of the identity the key is to belong to (the CSV's `identity` column, or the
    column `--identity-column` names); None when the row names none. It must be an
    identity of the key's workspace (`apikeys.importing.import_keys` checks)."""

    def __repr__(self) -> str:
        return f"ForeignKey(row={self.row}, name={self.name!r}, hashed='…')"


@dataclass(frozen=True, slots=True)
class Refusal:
    """A row that is not imported, and why (never a hash or a key in `reason`)."""

    row: int
    name: str | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"row": self.row, "name": self.name, "reason": self.reason}


def _moment(value: Any, column: str) -> datetime | None:
    """A time read from a table or a file: naive means UTC (Django's SQLite rows).

    Raises `ValueError` naming `column`, never the value: a file whose columns are out of
    order could hold a hash there."""
    if value is None or value == "":
        return None
    try:
        if isinstance(value, str):
            text = value.strip()
            moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
        elif isinstance(value, datetime):
            moment = value
        else:
            raise TypeError(type(value).__name__)
        return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    except (TypeError, ValueError, OverflowError):  # OverflowError: past year 9999 in UTC
        raise ValueError(
            f"unreadable time in {column} (ISO 8601, e.g. 2030-01-31T00:00:00Z)"
        ) from None


_REVOKED: Final = frozenset({"1", "true", "t", "yes", "y", "revoked"})
_NOT_REVOKED: Final = frozenset({"", "0", "false", "f", "no", "n"})


def _revoked(value: Any) -> bool:
    """Whether a row says its key is revoked. A text that is neither true nor false (a
    revocation time, say) raises `ValueError`: such a row is refused, never made active."""
    if value is None or isinstance(value, (bool, int)):
        return bool(value)
    text = str(value).strip().lower()
    if text in _REVOKED:
        return True
    if text in _NOT_REVOKED:
        return False
    raise ValueError("the revoked column is true or false (1 or 0, yes or no)")


def check_table(table: str) -> str:
    """`table` if it names a table apikeys may read from: an SQL identifier (letters,
    digits and `_`, not starting with a digit, at most 63 characters), optionally after
    a schema name and a `.`; else `ConfigurationError`. The name is then quoted, never
    pasted into a statement."""
    if not isinstance(table, str) or _TABLE_RE.fullmatch(table) is None:
        raise ConfigurationError(
            "the table is an SQL identifier (letters, digits and '_', not starting with a "
            "digit, at most 63 characters), optionally after a schema and a '.': "
            f"e.g. {DRF_TABLE} or billing.api_keys"
        )
    return table


def _environment(value: str | None) -> Environment:
    text = (value or "").strip().lower()
    if not text:
        return LIVE
    for environment in ENVIRONMENTS:
        if text == environment:
            return environment
    raise ValueError(f"the environment column is {' or '.join(ENVIRONMENTS)}")


def check_column(column: str, what: str = "workspace") -> str:
    """`column` if it is an SQL identifier a column of the source may have; else
    `ConfigurationError` (the name is quoted in the statement, never pasted). `what` names
    what the column gives each key (`workspace`, `identity`)."""
    if not isinstance(column, str) or _IDENTIFIER_RE.fullmatch(column) is None:
        raise ConfigurationError(
            f"the {what} column is an SQL identifier (letters, digits and '_', not "
            "starting with a digit, at most 63 characters)"
        )
    return check_workspace_column(column, what)


def check_workspace_column(column: str, what: str = "workspace") -> str:
    """`column` if it may name the keys' workspaces (or identities, `what`): any column but
    the one holding the keys' hashes (`hash`, `hashed_key`), since a workspace and an
    identity are shown everywhere and a hash never; else `ConfigurationError`."""
    if column.strip().lower() in _HASH_COLUMNS:
        raise ConfigurationError(
            f"the {what} column cannot be {column!r}: it holds the keys' hashes, and a "
            f"{what} is shown in every list, audit event and webhook"
        )
    return column


def _unreadable(url: str, table: str, exc: BaseException) -> ConfigurationError:
    """The error of a source that could not be read, naming the source (its URL without
    its password), never the destination store."""
    from apikeys.redaction import failure_reason, redact, safe_url

    where = safe_url(url)
    if isinstance(exc, OSError):  # DNS, refused, timed out: the server was not reached
        return ConfigurationError(
            f"import source unreachable: {where}: {redact(failure_reason(exc), url)}"
        )
    reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    detail = redact(reason[0], url) if reason else type(exc).__name__
    return ConfigurationError(f"could not read {table} from the import source {where}: {detail}")


def _drf_query(table: str, extra: list[str]) -> Any:
    """The statement reading the keys of `table` (and the `extra` columns, after the
    model's own), with its names quoted by SQLAlchemy."""
    import sqlalchemy as sa

    schema, _, name = table.rpartition(".")
    names = list(dict.fromkeys([*_DRF_COLUMNS, *extra]))
    source = sa.table(name, *(sa.column(column) for column in names), schema=schema or None)
    return sa.select(*(source.c[column] for column in names)).order_by(
        source.c.created, source.c.prefix
    )


async def read_drf(
    url: str,
    *,
    table: str = DRF_TABLE,
    workspace_column: str | None = None,
    identity_column: str | None = None,
) -> list[ForeignKey | Refusal]:
    """Every row of djangorestframework-api-key's table in the database at `url`
    (`sqlite:///path` or `postgresql://…`), oldest first.

    `table` reads a custom `AbstractAPIKey` model's table instead (an SQL identifier,
    `check_table`); `workspace_column` gives each key the workspace named by that column of
    its row (`ForeignKey.workspace`), and `identity_column` the identity whose id that
    column holds (`ForeignKey.identity`; empty or NULL: none). A source that cannot be
    reached or read raises `ConfigurationError` naming it, with its password hidden.
    """
    check_table(table)
    if workspace_column is not None:
        check_column(workspace_column)
    if identity_column is not None:
        check_column(identity_column, "identity")
    columns = [column for column in (workspace_column, identity_column) if column is not None]
    try:
        import sqlalchemy as sa
        from sqlalchemy.ext.asyncio import create_async_engine

        from apikeys.redaction import hide_values_in_driver_logs
        from apikeys.stores.sql.engine import async_url
    except ImportError as exc:
        raise ConfigurationError(
            f"reading a database needs SQLAlchemy: pip install 'apikeys[import]' ({exc.name})"
        ) from exc
    try:
        hide_values_in_driver_logs()
        # The rows read are hashes: none in an error or the echo log.
        engine = create_async_engine(async_url(url), hide_parameters=True)
    except ModuleNotFoundError as exc:
        extra = "postgres" if exc.name == "asyncpg" else "sql"
        raise ConfigurationError(
            f"reading that database needs {exc.name}: pip install 'apikeys[{extra}]'"
        ) from exc
    try:
        async with engine.connect() as connection:
            rows = (await connection.execute(_drf_query(table, columns))).all()
    except (sa.exc.SQLAlchemyError, OSError) as exc:
        raise _unreadable(url, table, exc) from None
    finally:
        await engine.dispose()
    return [
        _drf_row(number, row._mapping, workspace_column, identity_column)
        for number, row in enumerate(rows, start=1)
    ]


def _drf_row(
    number: int, row: Any, workspace_column: str | None, identity_column: str | None
) -> ForeignKey | Refusal:
    prefix, hashed, created, name, revoked, expiry = (row[column] for column in _DRF_COLUMNS)
    try:
        return ForeignKey(
            row=number,
            name=str(name or ""),
            hashed=str(hashed or ""),
            prefix=str(prefix or ""),
            created_at=_moment(created, "created"),
            expires_at=_moment(expiry, "expiry_date"),
            revoked=_revoked(revoked),
            workspace=None
            if workspace_column is None
            else _workspace(row[workspace_column], workspace_column),
            identity=None if identity_column is None else _identity(row[identity_column]),
        )
    except ValueError as exc:
        return Refusal(number, str(name) if name else None, str(exc))


def _workspace(value: Any, column: str) -> str:
    """The workspace a row's `column` names (`ValueError` when it names none)."""
    text = "" if value is None else str(value).strip()
    if not text:
        raise ValueError(f"the workspace column {column} is empty: the key has no workspace")
    return text


def _identity(value: Any) -> str | None:
    """The identity id a row's column holds; None when it is empty (the key has none)."""
    text = "" if value is None else str(value).strip()
    return text or None


def read_csv(
    path: str | Path, *, workspace_column: str | None = None, identity_column: str | None = None
) -> Iterator[ForeignKey | Refusal]:
    """The rows of a CSV file with a header line: `name,hash` and optionally `expires_at`,
    `prefix`, `created_at`, `revoked`, `environment` and `identity` (times in ISO 8601,
    naive means UTC; the environment `live` or `test`, live when empty; the id of the
    identity the key belongs to, none when empty).

    `identity_column` reads the identity from that column instead of `identity` (then the
    header line must have it).

    `workspace_column` gives each key the workspace named by that column of its row
    (`ForeignKey.workspace`). Raises `ConfigurationError` when the file cannot be read or
    lacks `name`, `hash` or the workspace column, or when the workspace column is `hash`.
    """
    if workspace_column is not None:
        check_workspace_column(workspace_column)
    if identity_column is not None:
        check_workspace_column(identity_column, "identity")
    try:
        # utf-8-sig: UTF-8, with or without the byte order mark spreadsheets write.
        handle = Path(path).open(newline="", encoding="utf-8-sig")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.DictReader(_lines(handle, path))
        try:
            # The header is read here, and with it the file's first block: a file that is
            # not UTF-8 or not CSV fails here as often as in its rows.
            columns = [column.strip() for column in reader.fieldnames or ()]
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{path}: not a readable CSV file: {exc}") from None
        wanted = (
            "name",
            "hash",
            *([workspace_column] if workspace_column else []),
            *([identity_column] if identity_column else []),
        )
        missing = [column for column in wanted if column not in columns]
        if missing:
            raise ConfigurationError(
                f"{path}: the header line lacks {', '.join(missing)} "
                f"(columns: {', '.join(CSV_COLUMNS)})"
            )
        reader.fieldnames = columns
        try:
            for fields in reader:
                yield _csv_row(
                    reader.line_num, fields, workspace_column, identity_column or "identity"
                )
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{path}: not a readable CSV file: {exc}") from None


def _lines(handle: TextIO, path: str | Path) -> Iterator[str]:
    """The file's lines, each read within `MAX_CSV_LINE` characters: a file of one endless
    line (or `/dev/zero`) is refused as it is read, never held whole in memory. The csv
    module bounds a field (a quoted one may span lines) by itself."""
    number = 0
    while line := handle.readline(MAX_CSV_LINE + 1):
        number += 1
        if len(line) > MAX_CSV_LINE:
            raise ConfigurationError(
                f"{path}: not a readable CSV file: line {number} is longer than "
                f"{MAX_CSV_LINE} characters"
            )
        yield line


def _csv_row(
    row: int, fields: dict[str, str | None], workspace_column: str | None, identity_column: str
) -> ForeignKey | Refusal:
    """One CSV row read: its key, or why it cannot be imported."""
    name = (fields.get("name") or "").strip()
    try:
        return ForeignKey(
            row=row,
            name=name,
            hashed=(fields.get("hash") or "").strip(),
            prefix=(fields.get("prefix") or "").strip() or None,
            created_at=_moment(fields.get("created_at"), "created_at"),
            expires_at=_moment(fields.get("expires_at"), "expires_at"),
            revoked=_revoked(fields.get("revoked")),
            environment=_environment(fields.get("environment")),
            workspace=None
            if workspace_column is None
            else _workspace(fields.get(workspace_column), workspace_column),
            identity=_identity(fields.get(identity_column)),
        )
    except ValueError as exc:
        return Refusal(row, name or None, str(exc))
