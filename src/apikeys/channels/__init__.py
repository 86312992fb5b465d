"""Invalidation channels for `KeyCache`: one module per transport.

- `apikeys.channels.postgres`: PostgreSQL LISTEN/NOTIFY (the SQL store on PostgreSQL);
- `apikeys.channels.sqlite`: the SQLite file's own change log (the SQL store on SQLite);
- `apikeys.channels.redis`: Redis pub/sub (the Redis store; or any store, `native=False`).

The protocol that makes a cache safe on top of them is in `apikeys.cache`.
"""

from __future__ import annotations

from apikeys.channels.base import Channel, ChannelError

__all__ = ["Channel", "ChannelError"]
