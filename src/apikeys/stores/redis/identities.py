"""The Redis store's identities: one hash per identity, beside the limiter's counters.

Layout, for the default `key_prefix` of `apikeys:`:

- `apikeys:{i:<id>}`: the identity's hash, its fields those of `IDENTITY_FIELDS`, each
  written as its kind says (as a key's). Its hash tag, `{i:<id>}`, is the one the limiter
  gives the identity's counters, so on a Cluster both live in one slot.
- `apikeys:audit:{i:<id>}`: its audit events (the list a key's are kept in, named by the
  identity's subject `i:<id>`), in the same slot.
- `apikeys:iws:<workspace>` and `apikeys:identities`: sorted sets of ids, scored by
  `created_at` in microseconds, for listing (written before the hash, as a key's indexes:
  a listing skips an entry whose hash is missing).

- `apikeys:events:{i:<id>}`: its webhook outbox (`identity.*` events), in the same slot,
  counted in the key store's index of outboxes as `i:<id>`.

Changes run the key store's own scripts (`insert`, `update`, `set_state`, `common.lua`) on
the identity's hash, audit list and outbox: each is one script, with its audit event,
webhook event and notice.
Writes by other clients (`redis-cli HSET apikeys:{i:acme} state disabled`) reach caching
processes through the channel's tracking of the prefix `apikeys:{i:` (`channel.py`).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, cast

from apikeys.errors import DuplicateIdentity, IdentityNotFound, StoreUnavailable
from apikeys.identities import IDENTITY_FIELDS, IdentityRecord
from apikeys.listing import Position, after
from apikeys.policies import dump_metadata, load_metadata
from apikeys.stores.contract import MAX_ROLL_HOPS, CreditSpend, IdentityStore
from apikeys.stores.redis.channel import notices_channel
from apikeys.stores.redis.codec import decode_time, encode_time, event_text, interned, script
from apikeys.types import AuditEvent, Kind, StoredState, identity_subject
from apikeys.webhooks.events import EVENT_OF_ACTION

if TYPE_CHECKING:
    from apikeys.stores.redis.store import RedisStore

__all__ = ["RedisIdentities", "decode_identity", "encode_identity_field"]

_ENCODERS: Final[Mapping[Kind, Callable[[Any], Any]]] = {
    Kind.TEXT: str,
    Kind.TIME: encode_time,
    Kind.COUNT: str,
    Kind.OBJECT: dump_metadata,
}
_DECODERS: Final[Mapping[Kind, Callable[[str], Any]]] = {
    Kind.TEXT: str,
    Kind.TIME: decode_time,
    Kind.COUNT: int,
    Kind.OBJECT: load_metadata,
}
_FIELDS: Final = {field.name: field for field in IDENTITY_FIELDS}


def encode_identity_field(name: str, value: Any) -> str | None:
    """A field of `IdentityRecord` as its hash holds it; None: the field is deleted."""
    field = _FIELDS[name]
    if value is None or (field.kind is Kind.OBJECT and not value):
        return None
    return str(_ENCODERS[field.kind](value))


def decode_identity(fields: Mapping[str, str]) -> IdentityRecord:
    """An identity's hash as the store wrote it; a hash another client damaged fails
    closed (`StoreUnavailable`)."""
    try:
        values: dict[str, Any] = {}
        for field in IDENTITY_FIELDS:
            text = fields.get(field.name)
            if text is None or (text == "" and field.kind in (Kind.TIME, Kind.OBJECT)):
                value = field.empty()
            else:
                value = interned(text) if field.shared else _DECODERS[field.kind](text)
            if value is None and field.required:
                raise ValueError(f"{field.name} is empty")
            values[field.name] = value
        return IdentityRecord(**values)
    except (KeyError, ValueError, TypeError, OverflowError) as exc:
        raise StoreUnavailable(
            exc, hint="an identity's hash in Redis is damaged: a field is missing or malformed"
        ) from None


class RedisIdentities(IdentityStore):
    """Identities on the server of a `RedisStore` (see the module doc)."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        prefix = store.key_prefix
        self._prefix = prefix
        self._all = f"{prefix}identities"
        register = store.client.register_script
        self._insert = register(script("insert"))
        self._update = register(script("update"))
        self._set_state = register(script("set_state"))
        self._get_to_cache = register(script("get_to_cache"))
        self._spend = register(script("spend_with_identity"))
        self._refund = register(script("refund_identity"))

    def __repr__(self) -> str:
        return f"RedisIdentities(key_prefix={self._prefix!r})"

    def hash_name(self, identity_id: str) -> str:
        """The Redis key of identity `identity_id`'s hash: `<prefix>{i:<id>}`."""
        return f"{self._prefix}{{{identity_subject(identity_id)}}}"

    @property
    def all_index_name(self) -> str:
        """The sorted set of every identity's id, scored by `created_at`."""
        return self._all

    def workspace_index_name(self, workspace: str) -> str:
        """The sorted set of the ids of `workspace`'s identities."""
        return f"{self._prefix}iws:{workspace}"

    def _keys(self, identity_id: str) -> list[str]:
        # A change script's KEYS: the hash, its audit list and webhook outbox, the hash again
        # (an identity has no use hash), in one slot, and, but on a cluster, the index of
        # outboxes to take (as a key's).
        store, subject = self._store, identity_subject(identity_id)
        own = self.hash_name(identity_id)
        names = [own, store.audit_list_name(subject), store.outbox_name(subject), own]
        return names if store.deployment == "cluster" else [*names, store.outbox_index_name]

    def _tail(self, event: AuditEvent | None, notice: str | None) -> list[str]:
        # As the key store's: the webhook event, the audit event, the channel, the notice.
        hook = "" if event is None else EVENT_OF_ACTION.get(event.action, "")
        return [hook, event_text(event), notices_channel(self._prefix), notice or ""]

    async def _change(self, script: Any, identity_id: str, args: builtins.list[Any]) -> Any:
        """Run a change script; on a cluster, where the index of outboxes is in another
        slot, count the identity's outbox in it right after (as `RedisStore` does a key's)."""
        store = self._store
        reply = await store.change_once(script, self._keys(identity_id), args)
        if store.deployment == "cluster" and args[-4]:
            await store.client.zincrby(store.outbox_index_name, 1, identity_subject(identity_id))
        return reply

    async def insert(self, record: IdentityRecord, *, event: AuditEvent | None = None) -> None:
        flat: list[str] = []
        for field in IDENTITY_FIELDS:
            text = encode_identity_field(field.name, getattr(record, field.name))
            if text is not None:
                flat += [field.name, text]
        score = int(encode_time(record.created_at))
        store = self._store
        async with store.calls():
            client = store.client
            async with client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.workspace_index_name(record.workspace), {record.id: score}, nx=True)
                pipe.zadd(self._all, {record.id: score}, nx=True)
                await pipe.execute()
            created = await self._change(self._insert, record.id, [*flat, *self._tail(event, None)])
        if not created:
            raise DuplicateIdentity(record.id)

    async def get(self, identity_id: str) -> IdentityRecord | None:
        store = self._store
        async with store.calls():
            fields = await store.client.hgetall(self.hash_name(identity_id))
        return decode_identity(fields) if fields else None

    async def get_to_cache(self, identity_id: str) -> tuple[IdentityRecord | None, bool]:
        """`get`, and whether a cache may keep it: not a hash given a TTL by hand (its
        expiry would be announced late, as `RedisStore.get_to_cache` explains)."""
        store = self._store
        async with store.calls():
            fields, ttl, _ = await self._get_to_cache(keys=[self.hash_name(identity_id)])
        if not fields:
            return None, True
        flat = cast("builtins.list[str]", fields)
        return decode_identity(dict(zip(flat[::2], flat[1::2], strict=True))), int(ttl) == -1

    async def subjects(self, workspace: str | None) -> builtins.list[str]:
        """`i:<id>` of every identity of `workspace` (or all): whose audit lists to read."""
        index = self._all if workspace is None else self.workspace_index_name(workspace)
        ids = await self._store.client.zrange(index, 0, -1)
        return [identity_subject(one) for one in ids]

    async def list(self, workspace: str | None = None) -> builtins.list[IdentityRecord]:
        return await self.list_page(workspace, start=None, limit=None)

    async def list_page(
        self, workspace: str | None, *, start: Position | None, limit: int | None
    ) -> builtins.list[IdentityRecord]:
        store = self._store
        index = self._all if workspace is None else self.workspace_index_name(workspace)
        async with store.calls():
            client = store.client
            floor = "-inf" if start is None else int(encode_time(start[0]))
            ids = cast("builtins.list[str]", await client.zrangebyscore(index, floor, "+inf"))
            async with client.pipeline(transaction=False) as pipe:
                for one in ids:
                    pipe.hgetall(self.hash_name(one))
                replies: builtins.list[dict[str, str]] = await pipe.execute()
        records = [
            decode_identity(fields)
            for fields in replies
            # Skip index entries left by a failed insert or a refused duplicate.
            if fields and (workspace is None or fields.get("workspace") == workspace)
        ]
        records.sort(key=lambda record: (record.created_at, record.id))
        found = [record for record in records if after(record, start)]
        return found if limit is None else found[:limit]

    async def _changed(self, identity_id: str, reply: Any) -> IdentityRecord:
        if not reply:
            raise IdentityNotFound(identity_id)
        flat = cast("builtins.list[builtins.list[str]]", reply)[0]  # (no use hash)
        return decode_identity(dict(zip(flat[::2], flat[1::2], strict=True)))

    async def update(
        self,
        identity_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        sets: list[str] = []
        deletes: list[str] = []
        for name, value in changes.items():
            text = encode_identity_field(name, value)
            if text is None:
                deletes.append(name)
            else:
                sets += [name, text]
        store = self._store
        async with store.calls():
            reply = await self._change(
                self._update,
                identity_id,
                [len(sets) // 2, *sets, *deletes, *self._tail(event, notice)],
            )
        return await self._changed(identity_id, reply)

    async def set_state(
        self,
        identity_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> IdentityRecord:
        store = self._store
        async with store.calls():
            reply = await self._change(
                self._set_state,
                identity_id,
                [state, encode_time(at), *allowed_from, *self._tail(event, notice)],
            )
        return await self._changed(identity_id, reply)

    async def spend_credits_with_key(
        self,
        identity_id: str,
        key_id: str | None,
        cost: int,
        *,
        refill: tuple[int, datetime] | None = None,
        key_refill: tuple[int, datetime] | None = None,
    ) -> CreditSpend:
        # On the request path: not followed by WAIT, as a key's spend (docs/stores.md).
        store = self._store
        ours = _refill_args(refill)
        if store.deployment == "cluster" and key_id is not None:
            return await self._spend_split(identity_id, key_id, cost, ours, key_refill)
        identity_hash = self.hash_name(identity_id)
        target, followed = key_id, ""
        async with store.calls():
            for _ in range(MAX_ROLL_HOPS):
                reply = await self._spend(
                    keys=[
                        identity_hash,
                        identity_hash if target is None else store.key_name(target),
                    ],
                    args=[
                        cost,
                        *ours,
                        *_refill_args(key_refill),
                        followed,
                        "" if target is None else "1",
                    ],
                )
                if int(reply[0]) != 3:
                    return _spent(reply)
                # Rolled: the pair's balance is the successor's; ask again there.
                target, followed = str(reply[1]), "1"
        return CreditSpend(None, None, "key")

    async def _spend_split(
        self,
        identity_id: str,
        key_id: str,
        cost: int,
        ours: tuple[str, str],
        key_refill: tuple[int, datetime] | None,
    ) -> CreditSpend:
        """On a Cluster (the identity's hash and the key's in two slots): the identity's
        credits first, then the key's, and the identity's given back when the key refuses
        (see `IdentityStore.spend_credits_with_key`)."""
        store = self._store
        identity_hash = self.hash_name(identity_id)
        async with store.calls():
            reply = await self._spend(
                keys=[identity_hash, identity_hash], args=[cost, *ours, "", "0", "", ""]
            )
        spent = _spent(reply)
        if spent.refused is not None:
            return spent
        key_left = await store.spend_credits(key_id, cost, refill=key_refill)
        if key_left is not None:
            return CreditSpend(spent.identity_left, key_left)
        if spent.identity_left is not None:
            async with store.calls():
                await self._refund(keys=[identity_hash], args=[cost, str(reply[3])])
        return CreditSpend(None, None, "key")


def _refill_args(refill: tuple[int, datetime] | None) -> tuple[str, str]:
    return ("", "0") if refill is None else (str(refill[0]), encode_time(refill[1]))


def _spent(reply: Any) -> CreditSpend:
    status = int(reply[0])
    if status == 1:
        return CreditSpend(None, None, "identity")
    if status == 2:
        return CreditSpend(None, None, "key")
    identity_left, key_left = int(reply[1]), int(reply[2])
    return CreditSpend(
        None if identity_left < 0 else identity_left, None if key_left < 0 else key_left
    )
