"""The Redis store: one hash per key, sorted-set indexes, Lua scripts for every change.

Layout, for the default `key_prefix` of `apikeys:`:

- `apikeys:key:{<id>}`: a hash per key. The `{<id>}` hash tag puts each key in its own
  cluster slot, so every per-key script names exactly one key and stays cluster-safe.
- `apikeys:ws:<workspace>`: a sorted set of the workspace's ids, scored by `created_at`.
- `apikeys:all`: a sorted set of every id, scored by `created_at` (for `list(None)`).
- `apikeys:usage-batch:<batch_id>`: a string per usage batch applied in the last
  `USAGE_BATCH_RETENTION` (24 hours, its TTL), so that a batch sent again is skipped.
- `apikeys:setting:<name>`: a string per setting (`claim_setting`), such as the pepper's
  fingerprint.

Hash fields carry the `KeyRecord` field names plus `secret_hash`. Datetimes are stored as
integer microseconds since the Unix epoch (exact, and comparable inside Lua); they decode to
timezone-aware UTC datetimes. `scopes` is a JSON array; absent fields (`rate_limit`,
`expires_at`, `last_used_at`, `revoked_at`) mean None.

Atomicity: `set_state`, `shorten_expiry` and `replace_hash` are one Lua script each on the
key's hash and return the hash as it is afterwards, in one round trip. `add_usage` sends one
script per key in a single MULTI/EXEC, so on a single node a batch applies whole or not at
all; each script checks that the hash exists, so unknown ids create nothing.

Usage batches apply exactly once. Each send of a batch draws a random nonce, and each script
of its MULTI/EXEC first looks at the batch's marker key: absent, it sets it to the nonce
(with the retention TTL) and applies; equal to the nonce (set by an earlier script of the
same transaction), it applies; anything else means an earlier send of this batch was
applied, and it changes nothing. Scripts of a transaction run back to back, so a batch sent
again after a lost EXEC reply, even at the same time as the first send, is counted once. A
transaction whose scripts all failed (NOSCRIPT) set no marker, so its retry applies. The
usage scripts name two keys in different slots (the hash and the marker) and the
transaction spans many keys: exactly-once usage needs a single node, not Redis Cluster.

`insert` first adds the id to both indexes (`ZADD NX`), then creates the hash with a
create-if-absent script. The indexes live in other slots than the hash, so these are two
steps, not one transaction. The order means `list` never misses a stored key: a failure
between the steps, or a refused duplicate, leaves at most an index entry whose hash is
missing or belongs to another workspace, and `list` skips such entries.

No command is retried automatically: a retried write could apply twice (an increment) or
report its own success as a conflict. Pooled connections the server has closed (after a
Redis restart) are detected and replaced when they are taken from the pool, so the next call
after Redis comes back succeeds.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import uuid
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, date, datetime, timedelta
from typing import Any, Final, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError
from redis.exceptions import TimeoutError as RedisTimeoutError

from apikeys.channels.redis import RedisChannel, notices_channel
from apikeys.errors import ConfigurationError, DuplicateKeyId, KeyNotFound, StoreUnavailable
from apikeys.policies import dump_metadata, load_metadata
from apikeys.stores.base import USAGE_BATCH_RETENTION, KeyStore, days_of, select_events
from apikeys.types import (
    Access,
    AuditEvent,
    DailyUsage,
    KeyRecord,
    StoredKey,
    StoredState,
    UsageDelta,
)

__all__ = ["DEFAULT_KEY_PREFIX", "RedisStore"]

DEFAULT_KEY_PREFIX = "apikeys:"

# Connection defaults; any of them can be overridden through `from_url(url, **options)`.
_DEFAULT_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 2.0,
    "socket_timeout": 2.0,
    "health_check_interval": 30,
    # No automatic retries: see the module docstring.
    "retry": Retry(NoBackoff(), 0),
    # A bounded pool: a burst waits up to `timeout` seconds for a free connection, then fails
    # closed with StoreUnavailable, instead of opening connections without limit.
    "max_connections": 50,
    "timeout": 2.0,
    # RESP2: with RESP3, redis-py 8 turns on maintenance notifications, which skip the check
    # that replaces a pooled connection the server has closed (e.g. after a restart).
    "protocol": 2,
}

# Errors that mean "Redis cannot be reached right now". BusyLoadingError (a server still
# loading its dataset) is a ConnectionError; ReadOnlyError comes from a replica during a
# failover. Built-in TimeoutError (and asyncio's) is an OSError.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
    OSError,
)

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)

# KEYS[1] = key hash, KEYS[2] = the audit list; ARGV = field, value, field, value, ...,
# then the audit event ('' for none). Returns 1 when created, 0 when the id is taken.
_INSERT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 1, #ARGV - 1))
if ARGV[#ARGV] ~= '' then
  redis.call('RPUSH', KEYS[2], ARGV[#ARGV])
end
return 1
"""

