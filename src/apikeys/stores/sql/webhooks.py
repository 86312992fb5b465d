"""Webhooks on the SQL store: the change log is the outbox.

The keys table's triggers write each change's event and the key's record (without its
hash) to `<table>_changes`, in the change's own transaction (`apikeys.stores.sql.log`).
The identities table's triggers write an identity's (`identity.*`, the record under
`identity`), named `i:<id>`. `take` hands the entries after each endpoint's mark
(`taken`) to `<table>_deliveries` and moves the mark in one transaction, so an entry
becomes exactly one delivery per endpoint; the log is never pruned past the lowest mark.
Deliveries are leased (`lease_until`, `leased_by`) with a conditional UPDATE, so no two
processes send one at the same time.
Each carries the workspace of its key (listed by `(workspace, seq)`, newest first, then
by id); those delivered or failed are pruned a batch at a time by `(status,
last_attempt_at)`.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from apikeys.errors import DeliveryInProgress
from apikeys.listing import DeliveryPosition
from apikeys.stores.contract import WebhookStore
from apikeys.stores.sql.schema import (
    audit_table,
    changes_table,
    identities_table,
    keys_table,
    webhook_deliveries_table,
    webhooks_table,
)
from apikeys.webhooks.events import (
    EXPIRING_NOTICES,
    Subject,
    delivered_as,
    event_body,
    identity_from_snapshot,
    record_from_snapshot,
    snapshot_record,
    subject_of,
)
from apikeys.webhooks.model import (
    Claimed,
    Delivery,
    DeliveryStatus,
    Endpoint,
    Timed,
    expiring_deliveries,
    fair_share,
    usage_threshold_deliveries,
    wanting,
)

__all__ = ["SQLWebhooks"]

_T = TypeVar("_T")


def _new_delivery_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _endpoint(row: Any) -> Endpoint:
    return Endpoint(
        id=row.id,
        url=row.url,
        events=tuple(json.loads(row.events)),
        workspace=row.workspace,
        secret=row.secret,
        created_at=row.created_at,
        previous_secret=row.previous_secret,
        previous_until=row.previous_until,
    )


def _delivery(row: Any) -> Delivery:
    return Delivery(
        id=row.id,
        webhook_id=row.webhook_id,
        key_id=row.key_id,
        event=row.event,
        status=cast(DeliveryStatus, row.status),
        attempts=row.attempts,
        created_at=row.created_at,
        next_attempt_at=row.next_attempt_at,
        last_attempt_at=row.last_attempt_at,
        last_status=row.last_status,
        last_error=row.last_error,
        workspace=row.workspace,
        order=row.seq,
    )


Run = Callable[[Callable[[AsyncConnection], Coroutine[Any, Any, Any]]], Awaitable[Any]]


class SQLWebhooks(WebhookStore):
    """The webhook tables of the keys table `keys_table_name`, used through `run` (the
    store's own: one transaction each, its errors translated, its tables made if missing)."""

    def __init__(self, run: Run, dialect: str, keys_table_name: str) -> None:
        self._run_work = run
        self._postgres = dialect == "postgresql"
        self._hooks = webhooks_table(keys_table_name)
        self._deliveries = webhook_deliveries_table(keys_table_name)
        self._changes = changes_table(keys_table_name)
        self._keys = keys_table(keys_table_name)
        self._audit = audit_table(keys_table_name)
        self._identities = identities_table(keys_table_name)

    async def _run(self, work: Callable[[AsyncConnection], Coroutine[Any, Any, _T]]) -> _T:
        return cast(_T, await self._run_work(work))

    async def add_endpoint(self, endpoint: Endpoint) -> None:
        hooks, changes = self._hooks, self._changes

        async def work(conn: AsyncConnection) -> None:
            mark = (
                await conn.execute(sa.select(sa.func.coalesce(sa.func.max(changes.c.seq), 0)))
            ).scalar_one()
            await conn.execute(
                sa.insert(hooks).values(
                    id=endpoint.id,
                    url=endpoint.url,
                    events=json.dumps(list(endpoint.events)),
                    workspace=endpoint.workspace,
                    secret=endpoint.secret,
                    taken=mark,
                    created_at=endpoint.created_at,
                )
            )

        await self._run(work)

    async def endpoints(self) -> list[Endpoint]:
        hooks = self._hooks

        async def work(conn: AsyncConnection) -> list[Endpoint]:
            rows = await conn.execute(sa.select(hooks).order_by(hooks.c.created_at, hooks.c.id))
            return [_endpoint(row) for row in rows]

        return await self._run(work)

    async def remove_endpoint(self, endpoint_id: str) -> bool:
        hooks, deliveries = self._hooks, self._deliveries

        async def work(conn: AsyncConnection) -> bool:
            await conn.execute(sa.delete(deliveries).where(deliveries.c.webhook_id == endpoint_id))
            result = await conn.execute(sa.delete(hooks).where(hooks.c.id == endpoint_id))
            return bool(result.rowcount)

        return await self._run(work)

    async def roll_secret(self, endpoint_id: str, secret: str, overlap_until: datetime) -> bool:
        hooks = self._hooks

        async def work(conn: AsyncConnection) -> bool:
            result = await conn.execute(
                sa.update(hooks)
                .where(hooks.c.id == endpoint_id)
                .values(previous_secret=hooks.c.secret, previous_until=overlap_until, secret=secret)
            )
            return bool(result.rowcount)

        return await self._run(work)

    async def forget_previous_secrets(self, now: datetime) -> int:
        hooks = self._hooks

        async def work(conn: AsyncConnection) -> int:
            result = await conn.execute(
                sa.update(hooks)
                .where(hooks.c.previous_secret.is_not(None), hooks.c.previous_until <= now)
                .values(previous_secret=None, previous_until=None)
            )
            return int(result.rowcount or 0)

        return await self._run(work)

    async def take(self, now: datetime, limit: int = 500) -> int:
        hooks, changes, deliveries = self._hooks, self._changes, self._deliveries
        audit = self._audit

        async def work(conn: AsyncConnection) -> int:
            # Lock every endpoint's row first: a concurrent `take` waits, then finds the
            # marks moved (the same entries never become two deliveries).
            await conn.execute(sa.update(hooks).values(taken=hooks.c.taken))
            rows = (await conn.execute(sa.select(hooks))).all()
            if not rows:
                return 0
            lowest = min(row.taken for row in rows)
            # The log's end first: every entry up to it has committed (the log has no
            # holes, see log.py), so the entries read next are all there are up to it.
            newest = (await conn.execute(sa.select(sa.func.max(changes.c.seq)))).scalar()
            if newest is None:
                return 0
            entries = (
                await conn.execute(
                    sa.select(changes.c.seq, changes.c.event, changes.c.data)
                    .where(
                        changes.c.seq > lowest,
                        changes.c.seq <= newest,
                        changes.c.event.is_not(None),
                    )
                    .order_by(changes.c.seq)
                    .limit(limit)
                )
            ).all()
            end = entries[-1].seq if len(entries) == limit else newest
            # A revocation is a leak's when the key's audit trail says so: it is written in
            # the revocation's own transaction, and a key is revoked once.
            revoked = {
                record_from_snapshot(json.loads(entry.data)["key"]).id
                for entry in entries
                if entry.event == "key.revoked"
            }
            leaked: set[str] = set()
            if revoked:
                leaked = set(
                    (
                        await conn.execute(
                            sa.select(audit.c.key_id).where(
                                audit.c.key_id.in_(revoked), audit.c.action == "leak_revoked"
                            )
                        )
                    ).scalars()
                )
            made = 0
            for row in rows:
                endpoint_events = tuple(json.loads(row.events))
                values = []
                for entry in entries:
                    if entry.seq <= row.taken:
                        continue
                    snapshot = json.loads(entry.data)
                    record = snapshot_record(snapshot)
                    event = entry.event
                    if event == "key.revoked" and record.id in leaked:
                        event = "key.leaked"
                    sent = delivered_as(endpoint_events, event)
                    if sent is None:
                        continue
                    if row.workspace is not None and row.workspace != record.workspace:
                        continue
                    at = datetime.fromisoformat(str(snapshot["at"]))
                    values.append(
                        {
                            "id": _new_delivery_id(),
                            "webhook_id": row.id,
                            "key_id": subject_of(record),
                            "workspace": record.workspace,
                            "seq": entry.seq,
                            "event": sent,
                            "body": event_body(sent, at, record).decode(),
                            "status": "pending",
                            "attempts": 0,
                            "created_at": now,
                            "next_attempt_at": now,
                        }
                    )
                if values:
                    await conn.execute(sa.insert(deliveries), values)
                    made += len(values)
                if end > row.taken:
                    await conn.execute(
                        sa.update(hooks).where(hooks.c.id == row.id).values(taken=end)
                    )
            return made

        return await self._run(work)

    async def claim(
        self,
        holder: str,
        now: datetime,
        lease_until: datetime,
        limit: int,
        *,
        room: Mapping[str, int] | None = None,
    ) -> list[Claimed]:
        d = self._deliveries
        earlier = d.alias("earlier")
        free = sa.or_(d.c.lease_until.is_(None), d.c.lease_until < now)
        first_in_line = ~sa.exists().where(
            earlier.c.webhook_id == d.c.webhook_id,
            earlier.c.key_id == d.c.key_id,
            earlier.c.status == "pending",
            earlier.c.seq < d.c.seq,
        )
        waiting = (d.c.status == "pending", d.c.next_attempt_at <= now, free)

        def due(*where: Any, count: int) -> Any:
            chosen = (
                sa.select(d.c.id, d.c.webhook_id, d.c.seq)
                .where(*waiting, first_in_line, *where)
                .order_by(d.c.seq)
                .limit(count)
            )
            return chosen.with_for_update(skip_locked=True, of=d) if self._postgres else chosen

        async def candidates(conn: AsyncConnection) -> list[Any]:
            if room is None:
                return list((await conn.execute(due(count=limit))).all())
            # One short query per endpoint with due deliveries and room: a backlog of one
            # endpoint is never read past to find another's.
            opened = sorted(endpoint for endpoint, left in room.items() if left > 0)
            if not opened or limit <= 0:
                return []
            busy = (
                await conn.execute(
                    sa.select(d.c.webhook_id).where(*waiting, d.c.webhook_id.in_(opened)).distinct()
                )
            ).scalars()
            rows: list[Any] = []
            for endpoint in sorted(busy):
                count = min(room[endpoint], limit)
                rows += (await conn.execute(due(d.c.webhook_id == endpoint, count=count))).all()
            return sorted(rows, key=lambda row: row.seq)

        async def work(conn: AsyncConnection) -> list[Claimed]:
            chosen = fair_share(await candidates(conn), lambda row: row.webhook_id, room, limit)
            if not chosen:
                return []
            leased = (
                await conn.execute(
                    sa.update(d)
                    .where(d.c.id.in_([row.id for row in chosen]), d.c.status == "pending", free)
                    .values(lease_until=lease_until, leased_by=holder)
                    .returning(d.c.id, d.c.webhook_id, d.c.body, d.c.attempts, d.c.created_at)
                )
            ).all()
            by_id = {row.id: row for row in leased}
            return [
                Claimed(
                    id=row.id,
                    webhook_id=row.webhook_id,
                    body=row.body.encode(),
                    attempts=row.attempts,
                    created_at=row.created_at,
                )
                for row in (by_id.get(item.id) for item in chosen)
                if row is not None
            ]

        return await self._run(work)

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
        d = self._deliveries

        async def work(conn: AsyncConnection) -> None:
            await conn.execute(
                sa.update(d)
                .where(d.c.id == delivery_id, d.c.leased_by == holder)
                .values(
                    status=status,
                    attempts=d.c.attempts + 1,
                    last_attempt_at=now,
                    next_attempt_at=next_attempt_at,
                    last_status=response,
                    last_error=None if error is None else error[:200],
                    lease_until=None,
                    leased_by=None,
                )
            )

        await self._run(work)

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
        d = self._deliveries
        statement = sa.select(d).order_by(d.c.seq.desc(), d.c.id.desc()).limit(limit)
        if start is not None:
            # `seq <=` first: the index on (workspace, seq) reads from the position on.
            seq, delivery_id = start
            statement = statement.where(d.c.seq <= seq, sa.or_(d.c.seq < seq, d.c.id < delivery_id))
        if status is not None:
            statement = statement.where(d.c.status == status)
        if workspace is not None:
            statement = statement.where(d.c.workspace == workspace)

        async def work(conn: AsyncConnection) -> list[Delivery]:
            return [_delivery(row) for row in await conn.execute(statement)]

        return await self._run(work)

    async def delivery(self, delivery_id: str) -> Delivery | None:
        d = self._deliveries

        async def work(conn: AsyncConnection) -> Delivery | None:
            row = (await conn.execute(sa.select(d).where(d.c.id == delivery_id))).first()
            return None if row is None else _delivery(row)

        return await self._run(work)

    async def prune(self, before: datetime, limit: int = 1000) -> int:
        d = self._deliveries
        # Served by the index on (status, last_attempt_at). The condition is repeated in
        # the DELETE: a row replayed meanwhile (pending again) stays.
        old = sa.and_(d.c.status.in_(("delivered", "failed")), d.c.last_attempt_at < before)
        chosen = sa.select(d.c.id).where(old).limit(limit)
        if self._postgres:
            chosen = chosen.with_for_update(skip_locked=True)
        batch = chosen.cte("old")  # run once (see `claim`)
        # The rows deleted are counted from RETURNING: SQLite's driver reports no count for
        # a statement that starts with WITH.
        statement = sa.delete(d).where(d.c.id.in_(sa.select(batch.c.id)), old).returning(d.c.id)

        async def work(conn: AsyncConnection) -> int:
            return len((await conn.execute(statement)).all())

        return await self._run(work)

    async def replay(self, delivery_id: str, now: datetime) -> bool:
        d = self._deliveries
        free = sa.or_(d.c.lease_until.is_(None), d.c.lease_until < now)

        async def work(conn: AsyncConnection) -> bool | None:
            # Only when no lease is held: a lease that ran out is cleared (its holder is
            # gone), a live one is left to its holder, and the replay refused.
            result = await conn.execute(
                sa.update(d)
                .where(d.c.id == delivery_id, free)
                .values(
                    status="pending",
                    created_at=now,
                    next_attempt_at=now,
                    lease_until=None,
                    leased_by=None,
                )
            )
            if result.rowcount:
                return True
            found = await conn.execute(sa.select(d.c.id).where(d.c.id == delivery_id))
            return None if found.first() is not None else False

        replayed = await self._run(work)
        if replayed is None:
            raise DeliveryInProgress(delivery_id)
        return replayed

    async def expiring(self, now: datetime) -> int:
        keys = self._keys
        soonest = now + max(EXPIRING_NOTICES)
        expiring = sa.select(keys).where(
            keys.c.state != "revoked",
            keys.c.expires_at.is_not(None),
            keys.c.expires_at > now,
            keys.c.expires_at <= soonest,
        )
        return await self._make_timed("key.expiring", expiring, expiring_deliveries, now)

    async def usage_thresholds(self, now: datetime) -> int:
        keys = self._keys
        refilled = sa.select(keys).where(
            keys.c.state != "revoked",
            keys.c.credits.is_not(None),
            keys.c.credit_refill.is_not(None),
        )
        made = await self._make_timed(
            "key.usage_threshold", refilled, usage_threshold_deliveries, now
        )
        identities = self._identities
        shared = sa.select(identities).where(
            identities.c.state != "revoked",
            identities.c.credits.is_not(None),
            identities.c.credit_refill.is_not(None),
        )
        return made + await self._make_timed(
            "identity.usage_threshold",
            shared,
            usage_threshold_deliveries,
            now,
            decode=identity_from_snapshot,
        )

    async def make_deliveries(self, deliveries: Sequence[Timed], now: datetime) -> int:
        if not deliveries:
            return 0
        hooks = self._hooks

        async def work(conn: AsyncConnection) -> int:
            taken = {row.id: row.taken for row in await conn.execute(sa.select(hooks))}
            return await self._insert_timed(conn, deliveries, taken, now)

        return await self._run(work)

    async def _make_timed(
        self,
        event: str,
        candidates: sa.Select[Any],
        deliveries: Callable[[list[Endpoint], Any, datetime], list[Timed]],
        now: datetime,
        *,
        decode: Callable[[Mapping[str, Any]], Subject] = record_from_snapshot,
    ) -> int:
        """Make the `event` deliveries (`deliveries`) the keys `candidates` selects call
        for (or the identities, with `decode` `identity_from_snapshot`), each unless one of
        its id is stored (made again by any process, in any round, a delivery is stored
        once)."""
        hooks = self._hooks

        async def work(conn: AsyncConnection) -> int:
            rows = (await conn.execute(sa.select(hooks))).all()
            endpoints = wanting(map(_endpoint, rows), event)
            if not endpoints:
                return 0
            made = [
                due
                for row in await conn.execute(candidates)
                for due in deliveries(endpoints, decode(dict(row._mapping)), now)
            ]
            return await self._insert_timed(conn, made, {row.id: row.taken for row in rows}, now)

        return await self._run(work)

    async def _insert_timed(
        self,
        conn: AsyncConnection,
        deliveries: Iterable[Timed],
        taken: Mapping[str, int],
        now: datetime,
    ) -> int:
        """Insert each delivery unless one of its id is stored; each is in line after its
        endpoint's mark (`taken`), and none is made for an endpoint not there."""
        insert = (
            postgresql.insert(self._deliveries)
            if self._postgres
            else sqlite.insert(self._deliveries)
        ).on_conflict_do_nothing()
        made = 0
        for due in deliveries:
            if due.webhook_id not in taken:
                continue
            value = {
                "id": due.id,
                "webhook_id": due.webhook_id,
                "key_id": due.key_id,
                "workspace": due.workspace,
                "seq": taken[due.webhook_id],
                "event": due.event,
                "body": due.body.decode(),
                "status": "pending",
                "attempts": 0,
                "created_at": now,
                "next_attempt_at": now,
            }
            made += (await conn.execute(insert.values(value))).rowcount or 0
        return made
