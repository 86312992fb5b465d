"""Listing keys a page at a time: filters, one stable order, and opaque cursors.

Keys are listed oldest first, by `(created_at, id)`. Neither field of a key ever changes, so
a key's place in this order is fixed for its life, and a cursor that names the last key of a
page by that pair says exactly where the next page starts (keyset pagination): no offset
that shifts when keys are created or revoked between pages.

What a walk through the pages guarantees (one filter, any page size):

- No key appears twice, and the keys come in order.
- A key that exists and matches the filter for the whole walk appears exactly once.
- A key created during the walk appears if it sorts after the page being read (a new key
  normally does: it is the newest), and never before the position already read.
- A key that starts or stops matching during the walk (a `status` filter and a revoke, say)
  appears if it matched when its page was read.

A cursor is the position only, base64url text: it holds a key's id (public, shown in every
list) and a creation time, never a secret, and it is not tied to the filter it came with.
Identities are listed the same way (`IdentityPage`, their `(created_at, id)`). Webhook
deliveries are listed newest first, by a number their store keeps and their id
(`DeliveryPosition`); their cursors are made and read by the same two functions.

The audit trail is read a page at a time from its newest end (`AuditPage`): the first page
holds the newest events, and each `next_cursor` the events before them. The trail only
grows at its newest end, so an event's place counted from the oldest is fixed: a trail
cursor (`encode_trail_cursor`) is that count, the number of older events still to read.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol, get_args

from apikeys.errors import InvalidKeyParameters
from apikeys.identities import IdentityRecord, check_identity_id
from apikeys.policies import check_owner, check_text
from apikeys.types import ENVIRONMENTS, AuditEvent, Environment, KeyRecord, Status

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "MAX_PAGE_SIZE",
    "STATUSES",
    "AuditPage",
    "DeliveryPosition",
    "IdentityPage",
    "KeyFilter",
    "KeyPage",
    "Position",
    "Sorted",
    "after",
    "check_page_size",
    "decode_cursor",
    "decode_delivery_cursor",
    "decode_trail_cursor",
    "encode_cursor",
    "encode_trail_cursor",
    "position",
]

DEFAULT_PAGE_SIZE: Final = 50
"""Keys per page when no `limit` is given."""
MAX_PAGE_SIZE: Final = 1000
"""The largest page `KeyManager.list_page` returns; a larger `limit` is refused."""

STATUSES: Final[tuple[Status, ...]] = get_args(Status)
"""The statuses a listing filters by: `active`, `disabled`, `revoked`, `expired`."""

Position = tuple[datetime, str]
"""Where a key sorts: its `(created_at, id)`."""

DeliveryPosition = tuple[int, str]
"""Where a webhook delivery sorts, newest first: its `(order, id)` (`Delivery.order`)."""


class Sorted(Protocol):
    """What a listing sorts by: a key's or an identity's `(created_at, id)`."""

    @property
    def created_at(self) -> datetime: ...

    @property
    def id(self) -> str: ...


_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_VERSION: Final = "1"
# Ids are base62 (12 characters) for keys made here; imported ones may differ, so any
# printable ASCII id up to 64 characters is taken back.
_CURSOR: Final = re.compile(r"1\.(-?[0-9]{1,19})\.([!-~]{1,64})")
_BAD_CURSOR: Final = "invalid cursor: pass the next_cursor of a previous page unchanged"
# A delivery's order is a 64-bit integer in every store (a SQL BIGINT).
_ORDERS: Final = range(-(2**63), 2**63)
_TRAIL_CURSOR: Final = re.compile(r"t1\.([1-9][0-9]{0,17})")


@dataclass(frozen=True, slots=True)
class KeyFilter:
    """Which keys a listing returns: every field that is not None must match."""

    workspace: str | None = None
    owner: str | None = None
    status: Status | None = None
    environment: Environment | None = None
    identity: str | None = None

    def __post_init__(self) -> None:
        # Text no store can hold (a lone surrogate from bytes that were not UTF-8, a control
        # character) names no key: refused as the bad parameter it is, not a store error.
        if self.workspace is not None:
            check_text(self.workspace, "workspace")
        if self.owner is not None:
            check_owner(self.owner)
        if self.status is not None and self.status not in STATUSES:
            raise InvalidKeyParameters(
                f"invalid status {self.status!r}: one of {', '.join(STATUSES)}"
            )
        if self.identity is not None:
            check_identity_id(self.identity)
        if self.environment is not None and self.environment not in ENVIRONMENTS:
            raise InvalidKeyParameters(
                f"invalid environment {str(self.environment)[:20]!r}: "
                f"one of {', '.join(ENVIRONMENTS)}"
            )

    @property
    def narrowed(self) -> bool:
        """Whether it leaves out keys of its workspace (or of all workspaces)."""
        return (
            self.owner is not None
            or self.status is not None
            or self.environment is not None
            or self.identity is not None
        )

    def matches(self, record: KeyRecord, now: datetime) -> bool:
        """Whether `record` passes the filter; `expired` is decided at `now`."""
        return (
            (self.workspace is None or record.workspace == self.workspace)
            and (self.owner is None or record.owner == self.owner)
            and (self.status is None or record.status_at(now) == self.status)
            and (self.environment is None or record.environment == self.environment)
            and (self.identity is None or record.identity == self.identity)
        )


@dataclass(frozen=True, slots=True)
class KeyPage:
    """One page of a listing: its records, oldest first, and the cursor of the next page
    (None on the last page)."""

    records: Sequence[KeyRecord]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class IdentityPage:
    """One page of identities, oldest first, and the cursor of the next page (None on the
    last page)."""

    records: Sequence[IdentityRecord]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class AuditPage:
    """One page of the audit trail, oldest first (newest last), and the cursor of the page
    of the events before it (None when there are none)."""

    events: Sequence[AuditEvent]
    next_cursor: str | None


def position(record: Sorted) -> Position:
    """Where `record` sorts in every listing."""
    return record.created_at, record.id


def after(record: Sorted, start: Position | None) -> bool:
    """Whether `record` sorts after `start` (everything does when `start` is None)."""
    return start is None or (_micros(record.created_at), record.id) > (
        _micros(start[0]),
        start[1],
    )


def _micros(moment: datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1)


def encode_cursor(start: Position | DeliveryPosition) -> str:
    """The opaque cursor of the page that starts after `start`: a key's or an identity's
    position, or a webhook delivery's."""
    first, ident = start
    number = first if isinstance(first, int) else _micros(first)
    text = f"{_VERSION}.{number}.{ident}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decoded(cursor: str) -> tuple[int, str]:
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 200:
        raise InvalidKeyParameters(_BAD_CURSOR)
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        text = raw.decode("ascii")
    except (binascii.Error, ValueError):
        raise InvalidKeyParameters(_BAD_CURSOR) from None
    found = _CURSOR.fullmatch(text)
    if found is None:
        raise InvalidKeyParameters(_BAD_CURSOR)
    return int(found.group(1)), found.group(2)


