"""Invalidation over Redis: the Redis store's own channel.

- Notices go to the channel `<prefix>notices`. The Redis store publishes them inside the Lua
  script of the change itself (`native`). (`RedisChannel(url, native=False)`, which published
  notices of another store after its commit, is what `KeyManager` no longer accepts: a notice
  apart from the store's own log can be lost, see docs/consistency.md.)
- The subscription connection also subscribes to `<prefix>acks:<id>`, where readers
  acknowledge the notices this process wrote.
- Writes the scripts do not make (`HSET` from redis-cli, a process of an older release, a
  `DEL`, an expiry, `FLUSHALL`) are noticed through Redis' own client-side caching support:
  the subscription connection turns on `CLIENT TRACKING ... BCAST PREFIX <prefix>key:` with
  itself as the target, so Redis pushes an invalidation on `__redis__:invalidate` for every
  modification of any key's record, by any client, and a null one when a database is
  flushed (which drops the whole cache). A second prefix, `<prefix>{i:`, covers identities'
  hashes (`<prefix>{i:<id>}`), heard as `i:<id>`. The server does this itself: nothing a writer does
  or forgets to do can keep a reader from hearing of a change.
- A probe is a `PING` sent on the subscription connection: Redis answers it in order with the
  messages it pushes to that connection (notices and invalidations alike), so its reply
  arrives after every change made before it.
- The registry of readers is the sorted set `<prefix>readers`, scored by the time (Redis'
  clock, in milliseconds) each registration runs out.
- Through Sentinel, both connections go to the master a majority of the sentinels name at
  each connection (its `ROLE` is checked). Each probe (and each connection) also asks every
  sentinel, as Sentinel's own clients follow the majority: the probe passes when a majority
  of the sentinels name the master subscribed to, with no other flag. A sentinel that does
  not answer within 0.3 s (down, cut off, frozen), or that sees the master
  down or its own link to it down (`s_down`, `disconnected`), is skipped: no veto. But when
  one names another master with its link up, or flags a failover (`o_down`,
  `failover_in_progress`, any flag but `master` and those two), the probe fails, and the
  store's connections are dropped and its calls held (`on_master`) until the channel is
  subscribed on a master a majority name and none disputes. A failover that leaves the old
  master answering as one (its links to the sentinels cut, say) thus ends the proof within
  a probe round of its start, and no caching process admits from the old master a key
  revoked on the new one.
- On a Redis Cluster, `RedisClusterChannel` keeps one such subscription per master and
  probes them all (see its doc).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from apikeys.stores.contract import (
    ALL_KEYS_NOTICE,
    STORE_WRITER,
    Channel,
    ChannelError,
    parse_notice,
)
from apikeys.stores.redis.client import RedisTarget
from apikeys.tasks import started
from apikeys.types import identity_subject

__all__ = ["RedisChannel", "RedisClusterChannel", "channel_for"]

# Where Redis sends the invalidations of CLIENT TRACKING to a RESP2 connection.
_INVALIDATE = "__redis__:invalidate"

# KEYS[1] = the registry; ARGV[1] = reader id, ARGV[2] = ttl in ms.
_REGISTER = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[2]), ARGV[1])
return 1
"""

# KEYS[1] = the registry. Returns the readers whose registration has not run out.
_READERS = """
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ms, '+inf')
"""

# Flags of a Sentinel master that are one sentinel's own view of its link to the master: no
# failover by themselves (one starts with `o_down`, on the sentinels' agreement). Such a
# sentinel is skipped: it cannot tell where the master is.
_LINK_FLAGS = frozenset({"s_down", "disconnected"})

# Seconds a probe waits for the sentinels' answers (well within a probe's half lease): one
# that has not answered by then is skipped, and not asked again before its answer (or its
# socket timeout) comes.
_SENTINEL_ANSWER_WAIT = 0.3

logger = logging.getLogger("apikeys")

# How long leaving the registry may take when a channel closes (the rest of the close is
# local): a server that does not answer then does not hold the close up.
_LEAVE_TIMEOUT = 1.0

_OPTIONS: dict[str, Any] = {
    "socket_connect_timeout": 2.0,
    "socket_timeout": None,  # the subscription waits for pushes; probes bound every wait
    "retry": Retry(NoBackoff(), 0),
    "health_check_interval": 0,
    "protocol": 2,
    "decode_responses": True,
}


