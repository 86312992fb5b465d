"""One client factory for the Redis store and the rate limiter: single node, Sentinel, Cluster.

The three deployments differ only here. A URL picks one, in the forms `limits` takes:

- `redis://[:password@]host:port/db`, `rediss://…` (TLS), `unix:///path?db=0`: one server.
- `redis+sentinel://[:password@]host:port[,host:port…]/service_name[/db]`: the sentinels
  to ask; the client follows the service's master through failovers.
- `redis+cluster://[:password@]host:port[,host:port…]`: any nodes of a Redis Cluster; the
  client learns the slot map from them and follows it.

Options the store reads from the URL's query string (and takes as keyword arguments):
`wait_replicas` (replicas that must acknowledge a change before it returns; default `auto`:
1 when the change's master has a replica connected then, else 0) and `wait_timeout`
(seconds, default 1).
Connection options in the query string (`socket_timeout=…`, `max_connections=…`) or as
keyword arguments override `connection_defaults()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY

from apikeys.errors import ConfigurationError

__all__ = [
    "CLUSTER_SCHEMES",
    "SENTINEL_SCHEMES",
    "SINGLE_SCHEMES",
    "RedisTarget",
    "check_wait_timeout",
    "connection_defaults",
    "parse_redis_url",
    "redis_client",
]

Kind = Literal["single", "sentinel", "cluster"]

SINGLE_SCHEMES: Final = ("redis", "rediss", "unix")
SENTINEL_SCHEMES: Final = ("redis+sentinel",)
CLUSTER_SCHEMES: Final = ("redis+cluster",)


def connection_defaults() -> dict[str, Any]:
    """Connection options shared by the store, the limiter and the channel; any of them can
    be overridden from the URL's query string or by keyword."""
    return {
        "socket_connect_timeout": 2.0,
        "socket_timeout": 2.0,
        "health_check_interval": 30,
        # No automatic retries: a retried write could apply twice (an increment) or report
        # its own success as a conflict. Redirections (MOVED, ASK) are followed: they ran
        # nothing. A fresh Retry each time: redis-py's cluster client edits its own.
        "retry": Retry(NoBackoff(), 0),
        # RESP2: with RESP3, redis-py 8 turns on maintenance notifications, which skip the
        # check that replaces a pooled connection the server has closed (after a restart).
        "protocol": 2,
    }


# Single node: a bounded pool that waits up to `timeout` seconds for a free connection, then
# fails closed, instead of opening connections without limit.
_SINGLE_DEFAULTS: Final[dict[str, Any]] = {"max_connections": 50, "timeout": 2.0}
# Cluster and Sentinel: at most this many connections per node.
_NODE_DEFAULTS: Final[dict[str, Any]] = {"max_connections": 50}

DEFAULT_WAIT_TIMEOUT: Final = 1.0

# Query options that are numbers or booleans, not strings, for the cluster and sentinel
# clients (redis-py's from_url converts them for a single node).
_NUMBERS: Final = {
    "socket_timeout": float,
    "socket_connect_timeout": float,
    "health_check_interval": float,
    "max_connections": int,
    "timeout": float,
    "protocol": int,
    "db": int,
}


@dataclass(frozen=True)
class RedisTarget:
    """What a Redis URL names: the deployment, where, and the store's durability options."""

    kind: Kind
    hosts: tuple[tuple[str, int], ...]
    service_name: str | None = None
    db: int = 0
    wait_replicas: int | None = None
    """Replicas that acknowledge a change before it returns; None: decide from the server."""
    wait_timeout: float = DEFAULT_WAIT_TIMEOUT
    options: dict[str, Any] = field(default_factory=dict)
    """Connection options from the query string."""
    url: str = field(default="", repr=False)
    """For a single node: the URL without the store's own options (it may hold a password)."""

    def describe(self) -> str:
        """Where it points, for a repr: never a password."""
        hosts = ",".join(f"{host}:{port}" for host, port in self.hosts)
        if self.kind == "cluster":
            return f"cluster={hosts!r}"
        if self.kind == "sentinel":
            return f"sentinel={hosts!r}, service={self.service_name!r}, db={self.db!r}"
        return f"host={hosts!r}, db={self.db!r}"


def _wait_replicas(text: str | int | None) -> int | None:
    if text is None or text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigurationError(f"wait_replicas must be auto or a whole number, not {text!r}")
    return value


def _wait_timeout(text: str | float) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigurationError(f"wait_timeout must be a number of seconds > 0, not {text!r}")
    return value


def _hosts(netloc: str, scheme: str) -> tuple[tuple[str, int], ...]:
    hosts = []
    for item in netloc.rpartition("@")[2].split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(
                f"{scheme}:// takes host:port[,host:port…], not {item.strip()!r}"
            )
        hosts.append((host.strip("[]"), int(port)))
    return tuple(hosts)


def _connection_options(parts: SplitResult, query: dict[str, str]) -> dict[str, Any]:
    """The query string's connection options, converted, with the URL's credentials."""
    options: dict[str, Any] = {}
    for name, value in query.items():
        convert = _NUMBERS.get(name)
        try:
            options[name] = convert(value) if convert else value
        except ValueError:
            raise ConfigurationError(f"{name} must be a number, not {value!r}") from None
    if "@" in parts.netloc:
        if parts.username:
            options["username"] = unquote(parts.username)
        if parts.password:
            options["password"] = unquote(parts.password)
    return options


def _cluster_target(parts: SplitResult, options: dict[str, Any]) -> RedisTarget:
    if parts.path.strip("/"):
        raise ConfigurationError("a Redis Cluster has only db 0: redis+cluster://host:port")
    return RedisTarget("cluster", _hosts(parts.netloc, "redis+cluster"), options=options)


