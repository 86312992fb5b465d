"""Webhooks on the Redis store: each key's outbox, and deliveries in one hash slot.

The change scripts (`apikeys/stores/redis/scripts/common.lua`) append each change's event,
with the server's time and the key's fields without the hash, to the key's outbox
`<prefix>events:{<id>}`, in the key's own slot and in the change's own script. Then the
key's id is counted in `<prefix>events-pending`, the index of outboxes to take: in the same
script on one server or through Sentinel; on a cluster, where that index is in another
slot, right after it (and the pass over every key below finds any outbox a process that
died in between left out of it). The outbox lives a week after its last event.

An identity's changes go to its outbox `<prefix>events:{i:<id>}` the same way, indexed as
`i:<id>`, their fields an identity's (`identity.*` events).

`take` reads the indexed outboxes, makes one delivery per event and endpoint that wants it
(its id derived from endpoint, key and event time, so a take that is repeated after a
failure stores each delivery once), trims what it read, and drops an id from the index
only when no change was counted for it meanwhile. Order per key is the outbox's order.

Endpoints and deliveries live under `<prefix>{webhooks}:`, one slot, so each step of
theirs is one script: an endpoint is a hash (and `endpoints`, a sorted set by creation);
a delivery is a hash, in `due` (pending, by next attempt), `deliveries`, `status:<s>` and
`ws:<workspace>` (by event time, for listing), `finished` (delivered or failed, by last
attempt, for pruning), and, while pending, in its line `line:<endpoint>:<key>`. A lease is
`lease:<delivery>`, set with SET NX PX: it runs out by itself. A listing reads one of those
by event time, newest first, then by id; a page after a position (time, id) starts at the
rank the position would have, counted in one script (`webhook_page.lua`), so a delivery
that left the index since (sent, pruned) moves no page.

The looks for `key.expiring` and `key.usage_threshold` (each minute) read the keys that can
be due, not every key: `expiring` holds the usable keys that expire later, each scored by
when it is next looked at (a notice time, then its expiry), and `refilled` the keys with a
credit refill, by when each was last looked at (`webhook_watch.lua`). A look reads those
scored up to now, at most `LOOK_LIMIT`, and moves each on with a compare-and-set
(`webhook_reschedule.lua`): a key a change re-scored meanwhile keeps the new score. An
endpoint no look was made for yet (not in `expiring-endpoints`) has every key that may be
in a notice's window read once. `take`
keeps the indexes up to date from each changed key's last outbox entry; a pass over every
key, `SWEEP_SLICE` keys a look from a cursor the processes share, brings in what no outbox
told of (keys made before the indexes, changes no take read within the outbox's week).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, cast

from apikeys.errors import DeliveryInProgress
from apikeys.listing import DeliveryPosition
from apikeys.stores.contract import WebhookStore
from apikeys.stores.redis.codec import decode, decode_time, encode_time, script
from apikeys.stores.redis.identities import decode_identity
from apikeys.stores.redis.listing import read_hashes
from apikeys.types import KeyRecord, identity_subject
from apikeys.webhooks.events import (
    EXPIRING_NOTICES,
    Subject,
    delivered_as,
    event_body,
    subject_of,
)
from apikeys.webhooks.model import (
    Claimed,
    Delivery,
    DeliveryStatus,
    Endpoint,
    Timed,
    delivery_id,
    expiring_deliveries,
    identity_usage_deliveries,
    usage_threshold_deliveries,
    wanting,
)

if TYPE_CHECKING:
    from apikeys.stores.redis.store import RedisStore

__all__ = ["RedisWebhooks"]

_IDENTITY = identity_subject("")


def _outboxed(event: str, fields: dict[str, str], used: dict[str, str]) -> Subject:
    """The record of an outbox entry (the hash's fields, then the use hash's): an
    identity's for its `identity.*` events."""
    if event.startswith("identity."):
        return decode_identity(fields)
    return decode({**fields, "secret_hash": ""}, used).record


CLAIM_SCAN = 1000
"""Due deliveries a claim reads at most (those not first in their line are taken out of
`due` as it reads them: see `webhook_claim.lua`)."""

SWEEP_SLICE = 1000
"""Keys read per look (each minute, by each delivering process) in the pass over every key
that keeps the indexes of keys to look at right (see the module doc)."""

FIRST_SWEEP_SLICE = 10_000
"""The same until a first pass is through: keys made before the indexes are found sooner."""

LOOK_LIMIT = 5000
"""Keys read at most by one look for `key.expiring` or `key.usage_threshold` (those due
first; the rest at the next look)."""

