"""What the Redis store needs of its servers, checked at `setup()` on every master.

- `maxmemory-policy`: a policy that may evict a key without a TTL (`allkeys-lru`,
  `allkeys-lfu`, `allkeys-random`) deletes API keys, their audit trails and their state
  silently once memory fills: a key then answers 401 and vanishes from lists, and nothing
  says why. Such a server is refused (`ConfigurationError`). `noeviction` (writes fail when
  memory is full, which apikeys reports as errors) and the `volatile-*` policies (only keys
  with a TTL are evicted: never a key's record or audit trail, though its usage history,
  undelivered webhook events, usage-batch markers and one-time values have TTLs; see
  docs/deploying.md) are accepted.
- Persistence: with neither RDB snapshots (`save`) nor the append-only file, a restart
  empties the server and every key is gone. That is a warning in the log, not a refusal:
  a cache-only test server is a fair choice.

The policy is read with `CONFIG GET`, or from `INFO memory` where `CONFIG` is renamed or
not allowed (managed services); when neither answers, a warning says it was not checked.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from redis.exceptions import ResponseError

from apikeys.errors import ConfigurationError

__all__ = ["ACCEPTED_POLICIES", "check_servers"]

logger = logging.getLogger("apikeys")

ACCEPTED_POLICIES: Final = (
    "noeviction",
    "volatile-lru",
    "volatile-lfu",
    "volatile-random",
    "volatile-ttl",
)
"""The `maxmemory-policy` values that never evict a key without a TTL."""


async def check_servers(client: Any, *, cluster: bool, where: str) -> None:
    """Refuse a master whose `maxmemory-policy` may evict keys without a TTL, and warn about
    one that keeps no data across a restart (see the module doc). `client` is the store's
    `Redis` (a single node, or Sentinel's master: `where` names it in messages) or
    `RedisCluster` (each master is read, and named by its address)."""
    if not cluster:
        await _check_master(client, where, None)
        return
    await client.initialize()  # the slot map, and so the masters (once per client)
    for node in client.get_primaries():
        await _check_master(client, node.name, node)


async def _check_master(client: Any, name: str, node: Any) -> None:
    policy = await _policy(client, node)
    if policy is None:
        logger.warning(
            "apikeys: could not read the maxmemory-policy of the Redis server (%s): CONFIG "
            "and INFO refused: make sure it is noeviction or volatile-*, or keys may be "
            "evicted",
            name,
        )
    elif policy not in ACCEPTED_POLICIES:
        raise ConfigurationError(
            f"the Redis server ({name}) has maxmemory-policy {policy}, which evicts keys "
            "without a TTL: API keys would be deleted silently once memory fills. Set "
            "maxmemory-policy to noeviction or a volatile-* policy (volatile-lru, "
            "volatile-lfu, volatile-random, volatile-ttl), or give apikeys a Redis of its own"
        )
    if await _persistence_off(client, node):
        logger.warning(
            "apikeys: the Redis server (%s) keeps no data across a restart (no RDB save, no "
            "appendonly): a restart deletes every API key. Turn on persistence",
            name,
        )


async def _config(client: Any, node: Any, parameter: str) -> str | None:
    """A configuration parameter, or None where `CONFIG` is renamed or not allowed."""
    try:
        if node is None:
            reply = await client.config_get(parameter)
        else:
            reply = await client.config_get(parameter, target_nodes=node)
    except ResponseError:
        return None
    if parameter not in reply and len(reply) == 1:  # a cluster's answer, keyed by node
        [reply] = reply.values()
    value = reply.get(parameter)
    return None if value is None else str(value)


async def _info(client: Any, node: Any, section: str) -> dict[str, Any] | None:
    try:
        if node is None:
            reply = await client.info(section)
        else:
            reply = await client.info(section, target_nodes=node)
    except ResponseError:
        return None
    if reply and all(isinstance(value, dict) for value in reply.values()) and len(reply) == 1:
        [reply] = reply.values()
    return dict(reply)


async def _policy(client: Any, node: Any) -> str | None:
    policy = await _config(client, node, "maxmemory-policy")
    if policy is None:
        memory = await _info(client, node, "memory")
        if memory is not None and "maxmemory_policy" in memory:
            policy = str(memory["maxmemory_policy"])
    return policy


async def _persistence_off(client: Any, node: Any) -> bool:
    """True only when the server says so: no `save` points and no append-only file. Where
    `CONFIG` is refused nothing can be told of the snapshots: no warning."""
    save = await _config(client, node, "save")
    appendonly = await _config(client, node, "appendonly")
    if save is None or appendonly is None:
        return False
    return not save.strip() and appendonly == "no"