def _sentinel_target(parts: SplitResult, options: dict[str, Any]) -> RedisTarget:
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ConfigurationError("redis+sentinel:// takes host:port[,host:port…]/service_name[/db]")
    db = int(path[1]) if len(path) == 2 else int(options.pop("db", 0))
    hosts = _hosts(parts.netloc, "redis+sentinel")
    return RedisTarget("sentinel", hosts, service_name=path[0], db=db, options=options)


def _single_target(parts: SplitResult, options: dict[str, Any]) -> RedisTarget:
    # redis-py reads the connection options from the URL itself; only the store's own go.
    rest = urlencode([(k, v) for k, v in parse_qsl(parts.query) if not k.startswith("wait_")])
    plain = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, parts.fragment))
    db_text = parts.path.strip("/") or str(options.get("db", 0))
    host = (parts.hostname or "localhost", parts.port or 6379)
    if parts.scheme.lower() == "unix":
        host = (parts.path, 0)
        db_text = str(options.get("db", 0))
    db = int(db_text) if db_text.isdigit() else 0
    return RedisTarget("single", (host,), db=db, url=plain)


def parse_redis_url(url: str) -> RedisTarget:
    """Read a Redis URL of any of the three forms (see the module doc)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    query = dict(parse_qsl(parts.query))
    wait_replicas = _wait_replicas(query.pop("wait_replicas", None))
    wait_timeout = _wait_timeout(query.pop("wait_timeout", DEFAULT_WAIT_TIMEOUT))
    options = _connection_options(parts, query)
    if scheme in CLUSTER_SCHEMES:
        target = _cluster_target(parts, options)
    elif scheme in SENTINEL_SCHEMES:
        target = _sentinel_target(parts, options)
    elif scheme in SINGLE_SCHEMES:
        target = _single_target(parts, options)
    else:
        raise ConfigurationError(
            f"not a Redis URL: {scheme + '://' if scheme else url!r}; use redis://, rediss://, "
            "redis+sentinel:// or redis+cluster://"
        )
    return replace(target, wait_replicas=wait_replicas, wait_timeout=wait_timeout)


class _FollowingCluster(RedisCluster):
    """redis-py's cluster client, able to follow an ASK redirection to a master its slot
    map does not list yet (one a resharding is moving a slot to, before it owns any).

    redis-py looks the node of an ASK up by name and, not finding it, fails with
    AttributeError; `redis-cli -c` follows it. Here the node is added to the client's nodes
    as a master (as redis-py does for the node of a MOVED), and the ASK is followed.
    """

    def get_node(
        self, host: str | None = None, port: int | None = None, node_name: str | None = None
    ) -> ClusterNode | None:
        node = super().get_node(host, port, node_name)
        if node is None and node_name is not None and host is None and port is None:
            # The only lookup by name alone on a command's path is an ASK's target.
            address, _, number = node_name.rpartition(":")
            if address and number.isdigit():
                manager = self.nodes_manager
                node = ClusterNode(address, int(number), PRIMARY, **manager.connection_kwargs)
                manager.set_nodes(manager.nodes_cache, {node.name: node})
        return node


def redis_client(
    target: RedisTarget, **options: Any
) -> tuple[Redis | RedisCluster, Sentinel | None]:
    """A client for `target` with `decode_responses` on, and the `Sentinel` it asks where
    the master is (None unless Sentinel; close its `sentinels` along with the client).
    `options` override the defaults and the URL's query options."""
    if target.kind == "single":
        single = {**connection_defaults(), **_SINGLE_DEFAULTS, **options, "decode_responses": True}
        pool = BlockingConnectionPool.from_url(target.url, **single)
        return Redis.from_pool(pool), None
    merged = {
        **connection_defaults(),
        **_NODE_DEFAULTS,
        **target.options,
        **options,
        "decode_responses": True,
    }
    if target.kind == "cluster":
        merged.pop("timeout", None)  # a cluster node's pool does not wait for a connection
        cluster = _FollowingCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.hosts], **merged
        )
        return cluster, None
    assert target.service_name is not None
    merged.pop("timeout", None)
    sentinel_options = {
        name: value
        for name, value in merged.items()
        if name in ("socket_timeout", "socket_connect_timeout", "username", "password", "protocol")
    }
    # The sentinels' own connections get the store's timeouts and no retries too: else
    # redis-py's default retries (with backoff) hold a call for many seconds on a sentinel
    # that is frozen or unreachable, before the next one is asked.
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        list(target.hosts),
        sentinel_kwargs={
            **sentinel_options,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
        },
        **merged,
    )
    master = sentinel.master_for(target.service_name, db=target.db)
    return master, sentinel


def check_wait_timeout(client: Redis | RedisCluster, wait_timeout: float) -> None:
    """The replicas' answer to WAIT comes `wait_timeout` after the change at worst: the
    connection must wait for it at least as long again, or a slow acknowledgement reads as a
    lost connection (503) instead of `ChangeNotConfirmed`."""
    if not wait_timeout > 0:
        raise ConfigurationError("wait_timeout must be > 0 seconds")
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()
    else:
        kwargs = client.connection_pool.connection_kwargs
    socket_timeout = kwargs.get("socket_timeout")
    if socket_timeout is not None and wait_timeout > float(socket_timeout) / 2:
        raise ConfigurationError(
            f"wait_timeout ({wait_timeout:g} s) must be at most half the connection's "
            f"socket_timeout ({float(socket_timeout):g} s), so that the replicas' answer "
            "arrives before the connection gives up: lower wait_timeout or raise socket_timeout"
        )
