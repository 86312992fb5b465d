"""How the Redis store writes a key: its hash's fields, times as integer microseconds, the
audit list's lines; and the store's Lua scripts (`scripts/*.lua`). Shared by the key store and
the webhook store of this folder.

Layout, for the default `key_prefix` of `apikeys:`. Every Redis key that belongs to one API
key carries its id as a hash tag, `{<id>}`, so all of them live in one Redis Cluster slot
and every script names keys of that slot only:

- `apikeys:key:{<id>}`: a hash per key.
- `apikeys:used:{<id>}`: the key's requests counted since it was written (`request_count`,
  `last_used_at`; a hash). Apart from the key's hash so that counting is no change of the
  key: key caches hear of every write to the key's hash (see `channel.py`). A read adds the
  two (`decode`); the key's hash holds the counts it was made or imported with.
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

Hash fields carry the `KeyRecord` field names plus `secret_hash`, each written as its kind
in `apikeys.types.RECORD_FIELDS` says: datetimes as integer microseconds since the Unix
epoch (exact, and comparable inside Lua), decoded to timezone-aware UTC datetimes; lists
(`scopes`, `allowed_ips`) as JSON arrays; metadata as canonical JSON; counts as decimal
text. An absent field (`rate_limit`, `expires_at`, `owner`, …) has its default.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import cache
from importlib import resources
from typing import Any, Final

from apikeys.errors import StoreUnavailable
from apikeys.lifecycle import TRANSITIONS
from apikeys.policies import dump_metadata, load_metadata
from apikeys.types import RECORD_FIELDS, AuditEvent, KeyRecord, Kind, StoredKey

__all__ = [
    "audit_line",
    "decode",
    "decode_scopes",
    "decode_time",
    "encode",
    "encode_field",
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
    """A script of `scripts/`; change scripts start with `EDITABLE` and `common.lua`."""
    folder = resources.files("apikeys.stores.redis") / "scripts"
    text = (folder / f"{name}.lua").read_text(encoding="utf-8")
    if name in ("insert", "set_state", "shorten_expiry", "update", "replace_hash"):
        text = _editable() + (folder / "common.lua").read_text(encoding="utf-8") + text
    return text


def _editable() -> str:
    """The states whose keys may have fields edited (`update`, a roll's link and expiry), as
    a Lua set made from `apikeys.lifecycle.TRANSITIONS`: the scripts read the one table."""
    states = ", ".join(f"{state} = true" for state in TRANSITIONS["update"].sources)
    return f"local EDITABLE = {{{states}}}\n"


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


# How each kind of field (`Kind`) is written in a key's hash, and read back.
_ENCODERS: Final[Mapping[Kind, Callable[[Any], str]]] = {
    Kind.TEXT: str,
    Kind.NAMES: encode_list,
    Kind.TIME: encode_time,
    Kind.COUNT: str,
    Kind.OBJECT: dump_metadata,
}
_DECODERS: Final[Mapping[Kind, Callable[[str], Any]]] = {
    Kind.TEXT: str,
    Kind.NAMES: decode_scopes,
    Kind.TIME: decode_time,
    Kind.COUNT: int,
    Kind.OBJECT: load_metadata,
}
_EMPTY_IS_DEFAULT: Final = frozenset({Kind.NAMES, Kind.TIME, Kind.OBJECT})
_FIELDS: Final = {field.name: field for field in RECORD_FIELDS}
_READ: Final = tuple(
    (field, interned if field.shared else _DECODERS[field.kind]) for field in RECORD_FIELDS
)


def encode_field(name: str, value: Any) -> str | None:
    """A field of `KeyRecord` as its key's hash holds it; None: the field is deleted (a
    None, or empty metadata)."""
    field = _FIELDS[name]
    if value is None or (field.kind is Kind.OBJECT and not value):
        return None
    return _ENCODERS[field.kind](value)


def encode(stored: StoredKey) -> list[str]:
    """The hash fields of a key, as a flat field/value list: every field of
    `RECORD_FIELDS` a key must have, the others unless they hold their default (no
    expiry, no owner, no allowlist …), and `secret_hash`."""
    record = stored.record
    flat: list[str] = []
    for field in RECORD_FIELDS:
        value = getattr(record, field.name)
        if not field.required and (value is None or value == field.empty()):
            continue
        text = encode_field(field.name, value)
        if text is not None:
            flat += [field.name, text]
    return [*flat, "secret_hash", stored.secret_hash]


def decode(fields: Mapping[str, str], used: Mapping[str, str] | None = None) -> StoredKey:
    """A key's hash as the store wrote it, with its use hash's counts (`used`) added to the
    hash's own (those it was imported with): `request_count` the sum, `last_used_at` the
    later. A hash that another client damaged (a field deleted or overwritten by hand, a
    time out of range) fails closed: `StoreUnavailable`, never another error."""
    try:
        if used:
            fields = _with_use(fields, used)
        return _decode_fields(fields)
    except (KeyError, ValueError, TypeError, AssertionError, OverflowError) as exc:
        raise StoreUnavailable(
            exc, hint="a key's hash in Redis is damaged: a field is missing or malformed"
        ) from None


def _with_use(fields: Mapping[str, str], used: Mapping[str, str]) -> dict[str, str]:
    merged = dict(fields)
    count = used.get("request_count")
    if count is not None:
        merged["request_count"] = str(int(fields.get("request_count") or 0) + int(count))
    last = used.get("last_used_at")
    if last is not None:
        own = fields.get("last_used_at")
        merged["last_used_at"] = last if not own or int(last) > int(own) else own
    return merged


def _decode_fields(fields: Mapping[str, str]) -> StoredKey:
    values: list[Any] = []
    for field, decode_value in _READ:
        text = fields.get(field.name)
        # A field left out (or a list, time or object written empty) has its default; an
        # empty count is damage, never "unlimited".
        if text is None or (text == "" and field.kind in _EMPTY_IS_DEFAULT):
            value = field.empty()
        else:
            value = decode_value(text)
        if value is None and field.required:
            raise ValueError(f"{field.name} is empty")
        values.append(value)
    return StoredKey(record=KeyRecord(*values), secret_hash=fields["secret_hash"])


def pairs(flat: Sequence[str]) -> dict[str, str]:
    """A flat `[field, value, ...]` script reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))
