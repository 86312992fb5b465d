"""Webhooks on the Redis store: each key's outbox, and deliveries in one hash slot.

The change scripts (`apikeys/stores/redis/scripts/common.lua`) append each change's event,
with the server's time and the key's fields without the hash, to the key's outbox
`<prefix>events:{<id>}`, in the key's own slot and in the change's own script. Then the
key's id is counted in `<prefix>events-pending`, the index of outboxes to take: in the same
script on one server or through Sentinel; on a cluster, where that index is in another
slot, right after it (and `expiring`, run every minute, finds any outbox a process that
died in between left out of it). The outbox lives a week after its last event.

`take` reads the indexed outboxes, makes one delivery per event and endpoint that wants it
(its id derived from endpoint, key and event time, so a take that is repeated after a
failure stores each delivery once), trims what it read, and drops an id from the index
only when no change was counted for it meanwhile. Order per key is the outbox's order.

Endpoints and deliveries live under `<prefix>{webhooks}:`, one slot, so each step of
theirs is one script: an endpoint is a hash (and `endpoints`, a sorted set by creation);
a delivery is a hash, in `due` (pending, by next attempt), `deliveries`, `status:<s>` and
`ws:<workspace>` (by event time, for listing), `finished` (delivered or failed, by last
attempt, for pruning), and, while pending, in its line `line:<endpoint>:<key>`. A lease is
`lease:<delivery>`, set with SET NX PX: it runs out by itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, cast

from apikeys.stores.redis.store import RedisStore, _decode, _decode_time, _encode_time, _lua
from apikeys.webhooks.base import (
    Claimed,
    Delivery,
    DeliveryStatus,
    Endpoint,
    Timed,
    WebhookStore,
    delivery_id,
    expiring_deliveries,
    usage_threshold_deliveries,
    wanting,
)
from apikeys.webhooks.events import EXPIRING_NOTICES, delivered_as, event_body

__all__ = ["RedisWebhooks"]


def _micros(moment: datetime) -> int:
    return int(_encode_time(moment))


def _time(value: str | None) -> datetime | None:
    return _decode_time(value)


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
    )


class RedisWebhooks(WebhookStore):
    """The webhook side of a `RedisStore` (see the module doc)."""

    def __init__(self, store: RedisStore) -> None:
        self._store = store
        self._w = f"{store.key_prefix}{{webhooks}}:"
        self._index = f"{self._w}endpoints"
        client = store._client_object
        self._scripts = {
            name: client.register_script(_lua(f"webhook_{name}"))
            for name in (
                "add_endpoint",
                "roll",
                "remove",
                "make",
                "claim",
                "finish",
                "replay",
                "prune",
            )
        }
        self._taken = client.register_script(_lua("webhook_taken"))

    async def _script(self, name: str, *args: Any) -> Any:
        script = self._scripts[name]
        async with self._store._calls():
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
        async with store._calls():
            client = store._client
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
        async with store._calls():
            client = store._client
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
                stamp, event, fields = json.loads(entry)
                record = _decode({**fields, "secret_hash": ""}).record
                at = _time(stamp)
                assert at is not None
                for endpoint, since in rows:
                    sent = delivered_as(endpoint.events, event)
                    if int(stamp) <= since or sent is None:
                        continue
                    if endpoint.workspace not in (None, record.workspace):
                        continue
                    values += [
                        delivery_id(endpoint.id, record.id, stamp, sent),
                        endpoint.id,
                        record.id,
                        sent,
                        event_body(sent, at, record).decode(),
                        stamp,
                        record.workspace,
                    ]
        made = await self._make(now, values)
        async with store._calls():
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
        store = self._store
        endpoints = wanting(await self.endpoints(), "key.expiring")
        async with store._calls():
            client = store._client
            ids = cast("list[str]", await client.zrange(store.all_index_name, 0, -1))
            async with client.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hmget(store.key_name(key_id), "state", "expires_at")
                    if store.deployment == "cluster":
                        pipe.exists(store.outbox_name(key_id))
                replies = await pipe.execute()
            step = 2 if store.deployment == "cluster" else 1
            if step == 2:
                # An outbox a process that died after its change left out of the index.
                left_out = [key_id for key_id, n in zip(ids, replies[1::2], strict=True) if n]
                for key_id in left_out:
                    await client.zincrby(store.outbox_index_name, 1, key_id)
            soonest = now + max(EXPIRING_NOTICES)
            expiring = [
                key_id
                for key_id, (state, expires_at) in zip(ids, replies[::step], strict=True)
                if state not in (None, "revoked")
                and expires_at
                and now < cast(datetime, _time(expires_at)) <= soonest
            ]
            if not endpoints or not expiring:
                return 0
            async with client.pipeline(transaction=False) as pipe:
                for key_id in expiring:
                    pipe.hgetall(store.key_name(key_id))
                hashes: list[dict[str, str]] = await pipe.execute()
        records = [_decode(fields).record for fields in hashes if fields]
        return await self.make_deliveries(
            [due for record in records for due in expiring_deliveries(endpoints, record, now)], now
        )

    async def usage_thresholds(self, now: datetime) -> int:
        store = self._store
        endpoints = wanting(await self.endpoints(), "key.usage_threshold")
        if not endpoints:
            return 0
        async with store._calls():
            client = store._client
            ids = cast("list[str]", await client.zrange(store.all_index_name, 0, -1))
            async with client.pipeline(transaction=False) as pipe:
                for key_id in ids:
                    pipe.hmget(store.key_name(key_id), "state", "credits", "credit_refill")
                replies = await pipe.execute()
            refilled = [
                key_id
                for key_id, (state, credits, refill) in zip(ids, replies, strict=True)
                if state not in (None, "revoked") and credits is not None and refill
            ]
            if not refilled:
                return 0
            async with client.pipeline(transaction=False) as pipe:
                for key_id in refilled:
                    pipe.hgetall(store.key_name(key_id))
                hashes: list[dict[str, str]] = await pipe.execute()
        records = [_decode(fields).record for fields in hashes if fields]
        return await self.make_deliveries(
            [
                due
                for record in records
                for due in usage_threshold_deliveries(endpoints, record, now)
            ],
            now,
        )

    async def claim(
        self, holder: str, now: datetime, lease_until: datetime, limit: int
    ) -> list[Claimed]:
        lease_ms = max(1, int((lease_until - now) / timedelta(milliseconds=1)))
        flat = cast("list[str]", await self._script("claim", _micros(now), lease_ms, holder, limit))
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
        if workspace is not None:
            # The workspace's index, read newest first until `limit` of `status` are found.
            return await self._listed(f"{self._w}ws:{workspace}", status, limit)
        index = f"{self._w}deliveries" if status is None else f"{self._w}status:{status}"
        return await self._listed(index, None, limit)

    async def _listed(
        self, index: str, status: DeliveryStatus | None, limit: int
    ) -> list[Delivery]:
        store = self._store
        listed: list[Delivery] = []
        start, step = 0, limit if status is None else max(limit, 200)
        async with store._calls():
            client = store._client
            while len(listed) < limit:
                ids = cast("list[str]", await client.zrevrange(index, start, start + step - 1))
                async with client.pipeline(transaction=False) as pipe:
                    for delivery_id in ids:
                        pipe.hgetall(f"{self._w}delivery:{delivery_id}")
                    replies: list[dict[str, str]] = await pipe.execute()
                for delivery_id, fields in zip(ids, replies, strict=True):
                    if fields and (status is None or fields["status"] == status):
                        listed.append(_delivery(delivery_id, fields))
                if len(ids) < step:
                    break
                start += step
        return listed[:limit]

    async def delivery(self, delivery_id: str) -> Delivery | None:
        store = self._store
        async with store._calls():
            fields = await store._client.hgetall(f"{self._w}delivery:{delivery_id}")
        return _delivery(delivery_id, fields) if fields else None

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        return int(await self._script("prune", _micros(before), limit))

    async def replay(self, delivery_id: str, now: datetime) -> bool:
        return bool(await self._script("replay", delivery_id, _micros(now)))