def decode_cursor(cursor: str) -> Position:
    """The position `cursor` names; `InvalidKeyParameters` for anything not made by
    `encode_cursor`."""
    micros, ident = _decoded(cursor)
    try:
        created_at = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise InvalidKeyParameters(_BAD_CURSOR) from None
    return created_at, ident


def decode_delivery_cursor(cursor: str) -> DeliveryPosition:
    """The delivery's position `cursor` names; `InvalidKeyParameters` for anything not
    made by `encode_cursor`."""
    order, ident = _decoded(cursor)
    if order not in _ORDERS:
        raise InvalidKeyParameters(_BAD_CURSOR)
    return order, ident


def check_page_size(limit: object) -> int:
    """`limit` checked: a whole number from 1 to `MAX_PAGE_SIZE`."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE_SIZE:
        raise InvalidKeyParameters(
            f"invalid page size {limit!r}: a whole number from 1 to {MAX_PAGE_SIZE}"
        )
    return limit


def encode_trail_cursor(older: int) -> str:
    """The opaque cursor of the audit page that ends before the `older`-th event of the
    trail, counted from its oldest (`older` > 0)."""
    return base64.urlsafe_b64encode(f"t1.{older}".encode()).decode().rstrip("=")


def decode_trail_cursor(cursor: str) -> int:
    """The count `cursor` names; `InvalidKeyParameters` for anything not made by
    `encode_trail_cursor`."""
    if not isinstance(cursor, str) or not 0 < len(cursor) <= 40:
        raise InvalidKeyParameters(_BAD_CURSOR)
    try:
        text = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except (binascii.Error, ValueError):
        raise InvalidKeyParameters(_BAD_CURSOR) from None
    found = _TRAIL_CURSOR.fullmatch(text)
    if found is None:
        raise InvalidKeyParameters(_BAD_CURSOR)
    return int(found.group(1))