# Every change script ends with the same three ARGV: the audit event, the notice channel and
# the notice ('' for none), and has the audit list as KEYS[2]. The event is appended only
# when the change happened, and the notice published, in the script itself: no change
# commits without its event and its notice.
_PUBLISH = """
local function publish()
  if ARGV[#ARGV] ~= '' then
    redis.call('PUBLISH', ARGV[#ARGV - 1], ARGV[#ARGV])
  end
end
local function record()
  if ARGV[#ARGV - 2] ~= '' then
    redis.call('RPUSH', KEYS[2], ARGV[#ARGV - 2])
  end
end
"""

# KEYS[1] = key hash; ARGV[1] = new state, ARGV[2] = `at` (µs), ARGV[3..] = allowed states.
# Returns the hash afterwards (flat HGETALL), or nil when the key does not exist.
_SET_STATE = (
    _PUBLISH
    + """
local current = redis.call('HGET', KEYS[1], 'state')
if not current then
  return false
end
if current ~= ARGV[1] then
  for i = 3, #ARGV - 3 do
    if ARGV[i] == current then
      if ARGV[1] == 'revoked' then
        redis.call('HSET', KEYS[1], 'state', ARGV[1], 'revoked_at', ARGV[2])
      else
        redis.call('HSET', KEYS[1], 'state', ARGV[1])
      end
      record()
      break
    end
  end
end
publish()
return redis.call('HGETALL', KEYS[1])
"""
)


def _unless_revoked(change: str) -> str:
    """A script that runs `change` on a key that exists and is not revoked, publishes the
    notice (also when nothing changed) and returns the hash afterwards, or nil."""
    return (
        _PUBLISH
        + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
if state ~= 'revoked' then
  local changed = false
"""
        + change
        + """
  if changed then
    record()
  end
end
publish()
return redis.call('HGETALL', KEYS[1])
"""
    )


# KEYS[1] = key hash; ARGV[1] = expires_at (µs), ARGV[2] = replaced_by ('' to leave it).
_SHORTEN_EXPIRY = _unless_revoked(
    """
  local current = redis.call('HGET', KEYS[1], 'expires_at')
  if (not current) or tonumber(ARGV[1]) < tonumber(current) then
    redis.call('HSET', KEYS[1], 'expires_at', ARGV[1])
    changed = true
  end
  if ARGV[2] ~= '' then
    redis.call('HSET', KEYS[1], 'replaced_by', ARGV[2])
    changed = true
  end
"""
)

# KEYS[1] = key hash; ARGV[1] = how many fields to set, then field, value pairs to set, then
# fields to delete.
_UPDATE = _unless_revoked(
    """
  local sets = tonumber(ARGV[1])
  for i = 2, 1 + 2 * sets, 2 do
    redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  end
  for i = 2 + 2 * sets, #ARGV - 3 do
    redis.call('HDEL', KEYS[1], ARGV[i])
  end
  changed = true
"""
)

# KEYS[1] = key hash; ARGV[1] = cost, ARGV[2] = refill amount ('' for none), ARGV[3] = the
# refill period's start (µs). Returns the credits left, or -1 when too few (nothing taken),
# the key has none (unlimited), is revoked or does not exist.
_SPEND_CREDITS = """
local fields = redis.call('HMGET', KEYS[1], 'credits', 'state', 'credits_refilled_at')
local left = fields[1]
if (not left) or fields[2] == 'revoked' then
  return -1
end
left = tonumber(left)
if ARGV[2] ~= '' and ((not fields[3]) or tonumber(fields[3]) < tonumber(ARGV[3])) then
  left = tonumber(ARGV[2])
  redis.call('HSET', KEYS[1], 'credits', left, 'credits_refilled_at', ARGV[3])
end
local cost = tonumber(ARGV[1])
if left < cost then
  return -1
end
redis.call('HSET', KEYS[1], 'credits', left - cost)
return left - cost
"""

# KEYS[1] = key hash; ARGV[1] = old hash, ARGV[2] = new hash. Returns 1 if swapped.
_REPLACE_HASH = (
    _PUBLISH
    + """
if redis.call('HGET', KEYS[1], 'secret_hash') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'secret_hash', ARGV[2])
  record()
  publish()
  return 1
