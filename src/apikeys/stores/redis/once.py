"""The Redis store's one-time values (`KeyStore.put_once` and its kin): one string each.

Each value is one Redis key, `<prefix>once:<token>`, with the value's TTL, so every call is
one command or script on one key (one slot of a cluster) and atomic there: `take` is a
GET-and-DEL script, `put_once_if_absent` a `SET NX PX`, and `replace` a script that compares
the value before it sets or deletes it. Redis never returns an expired key.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from apikeys.stores.redis.codec import script

if TYPE_CHECKING:
    from apikeys.stores.redis.store import RedisStore

__all__ = ["OneTimeValues"]


def _milliseconds(ttl: timedelta) -> int:
    return int(ttl.total_seconds() * 1000)


class OneTimeValues:
    """`RedisStore`'s one-time values, with its names, client and scripts."""

    def __init__(self, store: RedisStore, client: Any) -> None:
        self._store = store
        self._take = client.register_script(script("take_once"))
        self._replace = client.register_script(script("replace_once"))

    def name(self, token: str) -> str:
        """The Redis key of the value under `token`."""
        return f"{self._store.key_prefix}once:{token}"

    async def put(self, token: str, value: str, ttl: timedelta, *, only_new: bool) -> bool:
        """`put_once`, or with `only_new` `put_once_if_absent`: whether `value` went in."""
        milliseconds = _milliseconds(ttl)
        async with self._store.calls():
            client = self._store.client
            if milliseconds <= 0:  # expired already: nothing is kept
                if not only_new:
                    await client.delete(self.name(token))
                return False
            return bool(await client.set(self.name(token), value, px=milliseconds, nx=only_new))

    async def take(self, token: str) -> str | None:
        async with self._store.calls():
            value = await self._take(keys=[self.name(token)])
        return None if value is None else str(value)

    async def peek(self, token: str) -> str | None:
        async with self._store.calls():
            value = await self._store.client.get(self.name(token))
        return None if value is None else str(value)

    async def replace(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        args = [old] if new is None else [old, new, max(1, _milliseconds(ttl))]
        async with self._store.calls():
            return bool(await self._replace(keys=[self.name(token)], args=args))