_WATCHED = ("state", "expires_at", "credits", "credit_refill")


def _next_look(expires_at: datetime, now: datetime) -> datetime:
    """When a key that expires at `expires_at` is next looked at for `key.expiring`: its
    next notice time after `now`, or its expiry once every notice is due."""
    ahead = [expires_at - notice for notice in EXPIRING_NOTICES if expires_at - notice > now]
    return min(ahead, default=expires_at)


def _micros(moment: datetime) -> int:
    return int(encode_time(moment))


def _time(value: str | None) -> datetime | None:
    return decode_time(value)


def _delivery(delivery_id: str, fields: dict[str, str]) -> Delivery:
    last_status = fields.get("last_status")
    return Delivery(
        id=delivery_id,
        webhook_id=fields["webhook_id"],
        key_id=fields["key_id"],
        event=fields["event"],
        status=cast(DeliveryStatus, fields["status"]),
        attempts=int(fields["attempts"]),
        created_at=cast(datetime, _time(fields["created_at"])),
        next_attempt_at=cast(datetime, _time(fields["next_attempt_at"])),
        last_attempt_at=_time(fields.get("last_attempt_at")),
        last_status=None if last_status is None else int(last_status),
        last_error=fields.get("last_error"),
        workspace=fields.get("workspace"),
        order=int(fields["order"]),
    )