def _sentinel_verdict(
    answers: Sequence[Mapping[str, Any]], address: tuple[str, int]
) -> tuple[str, int]:
    """What the sentinels' answers (`{"ip", "port", "flags"}`) say of `address` as the
    master: why it is in doubt ("" if it is not), and how many sentinels name it cleanly.

    In doubt when one names another master with its link up, or flags a failover (any
    flag but `master` and the link flags); a sentinel whose own link is down is skipped.
    """
    named = 0
    doubt = ""
    for answer in answers:
        flags, where = set(answer["flags"]), (answer["ip"], answer["port"])
        said = (
            f"a sentinel names {where[0]}:{where[1]} ({','.join(sorted(flags))}) as the "
            f"master, subscribed to {address[0]}:{address[1]}"
        )
        if flags - _LINK_FLAGS != {"master"}:
            doubt = doubt or said  # a failover, as the sentinels agreed
        elif flags & _LINK_FLAGS:
            continue  # this sentinel cannot see the master: it decides nothing
        elif where != address:
            doubt = doubt or said
        else:
            named += 1
    return doubt, named


def _key_id(rest: str) -> str:
    """The key id in what follows `<prefix>key:` in a Redis key's name (`{id}` or `id`)."""
    if rest.startswith("{"):
        return rest[1:].partition("}")[0]
    return rest.partition(":")[0]


def notices_channel(prefix: str) -> str:
    """The pub/sub channel notices travel on, for a key prefix."""
    return f"{prefix}notices"


