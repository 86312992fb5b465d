"""Where imported keys come from: a djangorestframework-api-key table, or a CSV file.

Each source yields `ForeignKey`s (a row apikeys may import) and `Refusal`s (a row it cannot
read, with why), in the source's order.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from apikeys.errors import ConfigurationError

__all__ = ["DRF_TABLE", "ForeignKey", "Refusal", "read_csv", "read_drf"]

DRF_TABLE: Final = "rest_framework_api_key_apikey"
"""The table djangorestframework-api-key keeps its keys in."""
CSV_COLUMNS: Final = ("name", "hash", "expires_at", "prefix", "created_at", "revoked")


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


async def read_drf(url: str) -> list[ForeignKey | Refusal]:
    """Every row of djangorestframework-api-key's table in the database at `url`
    (`sqlite:///path` or `postgresql://…`), oldest first."""
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
    query = sa.text(
        "SELECT prefix, hashed_key, created, name, revoked, expiry_date "  # noqa: S608
        f"FROM {DRF_TABLE} ORDER BY created, prefix"
    )
    try:
        async with engine.connect() as connection:
            rows = (await connection.execute(query)).all()
    except sa.exc.SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        raise ConfigurationError(
            f"could not read {DRF_TABLE}: {reason[0] if reason else type(exc).__name__}"
        ) from None
    finally:
        await engine.dispose()
    found: list[ForeignKey | Refusal] = []
    for number, (prefix, hashed, created, name, revoked, expiry) in enumerate(rows, start=1):
        try:
            found.append(
                ForeignKey(
                    row=number,
                    name=str(name or ""),
                    hashed=str(hashed or ""),
                    prefix=str(prefix or ""),
                    created_at=_moment(created, "created"),
                    expires_at=_moment(expiry, "expiry_date"),
                    revoked=_revoked(revoked),
                )
            )
        except ValueError as exc:
            found.append(Refusal(number, str(name) if name else None, str(exc)))
    return found


def read_csv(path: str | Path) -> Iterator[ForeignKey | Refusal]:
    """The rows of a CSV file with a header line: `name,hash` and optionally `expires_at`,
    `prefix`, `created_at` and `revoked` (times in ISO 8601; naive means UTC).

    Raises `ConfigurationError` when the file cannot be read or lacks `name` or `hash`.
    """
    try:
        # utf-8-sig: UTF-8, with or without the byte order mark spreadsheets write.
        handle = Path(path).open(newline="", encoding="utf-8-sig")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.DictReader(handle)
        try:
            # The header is read here, and with it the file's first block: a file that is
            # not UTF-8 or not CSV fails here as often as in its rows.
            columns = [column.strip() for column in reader.fieldnames or ()]
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{path}: not a readable CSV file: {exc}") from None
        missing = [column for column in ("name", "hash") if column not in columns]
        if missing:
            raise ConfigurationError(
                f"{path}: the header line lacks {', '.join(missing)} "
                f"(columns: {', '.join(CSV_COLUMNS)})"
            )
        reader.fieldnames = columns
        try:
            for fields in reader:
                row = reader.line_num
                name = (fields.get("name") or "").strip()
                try:
                    yield ForeignKey(
                        row=row,
                        name=name,
                        hashed=(fields.get("hash") or "").strip(),
                        prefix=(fields.get("prefix") or "").strip() or None,
                        created_at=_moment(fields.get("created_at"), "created_at"),
                        expires_at=_moment(fields.get("expires_at"), "expires_at"),
                        revoked=_revoked(fields.get("revoked")),
                    )
                except ValueError as exc:
                    yield Refusal(row, name or None, str(exc))
        except (csv.Error, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"{path}: not a readable CSV file: {exc}") from None