end
return 0
"""
)

# KEYS[1] = key hash, KEYS[2] = the batch's marker; ARGV[1] = count, ARGV[2] = last_used_at
# (µs), ARGV[3] = this send's nonce, ARGV[4] = the marker's TTL in seconds.
# Returns 1 if applied, 0 for an unknown id (nothing is created) or a batch applied before.
# KEYS[3..] = the key's daily usage hashes (one per day in the batch); ARGV[5] = the daily
# hashes' TTL in seconds, then (key index, outcome, count) triples naming them.
# KEYS[1] = the setting; ARGV[1] = the value to record, ARGV[2..] = values it may replace.
_CLAIM_SETTING = """
local recorded = redis.call('GET', KEYS[1])
local replace = not recorded
for i = 2, #ARGV do
  if recorded == ARGV[i] then replace = true end
end
if replace then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return recorded
"""

_ADD_USAGE = """
local marker = redis.call('GET', KEYS[2])
if not marker then
  redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4])
elseif marker ~= ARGV[3] then
  return 0
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
if tonumber(ARGV[1]) ~= 0 then
  redis.call('HINCRBY', KEYS[1], 'request_count', ARGV[1])
  local current = redis.call('HGET', KEYS[1], 'last_used_at')
  if (not current) or tonumber(ARGV[2]) > tonumber(current) then
    redis.call('HSET', KEYS[1], 'last_used_at', ARGV[2])
  end
end
for i = 6, #ARGV, 3 do
  local day = KEYS[tonumber(ARGV[i])]
  redis.call('HINCRBY', day, ARGV[i + 1], ARGV[i + 2])
  redis.call('EXPIRE', day, ARGV[5])
