"""The Redis store's listings: every key of a workspace (or all), and a page after a cursor.

An index (`ws:<workspace>`, or `all`) is a sorted set of ids scored by `created_at`, so read
by rank it lists keys as `list` does: by creation time, then by id. The hashes of the ids
read (the key's and its use hash) are fetched in one round trip (`read_hashes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, cast

from apikeys.listing import KeyFilter, Position, after
from apikeys.stores.redis.codec import decode, encode_time
from apikeys.types import KeyRecord

if TYPE_CHECKING:
    from apikeys.stores.redis.store import RedisStore

__all__ = ["key_ids", "list_keys", "page_of_keys", "read_hashes"]


async def read_hashes(
    store: RedisStore, ids: Sequence[str]
) -> list[tuple[dict[str, str], dict[str, str]]]:
    """The hash and the use hash of each of `ids`, in one round trip (empty for a missing
    key): what `decode` reads."""
    async with store.client.pipeline(transaction=False) as pipe:
        for key_id in ids:
            pipe.hgetall(store.key_name(key_id))
            pipe.hgetall(store.use_name(key_id))
        replies: list[dict[str, str]] = await pipe.execute()
    return list(zip(replies[::2], replies[1::2], strict=True))


def _index(store: RedisStore, workspace: str | None) -> str:
    return store.all_index_name if workspace is None else store.workspace_index_name(workspace)


async def key_ids(store: RedisStore, workspace: str | None) -> list[str]:
    """Every id the index of `workspace` (or of all keys) names, oldest first."""
    return cast("list[str]", await store.client.zrange(_index(store, workspace), 0, -1))


async def list_keys(store: RedisStore, workspace: str | None) -> list[KeyRecord]:
    """`RedisStore.list`: every key of `workspace` (or all), oldest first."""
    async with store.calls():
        ids = await key_ids(store, workspace)
        if not ids:
            return []
        replies = await read_hashes(store, ids)
    records = []
    for fields, used in replies:
        # Skip index entries left by a failed insert or a refused duplicate.
        if not fields or (workspace is not None and fields.get("workspace") != workspace):
            continue
        records.append(decode(fields, used).record)
    records.sort(key=lambda record: (record.created_at, record.id))
    return records


async def page_of_keys(
    store: RedisStore, where: KeyFilter, *, start: Position | None, limit: int, now: datetime
) -> list[KeyRecord]:
    """`RedisStore.list_page`: up to `limit` keys that match `where`, after `start`.

    The index is read by rank from just after the cursor's own entry (ZRANK), however many
    keys share its creation time; `after` drops anything the cursor has passed (an entry
    added before it meanwhile shifts the ranks by one). Only the hashes of the ids read are
    fetched: a page costs about its own size, more when `owner`, `status` or `environment`
    leave keys out.
    """
    index = _index(store, where.workspace)
    # Room for the cursor's own entry; with a narrowing filter, for keys left out.
    batch = min(max(limit * 2, 64), 1000) if where.narrowed else limit + 1
    records: list[KeyRecord] = []
    async with store.calls():
        rank = 0 if start is None else await _rank_after(store, index, start)
        while len(records) < limit:
            ids = cast("list[str]", await store.client.zrange(index, rank, rank + batch - 1))
            if not ids:
                break
            rank += len(ids)
            for fields, used in await read_hashes(store, ids):
                if not fields or (
                    where.workspace is not None and fields.get("workspace") != where.workspace
                ):
                    continue  # an index entry left by a failed insert (see `list_keys`)
                record = decode(fields, used).record
                if after(record, start) and where.matches(record, now):
                    records.append(record)
                    if len(records) == limit:
                        break
            if len(ids) < batch:
                break
    return records


async def _rank_after(store: RedisStore, index: str, start: Position) -> int:
    """The rank in `index` of the first entry after `start`, or close before it."""
    created_at, key_id = start
    score = int(encode_time(created_at))
    async with store.client.pipeline(transaction=False) as pipe:
        pipe.zscore(index, key_id)
        pipe.zrank(index, key_id)
        pipe.zcount(index, "-inf", f"({score}")
        found, rank, below = await pipe.execute()
    if found is not None and rank is not None and int(found) == score:
        return int(rank) + 1
    # The cursor's key is not in this index (a cursor of another listing, or an entry
    # deleted by hand): start at its creation time, and let `after` skip ties before it.
    return int(below)
