"""Usage on Redis: batches of counts applied exactly once, daily counts, their history.

Usage batches apply exactly once. Each send of a batch draws a random nonce, and each script
of it first looks at the batch's marker key: absent, it sets it to the nonce (with the
retention TTL) and applies; equal to the nonce (set by an earlier script of the same send),
it applies; anything else means an earlier send of this batch was applied, and it changes
nothing. On a single node the marker is one per batch and the scripts of a send run in one
MULTI/EXEC, back to back: a batch sent again after a lost EXEC reply, even at the same time
as the first send, is counted once, and a batch id once applied is skipped whatever it
carries. On a cluster the marker is one per batch and key, in the key's slot: each key's
usage of a batch is counted once, also when only some of the nodes applied a send.
"""

from __future__ import annotations

import builtins
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING, Final

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from apikeys.stores.contract import USAGE_BATCH_RETENTION
from apikeys.stores.redis.codec import encode_time
from apikeys.stores.shared import days_of
from apikeys.types import DailyUsage, UsageDelta

if TYPE_CHECKING:
    from apikeys.stores.redis.store import RedisStore

__all__ = ["DAILY_USAGE_RETENTION_DAYS", "RedisUsage"]

DAILY_USAGE_RETENTION_DAYS: Final = 400
"""How long a key's daily usage is kept on Redis, in days."""


class RedisUsage:
    """The usage side of `RedisStore`: `add` (its `add_usage`) and `history`
    (`usage_history`), with the store's names, client and the `add_usage.lua` script."""

    def __init__(self, store: RedisStore, script: AsyncScript) -> None:
        self._store = store
        self.script = script

    async def add(self, usage: Mapping[str, UsageDelta], batch_id: str) -> None:
        # A zero count changes nothing, not even last_used_at (as `KeyRecord.with_usage`).
        batch = [(key_id, delta) for key_id, delta in usage.items() if delta.count or delta.daily]
        if not batch:
            return
        async with self._store.calls():
            try:
                await self._send(batch, batch_id, uuid.uuid4().hex)
            except NoScriptError:
                # A server lost the script: every script of its share failed, nothing of it
                # applied, not even the marker. Load it and send the batch again, with a
                # new nonce: on a cluster, the markers another node set skip what it applied.
                self.script.sha = str(await self._store.client.script_load(self.script.script))
                await self._send(batch, batch_id, uuid.uuid4().hex)

    async def _send(
        self, batch: Sequence[tuple[str, UsageDelta]], batch_id: str, nonce: str
    ) -> None:
        # EVALSHA directly rather than through the Script object: inside a pipeline that would
        # cost a SCRIPT EXISTS round trip before every batch.
        sha = self.script.sha
        ttl = str(int(USAGE_BATCH_RETENTION.total_seconds()))
        # One MULTI/EXEC on one server; a cluster has no transaction across slots.
        async with self._store.client.pipeline(transaction=not self._store.usage_per_key) as pipe:
            for key_id, delta in batch:
                days = sorted({day for day, _ in delta.daily})
                slots = {day: index for index, day in enumerate(days, start=4)}
                triples = [
                    item
                    for (day, outcome), count in sorted(delta.daily.items())
                    for item in (str(slots[day]), outcome, str(count))
                ]
                pipe.execute_command(
                    "EVALSHA",
                    sha,
                    3 + len(days),
                    self._store.key_name(key_id),
                    self._store.usage_batch_name(batch_id, key_id),
                    self._store.use_name(key_id),
                    *(self._store.daily_usage_name(key_id, day) for day in days),
                    str(delta.count),
                    encode_time(delta.last_used_at),
                    nonce,
                    ttl,
                    str(DAILY_USAGE_RETENTION_DAYS * 86400),
                    *triples,
                )
            await pipe.execute()

    async def history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        today = datetime.now(UTC).date()
        days = [since + timedelta(days=n) for n in range(max(0, (today - since).days) + 1)]
        if not days:
            return []
        async with self._store.calls(), self._store.client.pipeline(transaction=False) as pipe:
            for day in days:
                pipe.hgetall(self._store.daily_usage_name(key_id, day.isoformat()))
            replies: list[dict[str, str]] = await pipe.execute()
        return days_of(
            (day.isoformat(), outcome, int(count))
            for day, reply in zip(days, replies, strict=True)
            for outcome, count in reply.items()
        )