end
return 1
"""

# How long a key's daily usage is kept on Redis.
DAILY_USAGE_RETENTION_DAYS: Final = 400


@contextmanager
def _unavailable_as_store_error() -> Iterator[None]:
    """Turn connection failures and timeouts into `StoreUnavailable(original)`."""
    try:
        yield
    except _UNAVAILABLE as exc:
        raise StoreUnavailable(exc) from exc


def _encode_time(moment: datetime) -> str:
    """Integer microseconds since the epoch; a naive datetime is taken as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return str((moment - _EPOCH) // _MICROSECOND)


def _decode_time(value: str | None) -> datetime | None:
    if value is None or value == "":
        return None
    return _EPOCH + timedelta(microseconds=int(value))


def _decode_scopes(value: str) -> tuple[str, ...]:
    if value.startswith("["):
        return tuple(str(scope) for scope in json.loads(value))
    return tuple(scope for scope in value.split(",") if scope)


def _event(event: AuditEvent | None) -> str:
    return "" if event is None else event.encode()


def _encode_list(values: tuple[str, ...]) -> str:
    return json.dumps(list(values), separators=(",", ":"))


def _encode(stored: StoredKey) -> list[str]:
    """The hash fields of a key, as a flat field/value list."""
    record = stored.record
    fields: dict[str, str] = {
        "id": record.id,
        "name": record.name,
        "workspace": record.workspace,
        "prefix": record.prefix,
        "access": record.access,
        "scopes": _encode_list(record.scopes),
        "state": record.state,
        "created_at": _encode_time(record.created_at),
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
        ("allowed_ips", _encode_list(record.allowed_ips) if record.allowed_ips else None),
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
            fields[name] = _encode_time(moment)
    return [item for pair in fields.items() for item in pair]


def _decode(fields: Mapping[str, str]) -> StoredKey:
    created_at = _decode_time(fields["created_at"])
    assert created_at is not None
    record = KeyRecord(
        id=fields["id"],
        name=fields["name"],
        workspace=fields["workspace"],
        prefix=fields["prefix"],
        access=cast(Access, fields["access"]),
        scopes=_decode_scopes(fields["scopes"]),
        state=cast(StoredState, fields["state"]),
        rate_limit=fields.get("rate_limit"),
        created_at=created_at,
        expires_at=_decode_time(fields.get("expires_at")),
        last_used_at=_decode_time(fields.get("last_used_at")),
        request_count=int(fields.get("request_count") or 0),
        revoked_at=_decode_time(fields.get("revoked_at")),
        replaces=fields.get("replaces"),
        replaced_by=fields.get("replaced_by"),
        owner=fields.get("owner"),
        metadata=load_metadata(fields.get("metadata")),
        allowed_ips=_decode_scopes(fields.get("allowed_ips") or "[]"),
        credits=None if fields.get("credits") is None else int(fields["credits"]),
        credit_refill=fields.get("credit_refill"),
        credits_refilled_at=_decode_time(fields.get("credits_refilled_at")),
    )
    return StoredKey(record=record, secret_hash=fields["secret_hash"])


def _check_key_prefix(key_prefix: str) -> str:
    if "{" in key_prefix or "}" in key_prefix:
        raise ConfigurationError(
            "the Redis key_prefix may not contain '{' or '}': the store puts each key's "
            "id in a {hash tag} of its own"
        )
    return key_prefix


def _pairs(flat: Sequence[str]) -> dict[str, str]:
    """A flat `[field, value, ...]` script reply as a dict."""
    return dict(zip(flat[::2], flat[1::2], strict=True))


class RedisStore(KeyStore):
    """Keys in Redis (single node, or any server speaking the Redis protocol).

    Build it with `store_from_url("redis://…")` / `RedisStore.from_url`, or hand it a
    `redis.asyncio.Redis` client created with `decode_responses=True`. The store owns the
    client: `aclose()` closes it.
    """

    schemes = ("redis", "rediss")

    def __init__(self, client: Redis, *, key_prefix: str = DEFAULT_KEY_PREFIX) -> None:
        _check_key_prefix(key_prefix)
        if not client.connection_pool.connection_kwargs.get("decode_responses"):
            raise ConfigurationError("the Redis client must be created with decode_responses=True")
        self._client_object = client
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefix = key_prefix
        self._all_index = f"{key_prefix}all"
        self._insert = client.register_script(_INSERT)
        self._set_state = client.register_script(_SET_STATE)
        self._shorten_expiry = client.register_script(_SHORTEN_EXPIRY)
        self._spend_credits = client.register_script(_SPEND_CREDITS)
        self._replace_hash = client.register_script(_REPLACE_HASH)
        self._update = client.register_script(_UPDATE)
        self._add_usage = client.register_script(_ADD_USAGE)
        self._claim_setting = client.register_script(_CLAIM_SETTING)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """A store on a new client for `url`, with a connection pool of its own.

        `key_prefix` (default `apikeys:`) namespaces every Redis key of the store. Any other
        option is a connection option of redis-py (as `redis.asyncio.Redis.from_url` takes)
        and overrides the defaults: 2 s connect and socket timeouts, a health check after
        30 s idle, no automatic retries, RESP2, and a pool of at most 50 connections that
        waits up to 2 s (`timeout`) for a free one. `decode_responses` is always on.
        """
        key_prefix = _check_key_prefix(str(options.pop("key_prefix", DEFAULT_KEY_PREFIX)))
        client_options = {**_DEFAULT_OPTIONS, **options, "decode_responses": True}
        pool = BlockingConnectionPool.from_url(url, **client_options)
        return cls(Redis.from_pool(pool), key_prefix=key_prefix)

    def __repr__(self) -> str:
        # Built from the host, port and db only: never the URL, which may hold a password.
        kwargs = self._client.connection_pool.connection_kwargs
        if "path" in kwargs:
            where = f"path={kwargs['path']!r}"
        else:
            where = f"host={kwargs.get('host', 'localhost')!r}, port={kwargs.get('port', 6379)!r}"
        return f"RedisStore({where}, db={kwargs.get('db', 0)!r}, key_prefix={self._prefix!r})"

    @property
    def _client(self) -> Redis:
        # redis-py's connections belong to the event loop that opened them. A store used on
        # a new loop after its first one closed (a key issued under `asyncio.run`, then the
        # app served by uvicorn) lets the old loop's connections go: they can be neither
        # used nor closed any more, and the garbage collector closes their sockets.
        client = self._client_object
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return client
        if loop is not self._loop:
            if self._loop is not None and self._loop.is_closed():
                client.connection_pool.reset()  # type: ignore[no-untyped-call]
            self._loop = loop
        return client

    @contextmanager
    def _calls(self) -> Iterator[None]:
        """Around every call to Redis: this loop's connections, and failures as
        `StoreUnavailable` (the scripts reach the client without the property)."""
        self._client  # noqa: B018 - the property adopts the running loop
        with _unavailable_as_store_error():
            yield

    @property
    def key_prefix(self) -> str:
        return self._prefix

    @property
    def client(self) -> Redis:
        """The underlying `redis.asyncio.Redis` client."""
        return self._client

    def key_name(self, key_id: str) -> str:
        """The Redis key of the hash that holds key `key_id`."""
        return f"{self._prefix}key:{{{key_id}}}"

    def workspace_index_name(self, workspace: str) -> str:
        """The Redis key of the sorted set that indexes `workspace`."""
        return f"{self._prefix}ws:{workspace}"

    def daily_usage_name(self, key_id: str, day: str) -> str:
        """The hash of one key's requests on one UTC day, by outcome."""
        return f"{self._prefix}usage:{key_id}:{day}"

    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        today = datetime.now(UTC).date()
        days = [since + timedelta(days=n) for n in range(max(0, (today - since).days) + 1)]
        if not days:
            return []
        with self._calls():
            async with self._client.pipeline(transaction=False) as pipe:
                for day in days:
                    pipe.hgetall(self.daily_usage_name(key_id, day.isoformat()))
                replies: list[dict[str, str]] = await pipe.execute()
        return days_of(
            (day.isoformat(), outcome, int(count))
            for day, reply in zip(days, replies, strict=True)
            for outcome, count in reply.items()
        )

    def usage_batch_name(self, batch_id: str) -> str:
        """The Redis key that marks usage batch `batch_id` as applied."""
        return f"{self._prefix}usage-batch:{batch_id}"

    @property
    def all_index_name(self) -> str:
        """The Redis key of the sorted set that indexes every key."""
        return self._all_index

    async def setup(self) -> None:
        """Load the scripts into the server's cache. Idempotent, and optional: a script the
        server has lost (restart, `SCRIPT FLUSH`) is loaded again on first use."""
        with self._calls():
            for script in self._scripts():
                script.sha = str(await self._client.script_load(script.script))

    def _scripts(self) -> tuple[AsyncScript, ...]:
        return (
            self._insert,
            self._set_state,
            self._shorten_expiry,
            self._spend_credits,
            self._replace_hash,
            self._update,
            self._add_usage,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def claim_setting(
        self, name: str, value: str, *, replacing: Collection[str] = ()
    ) -> str | None:
        with self._calls():
            recorded = await self._claim_setting(
                keys=[f"{self._prefix}setting:{name}"], args=[value, *replacing]
            )
        return str(recorded)

    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        record = stored.record
        score = int(_encode_time(record.created_at))
        with self._calls():
            # Indexes first, so that a stored key is always listed (see the module docstring).
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.workspace_index_name(record.workspace), {record.id: score}, nx=True)
                pipe.zadd(self._all_index, {record.id: score}, nx=True)
                await pipe.execute()
            created = await self._insert(
                keys=[self.key_name(record.id), self._audit_list],
                args=[*_encode(stored), _event(event)],
            )
        if not created:
            raise DuplicateKeyId(record.id)

    async def get(self, key_id: str) -> StoredKey | None:
        with self._calls():
            # The hot path: one HGETALL, one round trip.
            fields = cast("dict[str, str]", await self._client.hgetall(self.key_name(key_id)))
        if not fields:
            return None
        return _decode(fields)

    async def list(self, workspace: str | None = None) -> list[KeyRecord]:
        index = self._all_index if workspace is None else self.workspace_index_name(workspace)
        with self._calls():
            ids = cast("list[str]", await self._client.zrange(index, 0, -1))
            if not ids:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hgetall(self.key_name(key_id))
                replies: list[dict[str, str]] = await pipe.execute()
        records = []
        for fields in replies:
            # Skip index entries left by a failed insert or a refused duplicate.
            if not fields or (workspace is not None and fields.get("workspace") != workspace):
                continue
            records.append(_decode(fields).record)
        records.sort(key=lambda record: (record.created_at, record.id))
        return records

    def _record_from_reply(self, key_id: str, reply: Any) -> KeyRecord:
        if not reply:
            raise KeyNotFound(key_id)
        return _decode(_pairs(cast("list[str]", reply))).record

    async def set_state(
        self,
        key_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        with self._calls():
            reply = await self._set_state(
                keys=[self.key_name(key_id), self._audit_list],
                args=[state, _encode_time(at), *allowed_from, *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    async def shorten_expiry(
        self,
        key_id: str,
        expires_at: datetime,
        *,
        replaced_by: str | None = None,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        with self._calls():
            reply = await self._shorten_expiry(
                keys=[self.key_name(key_id), self._audit_list],
                args=[_encode_time(expires_at), replaced_by or "", *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        amount, start = ("", "0") if refill is None else (str(refill[0]), _encode_time(refill[1]))
        with self._calls():
            left = await self._spend_credits(
                keys=[self.key_name(key_id)], args=[cost, amount, start]
            )
        return None if int(left) < 0 else int(left)

    async def replace_hash(
        self,
        key_id: str,
        old_hash: str,
        new_hash: str,
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> bool:
        with self._calls():
            swapped = await self._replace_hash(
                keys=[self.key_name(key_id), self._audit_list],
                args=[old_hash, new_hash, *self._tail(event, notice)],
            )
        return bool(swapped)

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        with self._calls():
            lines = cast("list[str]", await self._client.lrange(self._audit_list, 0, -1))
        return select_events(
            map(AuditEvent.decode, lines),
            workspace=workspace,
            key_id=key_id,
            since=since,
            limit=limit,
        )

    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        sets: list[str] = []
        deletes: list[str] = []
        for name, value in changes.items():
            if value is None:
                deletes.append(name)
            elif name in ("scopes", "allowed_ips"):
                sets += [name, _encode_list(value)]
            elif name == "metadata":
                if value:
                    sets += [name, dump_metadata(value)]
                else:
                    deletes.append(name)
            elif name in ("expires_at", "credits_refilled_at"):
                sets += [name, _encode_time(value)]
            else:
                sets += [name, str(value)]
        with self._calls():
            reply = await self._update(
                keys=[self.key_name(key_id), self._audit_list],
                args=[len(sets) // 2, *sets, *deletes, *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    def _tail(self, event: AuditEvent | None, notice: str | None) -> tuple[str, str, str]:
        """The last ARGV of every change script: the event, the notice channel, the notice."""
        return _event(event), notices_channel(self._prefix), notice or ""

    @property
    def _audit_list(self) -> str:
        return f"{self._prefix}audit"

    def channel(self) -> RedisChannel:
        """Redis pub/sub on this store's server and key prefix (see `apikeys.channels.redis`)."""
        pool = self._client.connection_pool
        return RedisChannel(
            connection_kwargs=pool.connection_kwargs,
            connection_class=pool.connection_class,
            key_prefix=self._prefix,
        )

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        # A zero count changes nothing, not even last_used_at (as `KeyRecord.with_usage`).
        batch = [(key_id, delta) for key_id, delta in usage.items() if delta.count or delta.daily]
        if not batch:
            return
        # One nonce per send: the scripts of this transaction apply only if the marker is
        # absent or holds it (see the module docstring).
        nonce = uuid.uuid4().hex
        with self._calls():
            try:
                await self._add_usage_batch(batch, batch_id, nonce)
            except NoScriptError:
                # Every EVALSHA of the transaction names the same script, so a missing script
                # failed them all and nothing was applied, not even the marker: load it and
                # send the batch again.
                self._add_usage.sha = str(await self._client.script_load(self._add_usage.script))
                await self._add_usage_batch(batch, batch_id, nonce)

    async def _add_usage_batch(
        self, batch: Sequence[tuple[str, UsageDelta]], batch_id: str, nonce: str
    ) -> None:
        # EVALSHA directly rather than through the Script object: inside a pipeline that would
        # cost a SCRIPT EXISTS round trip before every batch.
        sha = self._add_usage.sha
        marker = self.usage_batch_name(batch_id)
        ttl = str(int(USAGE_BATCH_RETENTION.total_seconds()))
        async with self._client.pipeline(transaction=True) as pipe:
            for key_id, delta in batch:
                days = sorted({day for day, _ in delta.daily})
                slots = {day: index for index, day in enumerate(days, start=3)}
                triples = [
                    item
                    for (day, outcome), count in sorted(delta.daily.items())
                    for item in (str(slots[day]), outcome, str(count))
                ]
                pipe.evalsha(
                    sha,
                    2 + len(days),
                    self.key_name(key_id),
                    marker,
                    *(self.daily_usage_name(key_id, day) for day in days),
                    str(delta.count),
                    _encode_time(delta.last_used_at),
                    nonce,
                    ttl,
                    str(DAILY_USAGE_RETENTION_DAYS * 86400),
                    *triples,
                )
            await pipe.execute()
