"""The Redis backend, on a single node, Sentinel or a Redis Cluster.

- `client`: the one client factory (URL forms, connection defaults) that the store, the
  channel and the rate limiter share.
- `checks`: what the store needs of its servers (`maxmemory-policy`, persistence), checked
  at `setup()`.
- `store`: `RedisStore`, its changes as Lua scripts (`scripts/*.lua`); `codec`: its key
  layout and hash fields; `listing`: its listings and pages; `usage`: usage batches applied
  exactly once.
- `webhooks`: `RedisWebhooks`, endpoints and deliveries; `channel`: the change channel
  (pub/sub and client tracking).
"""

from __future__ import annotations

from apikeys.stores.redis.client import RedisTarget, connection_defaults, parse_redis_url
from apikeys.stores.redis.store import DEFAULT_KEY_PREFIX, RedisStore
from apikeys.stores.redis.usage import DAILY_USAGE_RETENTION_DAYS

__all__ = [
    "DAILY_USAGE_RETENTION_DAYS",
    "DEFAULT_KEY_PREFIX",
    "RedisStore",
    "RedisTarget",
    "connection_defaults",
    "parse_redis_url",
]