class RedisChannel(Channel):
    """Invalidation notices over Redis pub/sub (see the module doc).

    `url` is the Redis server (or `connection_kwargs` and `connection_class` of a redis-py
    pool: the Redis store passes its own); `key_prefix` namespaces the channel and the
    registry. `native=False` makes the channel publish notices itself (`KeyManager` refuses
    such a channel with `ConfigurationError`).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        connection_kwargs: Mapping[str, Any] | None = None,
        connection_class: type[AbstractConnection] | None = None,
        key_prefix: str = "apikeys:",
        native: bool = True,
        sentinel: Sentinel | None = None,
        service_name: str | None = None,
        on_master: Callable[[tuple[str, int] | None], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__()
        if (url is None) == (connection_kwargs is None):
            raise ValueError("pass url or connection_kwargs")
        self._url = url
        self._connection_kwargs = dict(connection_kwargs or {})
        self._connection_class = connection_class
        self.native = native
        self._notices = notices_channel(key_prefix)
        self._tracked = f"{key_prefix}key:"
        self._tracked_identities = f"{key_prefix}{{{identity_subject('')}"
        self._acks_prefix = f"{key_prefix}acks:"
        self._registry = f"{key_prefix}readers"
        self._client: Redis | None = None
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._probes: dict[str, asyncio.Future[None]] = {}
        self._subscriber: Redis | None = None
        self._register_script: Any = None
        self._readers_script: Any = None
        # Through Sentinel: the master's address is asked for at each connection.
        self._sentinel = sentinel
        self._service_name = service_name
        # Told None when the master is in doubt, and its address once subscribed on one
        # that every sentinel names (the Redis store holds its calls in between).
        self._on_master = on_master
        self._address: tuple[str, int] | None = None
        # Per sentinel client: its question still unanswered, if any.
        self._asking: dict[int, asyncio.Future[Any]] = {}

    def __repr__(self) -> str:
        return f"RedisChannel(native={self.native})"

    def _new_client(self, **overrides: Any) -> Redis:
        options = {**_OPTIONS, **overrides}
        if self._url is not None:
            return Redis.from_url(self._url, **options)
        kwargs = {**self._connection_kwargs, **options}
        pool_options: dict[str, Any] = {}
        if self._connection_class is not None:
            pool_options["connection_class"] = self._connection_class
        return Redis.from_pool(ConnectionPool(**pool_options, **kwargs))

    def _command_client(self) -> Redis:
        if self._client is None:
            self._client = self._new_client(socket_timeout=2.0)
            self._register_script = self._client.register_script(_REGISTER)
            self._readers_script = self._client.register_script(_READERS)
        return self._client

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        self.ident = ident
        if self._sentinel is not None and self._service_name is not None:
            # Both connections go to the master the sentinels name now; `_track` checks it
            # is one. A failover drops them (Sentinel kills a demoted master's clients), and
            # the next connection asks again.
            host, port = await self._majority_master()
            self._connection_kwargs.update(host=host, port=port)
            self._address = (host, port)
        subscriber = self._new_client()
        pubsub = subscriber.pubsub()
        try:
            await self._track(pubsub)
            await pubsub.subscribe(self._notices, f"{self._acks_prefix}{ident}", _INVALIDATE)
            # Wait for every confirmation: from then on nothing published is missed.
            confirmed = 0
            while confirmed < 3:
                message = await pubsub.get_message(timeout=2.0)
                if message is None:
                    raise ChannelError("Redis did not confirm the subscription")
                if message["type"] == "subscribe":
                    confirmed += 1
            if self._address is not None:
                await self._check_master(self._address, connecting=True)
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            await subscriber.aclose()
            raise
        self._pubsub = pubsub
        self._subscriber = subscriber
        self._reader = asyncio.get_running_loop().create_task(self._read(pubsub, on_notice))

    async def _track(self, pubsub: PubSub) -> None:
        """Turn on server-assisted invalidation of every key record, sent to this connection.

        Done before subscribing, while the connection still answers commands: the
        invalidations then travel on the subscription, in order with notices and probes.
        """
        await pubsub.connect()  # type: ignore[no-untyped-call]
        connection: Any = pubsub.connection
        if self._sentinel is not None:
            await connection.send_command("ROLE")
            role = await connection.read_response()
            if not role or role[0] not in ("master", b"master"):
                raise ChannelError("the server Sentinel named is not a master (yet)")
        await connection.send_command("CLIENT", "ID")
        own_id = await connection.read_response()
        await connection.send_command(
            "CLIENT",
            "TRACKING",
            "ON",
            "REDIRECT",
            own_id,
            "BCAST",
            "PREFIX",
            self._tracked,
            "PREFIX",
            self._tracked_identities,
        )
        reply = await connection.read_response()
        if reply not in ("OK", b"OK"):
            raise ChannelError(f"Redis refused CLIENT TRACKING: {reply!r}")

    async def _read(self, pubsub: PubSub, on_notice: Callable[[str], None]) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                kind = message["type"]
                if kind == "message":
                    channel, data = message["channel"], message["data"]
                    if channel == self._notices:
                        on_notice(data)
                    elif channel == _INVALIDATE:
                        self._invalidated(data, on_notice)
                    else:
                        reader, _, notice = data.partition("|")
                        self.acknowledged(notice, reader)
                elif kind == "pong":
                    probe = self._probes.pop(message["data"], None)
                    if probe is not None and not probe.done():
                        probe.set_result(None)
        except Exception as exc:
            for probe in self._probes.values():
                if not probe.done():
                    probe.set_exception(ChannelError(f"subscription lost: {type(exc).__name__}"))
            self._probes.clear()
            raise

    def _invalidated(self, data: Any, on_notice: Callable[[str], None]) -> None:
        # A list of key names, or None when a database was flushed: everything goes.
        if not data:
            on_notice(ALL_KEYS_NOTICE)
            return
        start = len(self._tracked)
        for name in data if isinstance(data, list) else [data]:
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            if name.startswith(self._tracked):
                on_notice(f"{STORE_WRITER}:0:{_key_id(name[start:])}")
            elif name.startswith(self._tracked_identities) and name.endswith("}"):
                # `<prefix>{i:<id>}`: the identity's hash, named `i:<id>` as notices name it.
                on_notice(f"{STORE_WRITER}:0:{name[len(self._tracked_identities) - 2 : -1]}")

    async def probe(self) -> None:
        pubsub, reader = self._pubsub, self._reader
        if pubsub is None or reader is None or reader.done():
            raise ChannelError("not subscribed")
        token = secrets.token_hex(8)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._probes[token] = future
        try:
            await pubsub.ping(token)
            await future
        finally:
            self._probes.pop(token, None)
        # The pushes came from the server subscribed to: is it still the only master? (A
        # failover can promote a replica while the old master answers as one, for seconds.)
        if self._address is not None:
            await self._check_master(self._address)

    async def _sentinel_answers(self) -> list[dict[str, Any]]:
        """What each sentinel that answers within `_SENTINEL_ANSWER_WAIT` says about the
        master, as `{"ip", "port", "flags"}` (flags a set). One that fails, or still owes
        the answer to an earlier question (frozen, say), is left out."""
        assert self._sentinel is not None
        assert self._service_name is not None
        tasks = []
        for sentinel in self._sentinel.sentinels:
            task = self._asking.get(id(sentinel))
            if task is None or task.done():
                task = started(sentinel.sentinel_master(self._service_name))
                self._asking[id(sentinel)] = task
            tasks.append(task)
        await asyncio.wait(tasks, timeout=_SENTINEL_ANSWER_WAIT)
        answers = []
        for task in tasks:
            if not task.done() or task.cancelled() or task.exception() is not None:
                continue  # a sentinel down, unreachable or frozen: the others decide
            answer = task.result()
            if not isinstance(answer, dict):
                raise ChannelError(f"a sentinel answered {answer!r} about the master")
            given = answer.get("flags", "")  # a string over RESP2, a set over RESP3
            flags = set(given) if isinstance(given, set | list) else set(str(given).split(","))
            answers.append(
                {"ip": str(answer.get("ip")), "port": int(answer.get("port", 0)), "flags": flags}
            )
        return answers

    def _majority(self) -> int:
        assert self._sentinel is not None
        return len(self._sentinel.sentinels) // 2 + 1

    async def _majority_master(self) -> tuple[str, int]:
        """The master a majority of the sentinels name, each with its link to it up."""
        votes: dict[tuple[str, int], int] = {}
        for answer in await self._sentinel_answers():
            if answer["flags"] == {"master"}:
                where = (answer["ip"], answer["port"])
                votes[where] = votes.get(where, 0) + 1
        for where, count in votes.items():
            if count >= self._majority():
                return where
        raise ChannelError("no master is named by a majority of the sentinels")

    async def _check_master(self, address: tuple[str, int], *, connecting: bool = False) -> None:
        """Fail (ChannelError) unless a majority of the sentinels name `address` as the
        master, with no flag but `master`, and no sentinel with its link up disputes it.

        A sentinel that does not answer in time, or whose own view of the link is down
        (`s_down`, `disconnected`), is skipped. When one names another master with its
        link up, or flags a failover (`o_down`, `failover_in_progress`, any flag but
        `master` and the link flags), the store is told first (`on_master(None)`) to hold
        its calls. Else, on connecting, it is told the address (its calls resume there).
        """
        doubt, named = _sentinel_verdict(await self._sentinel_answers(), address)
        if doubt:
            if self._on_master is not None:
                await self._on_master(None)
            raise ChannelError(doubt)
        if named < self._majority():
            raise ChannelError(
                f"{named} sentinel(s) name the master subscribed to; a majority must"
            )
        if connecting and self._on_master is not None:
            await self._on_master(address)

    async def register(self, ttl: float) -> None:
        self._command_client()
        await self._register_script(keys=[self._registry], args=[self.ident, int(ttl * 1000)])

    async def readers(self) -> set[str]:
        self._command_client()
        return set(await self._readers_script(keys=[self._registry]))

    async def ack(self, notice: str) -> None:
        writer, _ = parse_notice(notice)
        await self._command_client().publish(
            f"{self._acks_prefix}{writer}", f"{self.ident}|{notice}"
        )

    async def publish(self, notice: str) -> None:
        await self._command_client().publish(self._notices, notice)

    async def disconnect(self) -> None:
        # Everything is taken before the first await, and each step runs whatever happened
        # to the one before: a disconnect cut short (the cache bounds it with a timeout)
        # still closes every connection, instead of leaving sockets to the garbage collector.
        tasks = list(self._asking.values())
        self._asking = {}
        if self._reader is not None:
            tasks.append(self._reader)
        self._reader = None
        pubsub, self._pubsub = self._pubsub, None
        subscriber, self._subscriber = self._subscriber, None
        client, self._client = self._client, None
        for task in tasks:
            task.cancel()
        steps: list[Callable[[], Awaitable[object]]] = []
        if tasks:
            steps.append(lambda: asyncio.wait(tasks))
        if pubsub is not None:
            steps.append(pubsub.aclose)
        if subscriber is not None:
            steps.append(subscriber.aclose)
        if client is not None:
            steps += [lambda: self._leave(client), client.aclose]
        await _every_step(steps)

    async def _leave(self, client: Redis) -> None:
        async with asyncio.timeout(_LEAVE_TIMEOUT):
            await client.zrem(self._registry, self.ident)


_T = TypeVar("_T")


async def _every_step(steps: Sequence[Callable[[], Awaitable[object]]]) -> None:
    """Run each of `steps` (closes, mostly) to its end, one after another, whatever the ones
    before did: one that fails is passed over, and a cancellation waits for the step it
    came in (redis-py's `aclose`, cancelled, leaves the connections it had not reached
    open) and is raised again once every step has run. Each step is bounded by timeouts
    of its own."""
    cancelled: asyncio.CancelledError | None = None
    for step in steps:
        task = started(step())
        while not task.done():
            try:
                await asyncio.wait({task})  # cancelled, it leaves the step running
            except asyncio.CancelledError as exc:
                cancelled = exc
        if not task.cancelled() and task.exception() is not None:
            logger.debug(
                "apikeys: a channel's close step failed: %s", type(task.exception()).__name__
            )
    if cancelled is not None:
        raise cancelled


class _NodeChannel(RedisChannel):
    """The subscription on one master of a cluster, part of a `RedisClusterChannel`."""

    def __init__(self, owner: RedisClusterChannel, **options: Any) -> None:
        super().__init__(**options)
        self._owner = owner

    def acknowledged(self, notice: str, reader: str) -> None:
        self._owner.acknowledged(notice, reader)


class RedisClusterChannel(Channel):
    """Invalidation over a Redis Cluster: one subscription per master.

    Each master's subscription turns on `CLIENT TRACKING … BCAST PREFIX <prefix>key:` there
    (a key's record lives on one master, so the one that holds it sends its invalidations)
    and subscribes to notices and this process's acknowledgements (a cluster delivers a
    `PUBLISH` on any node to the subscribers of every node). Every master is subscribed to,
    one that holds no slot yet included: a resharding moves keys to it before it owns
    their slot. A probe pings every master's
    subscription, and checks that the masters are still the ones subscribed to: after a
    failover or a resharding the probe fails, the cache stops trusting itself, and the next
    connection subscribes on the new masters. The registry of readers is a sorted set in one
    slot, reached through a cluster client.
    """

    def __init__(
        self,
        startup_nodes: Sequence[tuple[str, int]],
        *,
        connection_kwargs: Mapping[str, Any] | None = None,
        key_prefix: str = "apikeys:",
    ) -> None:
        super().__init__()
        self.native = True
        self._startup_nodes = list(startup_nodes)
        self._connection_kwargs = dict(connection_kwargs or {})
        self._key_prefix = key_prefix
        self._acks_prefix = f"{key_prefix}acks:"
        self._registry = f"{key_prefix}readers"
        self._client: RedisCluster | None = None
        self._parts: list[_NodeChannel] = []
        self._masters: frozenset[str] = frozenset()
        self._register_script: Any = None
        self._readers_script: Any = None
        self._background: set[asyncio.Future[Any]] = set()

    def __repr__(self) -> str:
        return f"RedisClusterChannel(masters={len(self._parts)})"

    def _command_client(self) -> RedisCluster:
        if self._client is None:
            options = {**_OPTIONS, **self._connection_kwargs, "socket_timeout": 2.0}
            options.pop("health_check_interval", None)
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in self._startup_nodes],
                **options,
            )
            self._register_script = self._client.register_script(_REGISTER)
            self._readers_script = self._client.register_script(_READERS)
        return self._client

    async def _shielded(self, work: Awaitable[_T]) -> _T:
        """Run `work` to its end even if the caller is cancelled (a probe's timeout).

        redis-py's cluster client abandons a connection it was using when cancelled in the
        middle of learning the slot map or a command's routing, and the socket is left
        open; its commands are bounded by socket timeouts, so they are let finish instead.
        """
        task = started(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return await asyncio.shield(task)

    async def _current_masters(self) -> frozenset[str]:
        client = self._command_client()
        nodes: dict[str, Any] = await self._shielded(client.cluster_nodes())
        # Masters that hold no slot too: a resharding moves keys to a new master before it
        # owns their slot (served there through ASK), and writes there must be heard.
        return frozenset(
            address
            for address, node in nodes.items()
            if "master" in str(node["flags"]) and "fail" not in str(node["flags"])
        )

    async def connect(self, ident: str, on_notice: Callable[[str], None]) -> None:
        self.ident = ident
        masters = await self._current_masters()
        parts: list[_NodeChannel] = []
        try:
            for address in sorted(masters):
                host, _, port = address.rpartition(":")
                part = _NodeChannel(
                    self,
                    connection_kwargs={**self._connection_kwargs, "host": host, "port": int(port)},
                    key_prefix=self._key_prefix,
                )
                part.bind()
                await part.connect(ident, on_notice)
                parts.append(part)
        except BaseException:
            for part in parts:
                with contextlib.suppress(Exception):
                    await part.disconnect()
            raise
        self._parts = parts
        self._masters = masters

    async def probe(self) -> None:
        parts = self._parts
        if not parts:
            raise ChannelError("not subscribed")
        # Every master's subscription answers after the pushes sent before the probe ...
        await asyncio.gather(*(part.probe() for part in parts))
        # ... and they are still every master: else a key may live where nobody listens.
        if await self._current_masters() != self._masters:
            raise ChannelError("the cluster's masters changed")

    async def register(self, ttl: float) -> None:
        self._command_client()
        await self._shielded(
            self._register_script(keys=[self._registry], args=[self.ident, int(ttl * 1000)])
        )

    async def readers(self) -> set[str]:
        self._command_client()
        return set(await self._shielded(self._readers_script(keys=[self._registry])))

    async def ack(self, notice: str) -> None:
        writer, _ = parse_notice(notice)
        client = self._command_client()
        await self._shielded(
            client.publish(f"{self._acks_prefix}{writer}", f"{self.ident}|{notice}")
        )

    async def disconnect(self) -> None:
        # As `RedisChannel.disconnect`: cut short, it still closes every master's
        # subscription and the command client.
        parts, self._parts = self._parts, []
        client, self._client = self._client, None
        steps: list[Callable[[], Awaitable[object]]] = [part.disconnect for part in parts]
        if client is not None:
            steps.append(lambda: self._leave(client))
        await _every_step(steps)

    async def _leave(self, client: RedisCluster) -> None:
        # Wait for what is still running on the client, then leave the registry and close.
        pending = [task for task in self._background if task is not asyncio.current_task()]
        if pending:
            await asyncio.wait(pending)
        with contextlib.suppress(Exception):
            await client.zrem(self._registry, self.ident)
        with contextlib.suppress(Exception):
            await client.aclose()


def channel_for(
    client: Any,
    *,
    key_prefix: str,
    cluster: bool,
    target: RedisTarget | None,
    sentinel: Sentinel | None,
    on_master: Callable[[tuple[str, int] | None], Awaitable[None]],
) -> RedisChannel | RedisClusterChannel:
    """The channel of a `RedisStore` on `client`: pub/sub and tracking on its server and key
    prefix. Through Sentinel, on the current master, found again at each connection (a
    failover drops the subscription, and so the cache; `on_master` hears of it). On a
    cluster, one subscription per master, probed together (`RedisClusterChannel`)."""
    if cluster:
        if target is not None:
            nodes = list(target.hosts)
            kwargs = {
                name: value
                for name, value in target.options.items()
                if name in ("username", "password")
            }
        else:
            nodes = [(node.host, int(node.port)) for node in client.get_nodes()]
            given = client.get_connection_kwargs()
            kwargs = {name: given[name] for name in ("username", "password") if given.get(name)}
        return RedisClusterChannel(nodes, connection_kwargs=kwargs, key_prefix=key_prefix)
    if sentinel is not None and target is not None:
        kwargs = dict(sentinel.connection_kwargs)
        kwargs["db"] = target.db
        return RedisChannel(
            connection_kwargs=kwargs,
            key_prefix=key_prefix,
            sentinel=sentinel,
            service_name=target.service_name,
            on_master=on_master,
        )
    pool = client.connection_pool
    return RedisChannel(
        connection_kwargs=pool.connection_kwargs,
        connection_class=pool.connection_class,
        key_prefix=key_prefix,
    )
