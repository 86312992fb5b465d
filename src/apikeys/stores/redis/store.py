"""The Redis store: one hash per key, sorted-set indexes, Lua scripts for every change.

The layout of its keys and fields is in `codec.py`; how usage batches apply exactly once, in
`usage.py`.

Atomicity: every change of a key is one Lua script (in `scripts/`) on its hash and its audit
list, and returns the hash as it is afterwards, in one round trip. `add_usage` sends one
script per key; on a single node (or through Sentinel) they go in one MULTI/EXEC, so a
batch applies whole or not at all; on a cluster each key's script stands alone.

`insert` first adds the id to both indexes (`ZADD NX`), then creates the hash with a
create-if-absent script. The indexes live in other slots than the hash, so these are two
steps, not one transaction. The order means `list` never misses a stored key: a failure
between the steps, or a refused duplicate, leaves at most an index entry whose hash is
missing or belongs to another workspace, and `list` skips such entries.

Durability: with `wait_replicas=N`, each change is followed by `WAIT N timeout` on the same
connection, so it returns only once N replicas have it, and a failover cannot lose it. A
change the replicas did not confirm in time raises `ChangeNotConfirmed` (a
`StoreUnavailable` that says the change was committed on the master). The default, `auto`,
is decided at each change, never kept: 1 when the key's master has a replica connected at
that moment (its `INFO replication`, read just before the change), else 0. A process that
started while the replica was down waits for it as soon as it is back.

No command is retried automatically: a retried write could apply twice (an increment) or
report its own success as a conflict. Redirections (MOVED, ASK) are followed, as they ran
nothing. Pooled connections the server has closed (after a Redis restart) are detected and
replaced when they are taken from the pool, so the next call after Redis comes back
succeeds. Connection failures, timeouts and the cluster's and replicas' refusals during a
failover are `StoreUnavailable`.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Collection, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import date, datetime, timedelta
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    NoScriptError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from apikeys.errors import (
    APIKeyError,
    ChangeNotConfirmed,
    ConfigurationError,
    DuplicateKeyId,
    KeyNotFound,
    StoreUnavailable,
)
from apikeys.listing import KeyFilter, Position
from apikeys.stores.contract import MAX_ROLL_HOPS, KeyStore
from apikeys.stores.redis.channel import (
    RedisChannel,
    RedisClusterChannel,
    channel_for,
    notices_channel,
)
from apikeys.stores.redis.checks import check_servers
from apikeys.stores.redis.client import (
    CLUSTER_SCHEMES,
    DEFAULT_WAIT_TIMEOUT,
    SENTINEL_SCHEMES,
    RedisTarget,
    check_wait_timeout,
    parse_redis_url,
    redis_client,
)
from apikeys.stores.redis.codec import (
    audit_line,
    decode,
    encode,
    encode_field,
    encode_time,
    event_text,
    pairs,
    script,
)
from apikeys.stores.redis.listing import key_ids, list_keys, page_of_keys
from apikeys.stores.redis.once import OneTimeValues
from apikeys.stores.redis.usage import RedisUsage
from apikeys.stores.shared import select_events
from apikeys.types import AuditEvent, DailyUsage, KeyRecord, StoredKey, StoredState, UsageDelta
from apikeys.webhooks.events import EVENT_OF_ACTION

if TYPE_CHECKING:
    from apikeys.stores.redis.identities import RedisIdentities
    from apikeys.stores.redis.webhooks import RedisWebhooks

__all__ = ["DEFAULT_KEY_PREFIX", "RedisStore"]


DEFAULT_KEY_PREFIX = "apikeys:"


@contextmanager
def _unavailable_as_store_error() -> Iterator[None]:
    """Turn every failure of a call to Redis into `StoreUnavailable` (503): connection
    failures, timeouts and failover refusals, and also whatever else the client raises.

    redis-py's cluster client can fail in the middle of a resharding with errors that are
    no Redis error at all (an AttributeError on an ASK to a node it does not know, in
    redis-py 8.1); a Redis reply the store did not expect (a key overwritten by another
    client with another type) is no reason to answer 500 either. apikeys' own errors pass.
    """
    try:
        yield
    except APIKeyError:
        raise
    except Exception as exc:
        raise StoreUnavailable(exc) from exc


def _check_key_prefix(key_prefix: str) -> str:
    if "{" in key_prefix or "}" in key_prefix:
        raise ConfigurationError(
            "the Redis key_prefix may not contain '{' or '}': the store puts each key's "
            "id in a {hash tag} of its own"
        )
    return key_prefix


class RedisStore(KeyStore):
    """Keys in Redis: a single node, a Sentinel-managed master, or a Redis Cluster.

    Build it with `store_from_url("redis://…")` (or `redis+sentinel://…`,
    `redis+cluster://…`) / `RedisStore.from_url`, or hand it a `redis.asyncio.Redis` or
    `redis.asyncio.RedisCluster` client created with `decode_responses=True`. The store owns
    the client: `aclose()` closes it.

    `wait_replicas` is how many replicas must acknowledge each change before it returns
    (None, the default `auto`: 1 when the change's master has a replica connected at that
    moment, decided at each change, else 0); `wait_timeout` how
    many seconds they have (see the module doc).
    """

    schemes = ("redis", "rediss", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)

    def __init__(
        self,
        client: Redis | RedisCluster,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        wait_replicas: int | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
    ) -> None:
        _check_key_prefix(key_prefix)
        if not client.get_encoder().decode_responses:
            raise ConfigurationError("the Redis client must be created with decode_responses=True")
        if wait_replicas is not None and wait_replicas < 0:
            raise ConfigurationError("wait_replicas must be None (auto) or >= 0")
        check_wait_timeout(client, wait_timeout)
        self._client_object = client
        self._cluster = isinstance(client, RedisCluster)
        self._target: RedisTarget | None = None
        self._sentinel: Sentinel | None = None
        # Through Sentinel: calls are held (StoreUnavailable) from when the key cache's
        # channel finds the master in doubt until it is subscribed on one every sentinel names.
        self._held = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prefix = key_prefix
        self._all_index = f"{key_prefix}all"
        self._wait_replicas = wait_replicas
        self._wait_timeout = wait_timeout
        self._insert = client.register_script(script("insert"))
        self._set_state = client.register_script(script("set_state"))
        self._shorten_expiry = client.register_script(script("shorten_expiry"))
        self._spend_credits = client.register_script(script("spend_credits"))
        self._replace_hash = client.register_script(script("replace_hash"))
        self._update = client.register_script(script("update"))
        self._claim_setting = client.register_script(script("claim_setting"))
        self._one_time = OneTimeValues(self, client)
        self._get_to_cache = client.register_script(script("get_to_cache"))
        self._usage = RedisUsage(self, client.register_script(script("add_usage")))
        self._identities: RedisIdentities | None = None

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """A store on a new client for `url`, with connections of its own.

        `url` is `redis://host:port/db`, `rediss://…`, `unix:///path`,
        `redis+sentinel://host:port[,host:port…]/service_name[/db]` or
        `redis+cluster://host:port[,host:port…]`. Options, as keywords or in the URL's query
        string: `key_prefix` (default `apikeys:`) namespaces every Redis key of the store;
        `wait_replicas` and `wait_timeout` (see the class doc). Any other option is a
        connection option of redis-py and overrides the defaults: 2 s connect and socket
        timeouts, a health check after 30 s idle, no automatic retries, RESP2, and at most
        50 connections (per node, on a cluster; a single node's pool waits up to 2 s,
        `timeout`, for a free one). `decode_responses` is always on.
        """
        parts = urlsplit(url)
        query = parse_qsl(parts.query)
        given = [value for name, value in query if name == "key_prefix"]
        if given:  # the store's own option: not one for the connection
            rest = urlencode([(name, value) for name, value in query if name != "key_prefix"])
            url = urlunsplit(parts._replace(query=rest))
            options.setdefault("key_prefix", given[-1])
        target = parse_redis_url(url)
        key_prefix = _check_key_prefix(str(options.pop("key_prefix", DEFAULT_KEY_PREFIX)))
        wait_replicas = options.pop("wait_replicas", target.wait_replicas)
        wait_timeout = float(options.pop("wait_timeout", target.wait_timeout))
        client, sentinel = redis_client(target, **options)
        store = cls(
            client,
            key_prefix=key_prefix,
            wait_replicas=None if wait_replicas in (None, "auto") else int(wait_replicas),
            wait_timeout=wait_timeout,
        )
        store._target = target
        store._sentinel = sentinel
        return store

    def __repr__(self) -> str:
        return f"RedisStore({self._where()}, key_prefix={self._prefix!r})"

    def _where(self) -> str:
        # Built from hosts, ports and db only: never the URL, which may hold a password.
        if self._target is not None:
            where = self._target.describe()
        elif self._cluster:
            where = "cluster"
        else:
            kwargs = cast(Redis, self._client_object).connection_pool.connection_kwargs
            if "path" in kwargs:
                where = f"path={kwargs['path']!r}"
            else:
                host, port = kwargs.get("host", "localhost"), kwargs.get("port", 6379)
                where = f"host={host!r}, port={port!r}, db={kwargs.get('db', 0)!r}"
        return where

    @property
    def deployment(self) -> str:
        """`single`, `sentinel` or `cluster`."""
        if self._cluster:
            return "cluster"
        if self._target is not None:
            return self._target.kind
        return "single"

    @property
    def _client(self) -> Any:
        # redis-py's connections belong to the event loop that opened them. A store used on
        # a new loop after its first one closed (a key issued under `asyncio.run`, then the
        # app served by uvicorn) lets the old loop's connections go: they can be neither
        # used nor closed any more, and the garbage collector closes their sockets.
        client = self._client_object
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return client
        if loop is not self._loop:
            if self._loop is not None and self._loop.is_closed() and not self._cluster:
                cast(Redis, client).connection_pool.reset()  # type: ignore[no-untyped-call]
            self._loop = loop
        return client

    @asynccontextmanager
    async def calls(self) -> AsyncIterator[None]:
        """Around every call to Redis: this loop's connections, and failures as
        `StoreUnavailable` (the scripts reach the client without the property).

        On a cluster a failure also makes the client learn the slot map again on its next
        call, as redis-py does after a failed single command but not after a failed
        pipeline: else a pipeline would keep going to a master that a failover replaced.
        """
        client = self._client
        if self._held:
            raise StoreUnavailable(
                RedisConnectionError("the Sentinel master is changing: calls wait for the new one")
            )
        try:
            with _unavailable_as_store_error():
                if self._cluster:
                    # Until it knows the slot map (a new process, or closed by a failure)
                    # redis-py 8.1 routes a call as keyless: concurrent first calls met
                    # MOVED at random masters, and it closed itself under the others.
                    await client.initialize()
                yield
        except StoreUnavailable:
            if self._cluster:
                with suppress(Exception):
                    await client.aclose()
            raise

    @property
    def key_prefix(self) -> str:
        return self._prefix

    @property
    def client(self) -> Any:
        """The underlying `redis.asyncio.Redis` (or `RedisCluster`) client."""
        return self._client

    def key_name(self, key_id: str) -> str:
        """The Redis key of the hash that holds key `key_id`."""
        return f"{self._prefix}key:{{{key_id}}}"

    def use_name(self, key_id: str) -> str:
        """The hash that counts key `key_id`'s requests (`request_count`, `last_used_at`):
        apart from the key's hash, so that counting a request is not a change of the key
        that every process's key cache would hear of and drop the key for."""
        return f"{self._prefix}used:{{{key_id}}}"

    def audit_list_name(self, key_id: str) -> str:
        """The Redis key of the list of key `key_id`'s audit events."""
        return f"{self._prefix}audit:{{{key_id}}}"

    def workspace_index_name(self, workspace: str) -> str:
        """The Redis key of the sorted set that indexes `workspace`."""
        return f"{self._prefix}ws:{workspace}"

    def daily_usage_name(self, key_id: str, day: str) -> str:
        """The hash of one key's requests on one UTC day, by outcome."""
        return f"{self._prefix}usage:{{{key_id}}}:{day}"

    def usage_batch_name(self, batch_id: str, key_id: str | None = None) -> str:
        """The Redis key that marks usage batch `batch_id` as applied: one per batch on a
        single node; on a cluster, one per batch and key (give `key_id`), in its slot."""
        if self._cluster and key_id is not None:
            return f"{self._prefix}usage-batch:{{{key_id}}}:{batch_id}"
        return f"{self._prefix}usage-batch:{batch_id}"

    def outbox_name(self, key_id: str) -> str:
        """The list of key `key_id`'s webhook events not taken yet (see `webhooks.py`)."""
        return f"{self._prefix}events:{{{key_id}}}"

    @property
    def outbox_index_name(self) -> str:
        """The sorted set of the ids whose outbox may hold events, each scored by a count
        of its changes (`apikeys.stores.redis.webhooks`)."""
        return f"{self._prefix}events-pending"

    def identities(self) -> RedisIdentities:
        """Identities on this store's server (`apikeys.stores.redis.identities`)."""
        if self._identities is None:
            from apikeys.stores.redis.identities import RedisIdentities

            self._identities = RedisIdentities(self)
        return self._identities

    def webhooks(self) -> RedisWebhooks:
        """Endpoints and deliveries on this store's server (`apikeys.stores.redis.webhooks`)."""
        from apikeys.stores.redis.webhooks import RedisWebhooks

        return RedisWebhooks(self)

    @property
    def all_index_name(self) -> str:
        """The Redis key of the sorted set that indexes every key."""
        return self._all_index

    async def setup(self) -> None:
        """Check the servers and load the scripts into their cache (every master's, on a
        cluster). Raises `ConfigurationError` on a server whose `maxmemory-policy` may evict
        keys without a TTL, and logs a warning for one without persistence (see
        `apikeys.stores.redis.checks`). Idempotent: a script the server has lost (restart,
        `SCRIPT FLUSH`, a failover) is loaded again on first use."""
        async with self.calls():
            await check_servers(self._client, cluster=self._cluster, where=self._where())
            for script in self._scripts():
                script.sha = str(await self._client.script_load(script.script))

    def _scripts(self) -> tuple[AsyncScript, ...]:
        return (
            self._insert,
            self._set_state,
            self._shorten_expiry,
            self._spend_credits,
            self._replace_hash,
            self._update,
            self._usage.script,
            self._claim_setting,
            self._get_to_cache,
        )

    async def _replicas_to_wait_for(self, node: Any) -> int:
        """`wait_replicas`; for `auto`, 1 when the master of the change (`node`, on a
        cluster) has a replica connected now, else 0. Read for each change, never kept: a
        replica that connects later is waited for from the next change on."""
        if self._wait_replicas is not None:
            return self._wait_replicas
        if self._cluster:
            reply = await self._client.info("replication", target_nodes=node)
            if "connected_slaves" not in reply:  # keyed by node name
                [reply] = reply.values()
        else:
            reply = await self._client.info("replication")
        return 1 if int(reply.get("connected_slaves", 0)) > 0 else 0

    async def aclose(self) -> None:
        await self._client.aclose()
        if self._sentinel is not None:
            for sentinel in self._sentinel.sentinels:
                await sentinel.aclose()

    async def _change(
        self, script: AsyncScript, keys: builtins.list[str], args: builtins.list[Any]
    ) -> Any:
        """Run a change script (see `change_once`). On a cluster the index of keys with
        webhook events is in another slot: the id is added to it right after the script
        (a process that dies in between leaves it to `RedisWebhooks.expiring` to find)."""
        reply = await self.change_once(script, keys, args)
        if self._cluster and args[-4]:
            key_id = keys[0][len(self._prefix) + len("key:{") : -1]
            await self._client.zincrby(self.outbox_index_name, 1, key_id)
        return reply

    async def change_once(
        self, script: AsyncScript, keys: builtins.list[str], args: builtins.list[Any]
    ) -> Any:
        """Run a change script; with `wait_replicas`, wait on the same connection until that
        many replicas have it (see the module doc)."""
        client = self._client
        node = client.get_node_from_key(keys[0]) if self._cluster else None
        replicas = await self._replicas_to_wait_for(node)
        if not replicas:
            return await script(keys=keys, args=args)
        timeout_ms = max(1, int(self._wait_timeout * 1000))
        if script.sha is None or script.sha == "":
            script.sha = str(await client.script_load(script.script))
        asking = None
        for attempt in (1, 2, 3):
            # One pipeline: EVALSHA and WAIT travel on one connection to the key's master,
            # and WAIT counts the replicas that have that connection's writes.
            async with client.pipeline(transaction=False) as pipe:
                # execute_command: redis-py's cluster pipeline refuses its evalsha method.
                if self._cluster:
                    target = asking or node
                    if asking is not None:
                        pipe.execute_command("ASKING", target_nodes=target)
                    pipe.execute_command(
                        "EVALSHA", script.sha, len(keys), *keys, *args, target_nodes=target
                    )
                    pipe.execute_command("WAIT", replicas, timeout_ms, target_nodes=target)
                    results = await pipe.execute(raise_on_error=False, allow_redirections=False)
                else:
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
                    pipe.execute_command("WAIT", replicas, timeout_ms)
                    results = await pipe.execute(raise_on_error=False)
            reply, acknowledged = results[-2:]
            if isinstance(reply, NoScriptError) and attempt < 3:
                # Nothing ran: the server lost the script (restart, failover). Load it, again.
                script.sha = str(await client.script_load(script.script))
                continue
            if isinstance(reply, AskError) and asking is None:
                # The key's slot is moving to another master, which holds the key's data
                # already: nothing ran. Ask that master, with ASKING on the same connection
                # (`redis-cli -c` does the same).
                asking = client.get_node(node_name=f"{reply.host}:{reply.port}")
                if asking is not None:
                    continue
            if isinstance(reply, BaseException):
                raise reply
            if isinstance(acknowledged, BaseException) or int(acknowledged) < replicas:
                raise ChangeNotConfirmed(
                    replicas,
                    0 if isinstance(acknowledged, BaseException) else int(acknowledged),
                    self._wait_timeout,
                )
            return reply
        raise AssertionError("unreachable")  # pragma: no cover

    async def claim_setting(
        self, name: str, value: str, *, replacing: Collection[str] = ()
    ) -> str | None:
        async with self.calls():
            recorded = await self._claim_setting(
                keys=[f"{self._prefix}setting:{name}"], args=[value, *replacing]
            )
        return str(recorded)

    async def put_once(self, token: str, value: str, ttl: timedelta) -> None:
        await self._one_time.put(token, value, ttl, only_new=False)

    async def take_once(self, token: str) -> str | None:
        return await self._one_time.take(token)

    async def peek_once(self, token: str) -> str | None:
        return await self._one_time.peek(token)

    async def put_once_if_absent(self, token: str, value: str, ttl: timedelta) -> bool:
        return await self._one_time.put(token, value, ttl, only_new=True)

    async def replace_once(self, token: str, old: str, new: str | None, ttl: timedelta) -> bool:
        return await self._one_time.replace(token, old, new, ttl)

    async def insert(self, stored: StoredKey, *, event: AuditEvent | None = None) -> None:
        record = stored.record
        score = int(encode_time(record.created_at))
        async with self.calls():
            # Indexes first, so that a stored key is always listed (see the module docstring).
            async with self._client.pipeline(transaction=False) as pipe:
                pipe.zadd(self.workspace_index_name(record.workspace), {record.id: score}, nx=True)
                pipe.zadd(self._all_index, {record.id: score}, nx=True)
                await pipe.execute()
            created = await self._change(
                self._insert, self._keys(record.id), [*encode(stored), *self._tail(event, None)]
            )
        if not created:
            raise DuplicateKeyId(record.id)

    async def get(self, key_id: str) -> StoredKey | None:
        # Without a cache, the hot path: one script reads the key's hash and its counts.
        stored, _ = await self.get_to_cache(key_id)
        return stored

    async def get_to_cache(self, key_id: str) -> tuple[StoredKey | None, bool]:
        """`get`, and whether a key cache may keep what it read: not a hash with a TTL.

        Redis tells a tracking connection of a key's expiry only when it deletes the key,
        which it does when a client touches the key or when its active expiry comes to it:
        among many keys with a TTL, that can be hours after the TTL ran out. A hash given a
        TTL (by `EXPIRE` from redis-cli, say: this store sets none) is read from the store
        at every request instead. Setting or removing a TTL is a write, which Redis does
        announce: a cached record drops at once, and is read again with its TTL.
        """
        async with self.calls():
            fields, ttl, used = await self._get_to_cache(
                keys=[self.key_name(key_id), self.use_name(key_id)]
            )
        if not fields:
            return None, True
        return decode(pairs(fields), pairs(used)), int(ttl) == -1

    async def list(self, workspace: str | None = None) -> builtins.list[KeyRecord]:
        return await list_keys(self, workspace)

    async def list_page(
        self, where: KeyFilter, *, start: Position | None, limit: int, now: datetime
    ) -> builtins.list[KeyRecord]:
        return await page_of_keys(self, where, start=start, limit=limit, now=now)

    def _record_from_reply(self, key_id: str, reply: Any) -> KeyRecord:
        if not reply:
            raise KeyNotFound(key_id)
        fields, used = cast("list[list[str]]", reply)
        return decode(pairs(fields), pairs(used)).record

    def _keys(self, key_id: str) -> builtins.list[str]:
        """KEYS of a change script: the key's hash, audit list, webhook outbox and use hash
        (one slot), and, but on a cluster, the index of keys with events to take."""
        names = [
            self.key_name(key_id),
            self.audit_list_name(key_id),
            self.outbox_name(key_id),
            self.use_name(key_id),
        ]
        return names if self._cluster else [*names, self.outbox_index_name]

    async def set_state(
        self,
        key_id: str,
        state: StoredState,
        *,
        allowed_from: Collection[StoredState],
        at: datetime,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        async with self.calls():
            reply = await self._change(
                self._set_state,
                self._keys(key_id),
                [state, encode_time(at), *allowed_from, *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    async def shorten_expiry(
        self,
        key_id: str,
        expires_at: datetime,
        *,
        replaced_by: str | None = None,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        async with self.calls():
            reply = await self._change(
                self._shorten_expiry,
                self._keys(key_id),
                [encode_time(expires_at), replaced_by or "", *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    async def spend_credits(
        self, key_id: str, cost: int, *, refill: tuple[int, datetime] | None = None
    ) -> int | None:
        # On the request path: not followed by WAIT (see docs/stores.md).
        amount, start = ("", "0") if refill is None else (str(refill[0]), encode_time(refill[1]))
        target, followed = key_id, ""
        async with self.calls():
            for _ in range(MAX_ROLL_HOPS):
                left = await self._spend_credits(
                    keys=[self.key_name(target)], args=[cost, amount, start, followed]
                )
                if isinstance(left, int):
                    return None if left < 0 else left
                # Rolled: the pair's balance is the successor's (in its own slot).
                target, followed = left.decode() if isinstance(left, bytes) else str(left), "1"
        return None

    async def replace_hash(
        self,
        key_id: str,
        old_hash: str,
        new_hash: str,
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> bool:
        async with self.calls():
            swapped = await self._change(
                self._replace_hash,
                self._keys(key_id),
                [old_hash, new_hash, *self._tail(event, notice)],
            )
        return bool(swapped)

    async def audit(
        self,
        *,
        workspace: str | None = None,
        key_id: str | None = None,
        since: datetime | None = None,
        limit: int = 1000,
    ) -> builtins.list[AuditEvent]:
        async with self.calls():
            ids = [key_id] if key_id is not None else await key_ids(self, workspace)
            if key_id is None:  # and the identities' events (their lists: `audit:{i:<id>}`)
                ids += await self.identities().subjects(workspace)
            async with self._client.pipeline(transaction=False) as pipe:
                for one in ids:
                    pipe.lrange(self.audit_list_name(one), 0, -1)
                replies: list[list[str]] = await pipe.execute()
        stamped = sorted(
            (audit_line(line) for lines in replies for line in lines),
            key=lambda pair: pair[0],  # stable: each list is in order already
        )
        return select_events(
            (event for _, event in stamped),
            workspace=workspace,
            key_id=key_id,
            since=since,
            limit=limit,
        )

    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        sets: list[str] = []
        deletes: list[str] = []
        for name, value in changes.items():
            text = encode_field(name, value)
            if text is None:
                deletes.append(name)
            else:
                sets += [name, text]
        async with self.calls():
            reply = await self._change(
                self._update,
                self._keys(key_id),
                [len(sets) // 2, *sets, *deletes, *self._tail(event, notice)],
            )
        return self._record_from_reply(key_id, reply)

    def _tail(self, event: AuditEvent | None, notice: str | None) -> tuple[str, str, str, str]:
        """The last ARGV of every change script: the webhook event, the audit event, the
        notice channel, the notice."""
        hook = "" if event is None else EVENT_OF_ACTION.get(event.action, "")
        return hook, event_text(event), notices_channel(self._prefix), notice or ""

    def channel(self) -> RedisChannel | RedisClusterChannel:
        """Redis pub/sub and tracking on this store's server and key prefix (see
        `apikeys.stores.redis.channel`). Through Sentinel, on the current master, found again at
        each connection (a failover drops the subscription, and so the cache). On a cluster,
        one subscription per master, probed together (`RedisClusterChannel`)."""
        return channel_for(
            self._client,
            key_prefix=self._prefix,
            cluster=self._cluster,
            target=self._target,
            sentinel=self._sentinel,
            on_master=self._follow_master,
        )

    async def _follow_master(self, address: tuple[str, int] | None) -> None:
        """Through Sentinel, from the channel: the master is in doubt (None), or `address`
        is the master every sentinel names and the channel is subscribed there.

        redis-py asks the sentinels where the master is only when it opens a connection, so
        the pool's connections would stay on an old master that still answers as one (its
        links to the sentinels cut) after a replica took over. In doubt, every connection is
        closed, those in use too (their calls fail: 503), and calls are held until the
        channel has found the master again; then the pool's connections are closed once more
        (any opened meanwhile may have gone to the old master) and calls resume, on
        connections that ask the sentinels afresh.
        """
        pool: Any = cast(Redis, self._client_object).connection_pool
        if address is None:
            self._held = True
            await pool.disconnect(inuse_connections=True)
            return
        if self._held or pool.master_address not in (None, address):
            pool.master_address = address
            await pool.disconnect(inuse_connections=True)
        self._held = False

    @property
    def usage_per_key(self) -> bool:
        """On a cluster, each key's share of a usage batch is applied and marked in the
        key's slot on its own (see the module doc)."""
        return self._cluster

    async def add_usage(self, usage: Mapping[str, UsageDelta], *, batch_id: str) -> None:
        await self._usage.add(usage, batch_id)

    async def usage_history(self, key_id: str, since: date) -> builtins.list[DailyUsage]:
        return await self._usage.history(key_id, since)
