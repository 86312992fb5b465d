"""How the Redis store writes a key: its hash's fields, times as integer microseconds, the
audit list's lines; and the store's Lua scripts (`scripts/*.lua`). Shared by the key store and
the webhook store of this folder.

Layout, for the default `key_prefix` of `apikeys:`. Every Redis key that belongs to one API
key carries its id as a hash tag, `{<id>}`, so all of them live in one Redis Cluster slot
and every script names keys of that slot only:

- `apikeys:key:{<id>}`: a hash per key.
- `apikeys:audit:{<id>}`: the key's audit events, oldest first (a list), each one as the
  server's time in microseconds, a space, and the event's JSON.
- `apikeys:events:{<id>}`: the key's webhook events not taken yet (a list; see
  `apikeys.stores.redis.webhooks`), appended by the change scripts.
- `apikeys:usage:{<id>}:<YYYY-MM-DD>`: the key's requests on one UTC day, by outcome (a hash,
  kept `DAILY_USAGE_RETENTION_DAYS`).
- `apikeys:usage-batch:<batch_id>` (on a cluster, `apikeys:usage-batch:{<id>}:<batch_id>`,
  one per key of the batch): a string per usage batch applied in the last
  `USAGE_BATCH_RETENTION` (24 hours, its TTL), so that a batch sent again is skipped.

and, across keys:

- `apikeys:ws:<workspace>`: a sorted set of the workspace's ids, scored by `created_at` (in
  microseconds; `list_page` reads it by rank from the cursor's id on).
- `apikeys:all`: a sorted set of every id, scored by `created_at` (for `list(None)`).
- `apikeys:setting:<name>`: a string per setting (`claim_setting`), such as the pepper's
  fingerprint.
- `apikeys:once:<token>`: a one-time value (`put_once`), with its TTL; `take_once` reads
  and deletes it in one script.
- `apikeys:events-pending`: the ids whose outbox may hold events (a sorted set), and
  `apikeys:{webhooks}:…`, endpoints and deliveries (`apikeys.stores.redis.webhooks`).

The audit trail across keys is read from the per-key lists of the ids an index names. This
is the first layout (0.1.0): no other is read.

Hash fields carry the `KeyRecord` field names plus `secret_hash`. Datetimes are stored as
integer microseconds since the Unix epoch (exact, and comparable inside Lua); they decode to
timezone-aware UTC datetimes. `scopes` is a JSON array; absent fields (`rate_limit`,
`expires_at`, `last_used_at`, `revoked_at`) mean None.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import cast

from apikeys.errors import StoreUnavailable
from apikeys.policies import dump_metadata, load_metadata
from apikeys.types import Access, AuditEvent, KeyRecord, StoredKey, StoredState

__all__ = [
    "audit_line",
    "decode",
    "decode_scopes",
    "decode_time",
    "encode",
    "encode_list",
    "encode_time",
    "event_text",
    "interned",
    "pairs",
    "script",
]

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


@cache
def script(name: str) -> str:
    """A script of `scripts/`; change scripts start with `common.lua`."""
    folder = resources.files("apikeys.stores.redis") / "scripts"
    text = (folder / f"{name}.lua").read_text(encoding="utf-8")
    if name in ("insert", "set_state", "shorten_expiry", "update", "replace_hash"):
        text = (folder / "common.lua").read_text(encoding="utf-8") + text
    return text


def encode_time(moment: datetime) -> str:
    """Integer microseconds since the epoch; a naive datetime is taken as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return str((moment - _EPOCH) // _MICROSECOND)


def decode_time(value: str | None) -> datetime | None:
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(microseconds=int(value))


def interned(text: str | None) -> str | None:
    """`text` interned: the values many keys hold alike (workspace, access, state, limits)
    are kept once, not once per cached key, as Redis returns them."""
    return text if text is None else sys.intern(text)


@functools.lru_cache(maxsize=4096)
def decode_scopes(value: str) -> tuple[str, ...]:
    """Kept for the 4,096 texts read last: keys with the same scopes share one tuple."""
    if value.startswith("["):
        return tuple(str(scope) for scope in json.loads(value))
    return tuple(scope for scope in value.split(",") if scope)


def audit_line(line: str) -> tuple[int, AuditEvent]:
    """An audit list entry, `<server µs> <event>`: the time it was stored, and the event."""
    stamp, _, text = line.partition(" ")
    return int(stamp), AuditEvent.decode(text)


def event_text(event: AuditEvent | None) -> str:
    return "" if event is None else event.encode()


def encode_list(values: tuple[str, ...]) -> str:
    return json.dumps(list(values), separators=(",", ":"))


def encode(stored: StoredKey) -> list[str]:
    """The hash fields of a key, as a flat field/value list."""
    record = stored.record
    fields: dict[str, str] = {
        "id": record.id,
        "name": record.name,
        "workspace": record.workspace,
        "prefix": record.prefix,
        "access": record.access,
        "scopes": encode_list(record.scopes),
        "state": record.state,
        "created_at": encode_time(record.created_at),
        "request_count": str(record.request_count),
        "secret_hash": stored.secret_hash,
    }
    for name, text in (
        ("rate_limit", record.rate_limit),
        ("replaces", record.replaces),
        ("replaced_by", record.replaced_by),
        ("owner", record.owner),
        ("credit_refill", record.credit_refill),
        ("metadata", dump_metadata(record.metadata) if record.metadata else None),
        ("allowed_ips", encode_list(record.allowed_ips) if record.allowed_ips else None),
        ("credits", None if record.credits is None else str(record.credits)),
    ):
        if text is not None:
            fields[name] = text
    for name, moment in (
        ("expires_at", record.expires_at),
        ("last_used_at", record.last_used_at),
        ("revoked_at", record.revoked_at),
        ("credits_refilled_at", record.credits_refilled_at),
    ):
        if moment is not None:
            fields[name] = encode_time(moment)
    return [item for pair in fields.items() for item in pair]


def decode(fields: Mapping[str, str]) -> StoredKey:
    """A key's hash as the store wrote it. A hash that another client damaged (a field
    deleted or overwritten by hand) fails closed: `StoreUnavailable`, never another error."""
    try:
        return _decode_fields(fields)
    except (KeyError, ValueError, TypeError, AssertionError) as exc:
        raise StoreUnavailable(
            exc, hint="a key's hash in Redis is damaged: a field is missing or malformed"
        ) from None


def _decode_fields(fields: Mapping[str, str]) -> StoredKey:
    created_at = decode_time(fields["created_at"])
    assert created_at is not None
    record = KeyRecord(
        id=fields["id"],
        name=fields["name"],
        workspace=sys.intern(fields["workspace"]),
        prefix=fields["prefix"],
        access=cast(Access, sys.intern(fields["access"])),
        scopes=decode_scopes(fields["scopes"]),
        state=cast(StoredState, sys.intern(fields["state"])),
        rate_limit=interned(fields.get("rate_limit")),
        created_at=created_at,
        expires_at=decode_time(fields.get("expires_at")),
        last_used_at=decode_time(fields.get("last_used_at")),
        request_count=int(fields.get("request_count") or 0),
        revoked_at=decode_time(fields.get("revoked_at")),
        replaces=fields.get("replaces"),
        replaced_by=fields.get("replaced_by"),
        owner=fields.get("owner"),
        metadata=load_metadata(fields.get("metadata")),
        allowed_ips=decode_scopes(fields.get("allowed_ips") or "[]"),
        credits=None if fields.get("credits") is None else int(fields["credits"]),
        credit_refill=interned(fields.get("credit_refill")),
        credits_refilled_at=decode_time(fields.get("credits_refilled_at")),
    )
    return StoredKey(record=record, secret_hash=fields["secret_hash"])


def pairs(flat: Sequence[str]) -> dict[str, str]:
    """A flat `[field, value, ...]` script reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
