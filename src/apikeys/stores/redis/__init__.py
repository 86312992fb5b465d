"""The Redis store, on a single node, Sentinel or a Redis Cluster.

- `client`: the one client factory (URL forms, connection defaults) that the store and the
  rate limiter share.
- `checks`: what the store needs of its servers (`maxmemory-policy`, persistence), checked
  at `setup()`.
- `store`: `RedisStore`, its key layout and its change scripts (`scripts/*.lua`).
"""

from __future__ import annotations

from apikeys.stores.redis.client import RedisTarget, connection_defaults, parse_redis_url
from apikeys.stores.redis.store import DAILY_USAGE_RETENTION_DAYS, DEFAULT_KEY_PREFIX, RedisStore

__all__ = [
    "DAILY_USAGE_RETENTION_DAYS",
    "DEFAULT_KEY_PREFIX",
    "RedisStore",
    "RedisTarget",
    "connection_defaults",
    "parse_redis_url",
]