class RedisWebhooks(WebhookStore):
    """The webhook side of a `RedisStore` (see the module doc)."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._w = f"{store.key_prefix}{{webhooks}}:"
        self._index = f"{self._w}endpoints"
        client = store.client
        self._scripts = {
            name: client.register_script(script(f"webhook_{name}"))
            for name in (
                "add_endpoint",
                "roll",
                "remove",
                "make",
                "claim",
                "finish",
                "replay",
                "prune",
                "page",
                "watch",
                "reschedule",
            )
        }
        self._taken = client.register_script(script("webhook_taken"))
        self._forget = client.register_script(script("webhook_forget"))

    async def _script(self, name: str, *args: Any) -> Any:
        script = self._scripts[name]
        async with self._store.calls():
            return await script(keys=[self._index], args=[self._w, *args])

    async def add_endpoint(self, endpoint: Endpoint) -> None:
        fields: list[str] = [
            "url",
            endpoint.url,
            "events",
            json.dumps(list(endpoint.events)),
            "secret",
            endpoint.secret,
            "created_at",
            str(_micros(endpoint.created_at)),
        ]
        if endpoint.workspace is not None:
            fields += ["workspace", endpoint.workspace]
        await self._script("add_endpoint", endpoint.id, _micros(endpoint.created_at), *fields)

    async def _endpoint_rows(self) -> list[tuple[Endpoint, int]]:
        store = self._store
        async with store.calls():
            client = store.client
            ids = cast("list[str]", await client.zrange(self._index, 0, -1))
            if not ids:
                return []
            async with client.pipeline(transaction=False) as pipe:
                for endpoint_id in ids:
                    pipe.hgetall(f"{self._w}endpoint:{endpoint_id}")
                replies: list[dict[str, str]] = await pipe.execute()
        rows = []
        for endpoint_id, fields in zip(ids, replies, strict=True):
            if not fields:
                continue
            created_at = _time(fields["created_at"])
            assert created_at is not None
            endpoint = Endpoint(
                id=endpoint_id,
                url=fields["url"],
                events=tuple(json.loads(fields["events"])),
                workspace=fields.get("workspace"),
                secret=fields["secret"],
                created_at=created_at,
                previous_secret=fields.get("previous_secret"),
                previous_until=_time(fields.get("previous_until")),
            )
            rows.append((endpoint, int(fields["since"])))
        return rows

    async def endpoints(self) -> list[Endpoint]:
        return [endpoint for endpoint, _ in await self._endpoint_rows()]

    async def remove_endpoint(self, endpoint_id: str) -> bool:
        return bool(await self._script("remove", endpoint_id))

    async def roll_secret(self, endpoint_id: str, secret: str, overlap_until: datetime) -> bool:
        return bool(await self._script("roll", endpoint_id, secret, _micros(overlap_until)))

    async def forget_previous_secrets(self, now: datetime) -> int:
        async with self._store.calls():
            return int(await self._forget(keys=[self._index], args=[self._w, _micros(now)]))

    async def _make(self, now: datetime, values: list[str]) -> int:
        made = 0
        chunk = 7 * 100
        for start in range(0, len(values), chunk):
            made += int(await self._script("make", _micros(now), *values[start : start + chunk]))
        return made

    async def make_deliveries(self, deliveries: Sequence[Timed], now: datetime) -> int:
        order = str(_micros(now))
        return await self._make(
            now,
            [
                value
                for due in deliveries
                for value in (
                    due.id,
                    due.webhook_id,
                    due.key_id,
                    due.event,
                    due.body.decode(),
                    order,
                    due.workspace,
                )
            ],
        )

    async def take(self, now: datetime, limit: int = 500) -> int:
        store = self._store
        rows = await self._endpoint_rows()
        async with store.calls():
            client = store.client
            pending = cast(
                "list[tuple[str, float]]",
                await client.zrange(store.outbox_index_name, 0, limit - 1, withscores=True),
            )
            if not pending:
                return 0
            async with client.pipeline(transaction=False) as pipe:
                for key_id, _ in pending:
                    pipe.lrange(store.outbox_name(key_id), 0, -1)
                outboxes: list[list[str]] = await pipe.execute()
        values: list[str] = []
        for entries in outboxes:
            for entry in entries:
                stamp, event, fields, used = json.loads(entry)
                record = _outboxed(event, fields, used)
                subject = subject_of(record)
                at = _time(stamp)
                assert at is not None
                for endpoint, since in rows:
                    sent = delivered_as(endpoint.events, event)
                    if int(stamp) <= since or sent is None:
                        continue
                    if endpoint.workspace not in (None, record.workspace):
                        continue
                    values += [
                        delivery_id(endpoint.id, subject, stamp, sent),
                        endpoint.id,
                        subject,
                        sent,
                        event_body(sent, at, record).decode(),
                        stamp,
                        record.workspace,
                    ]
        made = await self._make(now, values)
        # Each key as its last change left it, for the indexes of keys to look at (an
        # identity's outbox is none of theirs).
        await self._watch(
            now,
            [
                (key_id, json.loads(entries[-1])[2])
                for (key_id, _), entries in zip(pending, outboxes, strict=True)
                if entries and not key_id.startswith(_IDENTITY)
            ],
        )
        async with store.calls():
            async with client.pipeline(transaction=False) as pipe:
                for (key_id, _), entries in zip(pending, outboxes, strict=True):
                    if entries:
                        pipe.ltrim(store.outbox_name(key_id), len(entries), -1)
                await pipe.execute()
            await self._taken(
                keys=[store.outbox_index_name],
                args=[item for key_id, score in pending for item in (key_id, repr(score))],
            )
        return made

    async def expiring(self, now: datetime) -> int:
        await self._sweep(now)
        endpoints = wanting(await self.endpoints(), "key.expiring")
        if not endpoints:
            return 0
        # An endpoint no look was made for yet: every key that may be in a notice's window
        # is read once, so that it gets the notices due now as well (as on SQL).
        wanted = {endpoint.id for endpoint in endpoints}
        async with self._store.calls():
            known = await self._store.client.smembers(f"{self._w}expiring-endpoints")
        whole = not wanted <= set(known)
        upto = now + max(EXPIRING_NOTICES) if whole else now
        made: list[Timed] = []
        moves: list[str] = []
        for ids, scores, records in await self._looked_at("expiring", upto, whole):
            for key_id, score, record in zip(ids, scores, records, strict=True):
                if (
                    record is None
                    or record.state == "revoked"
                    or record.expires_at is None
                    or record.expires_at <= now
                ):
                    moves += [key_id, repr(score), ""]  # gone, revoked or expired: no notice
                    continue
                made += expiring_deliveries(endpoints, record, now)
                if score <= _micros(now):
                    then = _next_look(record.expires_at, now)
                    moves += [key_id, repr(score), str(_micros(then))]
        count = await self.make_deliveries(made, now)
        await self._reschedule("expiring", moves)
        if whole:
            async with self._store.calls():
                await self._store.client.sadd(f"{self._w}expiring-endpoints", *wanted)
        return count

    async def usage_thresholds(self, now: datetime) -> int:
        await self._sweep(now)
        every = await self.endpoints()
        endpoints = wanting(every, "key.usage_threshold")
        # An identity's credits: every identity is read, while an endpoint wants it.
        made: list[Timed] = await identity_usage_deliveries(every, self._store.identities(), now)
        if not endpoints:
            return await self.make_deliveries(made, now)
        moves: list[str] = []
        looked = str(_micros(now))
        for ids, scores, records in await self._looked_at("refilled", now, False):
            for key_id, score, record in zip(ids, scores, records, strict=True):
                if record is None or record.state == "revoked" or not record.credit_refill:
                    moves += [key_id, repr(score), ""]
                    continue
                made += usage_threshold_deliveries(endpoints, record, now)
                moves += [key_id, repr(score), looked]  # to the back of the line
        count = await self.make_deliveries(made, now)
        await self._reschedule("refilled", moves)
        return count

    async def _looked_at(
        self, index: str, upto: datetime, whole: bool
    ) -> list[tuple[list[str], list[float], list[KeyRecord | None]]]:
        """The keys of `index` scored up to `upto`, the lowest first, with their scores and
        records (None for a key that is gone), in chunks of `LOOK_LIMIT`: the first chunk
        only, unless `whole`."""
        store = self._store
        chunks = []
        start = 0
        async with store.calls():
            client = store.client
            while True:
                entries = cast(
                    "list[tuple[str, float]]",
                    await client.zrangebyscore(
                        f"{self._w}{index}",
                        "-inf",
                        _micros(upto),
                        start=start,
                        num=LOOK_LIMIT,
                        withscores=True,
                    ),
                )
                if not entries:
                    break
                hashes = await read_hashes(store, [key_id for key_id, _ in entries])
                chunks.append(
                    (
                        [key_id for key_id, _ in entries],
                        [score for _, score in entries],
                        [decode(*pair).record if pair[0] else None for pair in hashes],
                    )
                )
                if not whole or len(entries) < LOOK_LIMIT:
                    break
                start += LOOK_LIMIT
        return chunks

    async def _reschedule(self, index: str, moves: list[str]) -> None:
        chunk = 3 * 500
        for start in range(0, len(moves), chunk):
            await self._script("reschedule", index, *moves[start : start + chunk])

    async def _watch(self, now: datetime, keys: list[tuple[str, Mapping[str, str]]]) -> None:
        """Bring each key of `keys` (its id and hash fields as they are now; empty for a
        key that is gone) into the indexes the looks read (see `webhook_watch.lua`)."""
        values: list[str] = []
        for key_id, fields in keys:
            usable = bool(fields) and fields.get("state") != "revoked"
            refilled = usable and "credits" in fields and bool(fields.get("credit_refill"))
            values += [
                key_id,
                fields.get("expires_at", "") if usable else "",
                "1" if refilled else "",
            ]
        notices = ",".join(
            str(notice // timedelta(microseconds=1))
            for notice in sorted(EXPIRING_NOTICES, reverse=True)
        )
        chunk = 3 * 500
        for start in range(0, len(values), chunk):
            await self._script("watch", _micros(now), notices, *values[start : start + chunk])

    async def _sweep_identities(self) -> None:
        """On a cluster: count in the index of outboxes an identity's outbox that a process
        which died after the change's script left out of it, `SWEEP_SLICE` identities a
        look from a cursor the processes share (every identity within a pass)."""
        store = self._store
        async with store.calls():
            client = store.client
            end = int(await client.incrby(f"{self._w}identity-sweep", SWEEP_SLICE))
            ids = cast(
                "list[str]",
                await client.zrange(store.identities().all_index_name, end - SWEEP_SLICE, end - 1),
            )
            if len(ids) < SWEEP_SLICE:  # the pass is through: the next one starts over
                await client.set(f"{self._w}identity-sweep", 0)
            subjects = [identity_subject(one) for one in ids]
            if not subjects:
                return
            async with client.pipeline(transaction=False) as pipe:
                for subject in subjects:
                    pipe.exists(store.outbox_name(subject))
                found = await pipe.execute()
            for subject, count in zip(subjects, found, strict=True):
                if count:
                    await client.zincrby(store.outbox_index_name, 1, subject)

    async def _sweep(self, now: datetime) -> None:
        """Read the next slice of every key (`SWEEP_SLICE`, or `FIRST_SWEEP_SLICE` until
        a first pass is done), and bring those keys into the indexes: keys made before
        them, and changes no `take` saw, are found within a pass. On a cluster, also count
        an outbox a process that died after its change left out of the index of outboxes
        to take."""
        store = self._store
        cluster = store.deployment == "cluster"
        if cluster:
            await self._sweep_identities()
        async with store.calls():
            client = store.client
            size = SWEEP_SLICE if await client.exists(f"{self._w}swept") else FIRST_SWEEP_SLICE
            end = int(await client.incrby(f"{self._w}sweep", size))
            ids = cast("list[str]", await client.zrange(store.all_index_name, end - size, end - 1))
            if len(ids) < size:  # the pass is through: the next one starts over
                await client.set(f"{self._w}sweep", 0)
                await client.set(f"{self._w}swept", 1)
            if not ids:
                return
            async with client.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hmget(store.key_name(key_id), *_WATCHED)
                    if cluster:
                        pipe.exists(store.outbox_name(key_id))
                replies = await pipe.execute()
            step = 2 if cluster else 1
            if cluster:
                left_out = [key_id for key_id, n in zip(ids, replies[1::2], strict=True) if n]
                for key_id in left_out:
                    await client.zincrby(store.outbox_index_name, 1, key_id)
        await self._watch(
            now,
            [
                (
                    key_id,
                    {name: value for name, value in zip(_WATCHED, values, strict=True) if value},
                )
                for key_id, values in zip(ids, replies[::step], strict=True)
            ],
        )

    async def claim(
        self,
        holder: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        *,
        room: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        lease_ms = max(1, int((lease_until - now) / timedelta(milliseconds=1)))
        bounds: list[Any] = ["0"]
        if room is not None:
            bounds = ["1"]
            for endpoint, left in room.items():
                bounds += [endpoint, max(0, left)]
        flat = cast(
            "list[str]",
            await self._script("claim", _micros(now), lease_ms, holder, limit, CLAIM_SCAN, *bounds),
        )
        claimed = []
        for i in range(0, len(flat), 6):
            claimed_id, webhook_id, body, attempts, created_at, _ = flat[i : i + 6]
            claimed.append(
                Claimed(
                    id=claimed_id,
                    webhook_id=webhook_id,
                    body=body.encode(),
                    attempts=int(attempts),
                    created_at=cast(datetime, _time(created_at)),
                )
            )
        return claimed

    async def finish(
        self,
        delivery_id: str,
        holder: str,
        *,
        now: datetime,
        status: DeliveryStatus,
        next_attempt_at: datetime,
        response: int | None,
        error: str | None,
    ) -> None:
        await self._script(
            "finish",
            delivery_id,
            holder,
            status,
            _micros(now),
            _micros(next_attempt_at),
            "" if response is None else str(response),
            "" if error is None else error[:200],
        )

    async def deliveries(
        self,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        return await self.deliveries_page(None, status=status, workspace=workspace, limit=limit)

    async def deliveries_page(
        self,
        start: DeliveryPosition | None,
        *,
        status: DeliveryStatus | None = None,
        workspace: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        if workspace is not None:
            # The workspace's index, read newest first until `limit` of `status` are found.
            return await self._listed(f"ws:{workspace}", status, limit, start)
        index = "deliveries" if status is None else f"status:{status}"
        return await self._listed(index, None, limit, start)

    async def _listed(
        self,
        index: str,
        status: DeliveryStatus | None,
        limit: int,
        start: DeliveryPosition | None,
    ) -> list[Delivery]:
        """Up to `limit` deliveries (of `status`) of the listing `index`, after `start`:
        each chunk read after the last one read (`webhook_page.lua`), so that deliveries
        leaving the index meanwhile (delivered, pruned) never shift the next chunk."""
        store = self._store
        listed: list[Delivery] = []
        step = limit if status is None else max(limit, 200)
        while len(listed) < limit:
            after = [] if start is None else [start[0], start[1]]
            flat = cast("list[str]", await self._script("page", index, step, *after))
            ids = flat[::2]
            if not ids:
                break
            async with store.calls(), store.client.pipeline(transaction=False) as pipe:
                for delivery_id in ids:
                    pipe.hgetall(f"{self._w}delivery:{delivery_id}")
                replies: list[dict[str, str]] = await pipe.execute()
            for delivery_id, fields in zip(ids, replies, strict=True):
                if fields and (status is None or fields["status"] == status):
                    listed.append(_delivery(delivery_id, fields))
            if len(ids) < step:
                break
            start = (int(float(flat[-1])), ids[-1])
        return listed[:limit]

    async def delivery(self, delivery_id: str) -> Delivery | None:
        store = self._store
        async with store.calls():
            fields = await store.client.hgetall(f"{self._w}delivery:{delivery_id}")
        return _delivery(delivery_id, fields) if fields else None

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        return int(await self._script("prune", _micros(before), limit))

    async def replay(self, delivery_id: str, now: datetime) -> bool:
        replayed = int(await self._script("replay", delivery_id, _micros(now)))
        if replayed < 0:
            raise DeliveryInProgress(delivery_id)
        return bool(replayed)
