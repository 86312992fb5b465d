"""Keys of one identity spread over real uvicorn processes: exactly the identity's limit and
credits are admitted, and every refusal is charged to nothing (CONTRACT section 13).

One-process hypothesis tests (`tests/test_identity_path.py`, `tests/test_identity_limits.py`)
check the decision for all limits, costs and interleavings; these count on real servers:

| kind     | key store                   | limiter                 | processes |
|----------|-----------------------------|-------------------------|-----------|
| memory   | memory (in the process)     | memory (in the process) | 1         |
| sqlite   | a SQLite file               | Redis                   | 2         |
| postgres | a table of its own          | Redis                   | 2         |
| redis    | a key prefix of its own     | Redis                   | 2         |
| cluster  | a prefix on a Redis Cluster | the same Cluster        | 2         |

Each kind's servers are started once for the module. The identity and its keys are made by
the servers' app (`POST /test/identity` of `tests/mp_app.py`): a `memory://` store has no
other door.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from apikeys.ratelimit import RateLimiter
from apikeys.ratelimit.leases import LEASE_THRESHOLD
from tests.conftest import delete_redis_prefix, redis_prefix
from tests.test_middleware import assert_problem
from tests.test_multiprocess import (
    Config,
    Server,
    fire,
    make_config,
    start_servers,
    stop_servers,
)

pytestmark = pytest.mark.slow

KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", marks=[pytest.mark.sqlite, pytest.mark.redis], id="sqlite"),
    pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis], id="postgres"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("cluster", marks=pytest.mark.redis, id="cluster"),
]
# Credits are the store's: one process (memory) has nothing to race.
CREDIT_KINDS = [param for param in KINDS if param.id != "memory"]

IDENTITY_LIMIT = 30
# Each key alone could take more than its identity allows. Under LEASE_THRESHOLD a process
# leases a single unit at a time, so a Redis counter holds exactly what was spent of it.
KEY_LIMIT = 50
assert IDENTITY_LIMIT < KEY_LIMIT < LEASE_THRESHOLD
IDENTITY_CREDITS = 30
OWN_CREDITS = 5  # the first key's own: its refusals must give the identity its credit back
PATH = "/api/v1/contacts"


@dataclass
class IdentityConfig(Config):
    """A kind's servers, with the route that makes identities."""

    def env(self, flush_interval: float) -> dict[str, str]:
        return {**super().env(flush_interval), "APIKEYS_TEST_IDENTITY_ROUTE": "1"}

    async def cleanup(self) -> None:
        if self.kind == "cluster":
            await delete_redis_prefix(self.limiter_url, self.redis_prefix)
            await delete_redis_prefix(self.limiter_url, "LIMITS:" + self.redis_prefix)
        else:
            await super().cleanup()


def identity_config(kind: str, request: pytest.FixtureRequest, directory: Path) -> IdentityConfig:
    """The configuration of `kind` (see the module's table)."""
    if kind == "memory":
        return IdentityConfig(kind, "memory://", {}, "memory://")
    if kind == "sqlite":
        url = str(request.getfixturevalue("redis_url"))
        store = f"sqlite:///{directory / f'keys-{uuid.uuid4().hex[:10]}.db'}"
        return IdentityConfig(kind, store, {}, url, redis_prefix("mpi"))
    if kind == "cluster":
        url = request.getfixturevalue("redis_cluster").url
        prefix = redis_prefix("mpi")
        return IdentityConfig(kind, url, {"key_prefix": f"{prefix}:"}, url, prefix)
    return IdentityConfig(**dataclasses.asdict(make_config(kind, request, directory)))


@dataclass
class Pool:
    """One kind's server processes."""

    config: IdentityConfig
    servers: list[Server]
    made: int = 0
    urls: list[str] = field(default_factory=list)

    async def identity(self, spec: dict[str, Any]) -> tuple[str, list[dict[str, str]]]:
        """Make an identity (a new id) with `spec`'s limits and keys: its id, and each key's
        `id` and `key`."""
        self.made += 1
        identity = f"acme-{self.made}-{uuid.uuid4().hex[:6]}"
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            answer = await client.post(
                self.urls[0] + "/test/identity", json={"identity": identity, **spec}
            )
        assert answer.status_code == 200, answer.text
        keys: list[dict[str, str]] = answer.json()["keys"]
        return identity, keys


class Pools:
    """Starts one `Pool` per kind on first use, stops them all at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._pools: dict[str, Pool] = {}

    def get(self, kind: str, request: pytest.FixtureRequest) -> Pool:
        pool = self._pools.get(kind)
        if pool is None:
            config = identity_config(kind, request, self.directory)  # skips before starting
            if kind != "memory":
                asyncio.run(_setup_store(config))
            count = 1 if kind == "memory" else 2  # a memory store is one process's alone
            servers = start_servers(config, self.directory, count=count)
            pool = self._pools[kind] = Pool(config, servers, urls=[s.url for s in servers])
        return pool

    def close(self) -> None:
        try:
            stop_servers([server for pool in self._pools.values() for server in pool.servers])
        finally:
            for pool in self._pools.values():
                asyncio.run(pool.config.cleanup())


async def _setup_store(config: Config) -> None:
    # The tables (or scripts) made once, before two processes race to make them.
    async with config.manager():
        pass


@pytest.fixture(scope="module")
def pools(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pools]:
    made = Pools(tmp_path_factory.mktemp("identity-processes"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def pool(pools: Pools, kind: str, request: pytest.FixtureRequest) -> Pool:
    return pools.get(kind, request)


def spread(
    urls: Sequence[str], keys: Sequence[dict[str, str]], total: int
) -> list[tuple[str, str]]:
    """`total` requests taking turns over `urls`, and over `keys` within each round of them."""
    return [
        (urls[i % len(urls)] + PATH, keys[(i // len(urls)) % len(keys)]["key"])
        for i in range(total)
    ]


_REMAINING = re.compile(r'"([^"]+)";r=(\d+)')


def remaining(answer: httpx.Response) -> dict[str, int]:
    """The `RateLimit` header's remaining units by policy name."""
    return {name: int(left) for name, left in _REMAINING.findall(answer.headers["ratelimit"])}


async def counters(config: Config, plan_of: dict[str, tuple[str, str]]) -> dict[str, int]:
    """The Redis limiter's counts of each key's window and of its identity's (`plan_of`: key
    id -> (identity, the identity's limit)), read where the servers keep them."""
    limiter = RateLimiter(storage_url=config.limiter_url, key_prefix=config.redis_prefix)
    try:
        counts: dict[str, int] = {}
        for key_id, (identity, shared) in plan_of.items():
            plan = limiter.plan(
                key_id, f"{KEY_LIMIT}/minute", identity=identity, identity_policies=shared
            )
            for counter, _, _, name in plan:
                owner = key_id if name == "default" else name
                counts[owner] = int(await limiter.storage.get(counter))
        return counts
    finally:
        await limiter.aclose()


@pytest.mark.parametrize("kind", KINDS)
async def test_if_three_keys_share_an_identitys_limit_then_exactly_it_is_admitted_across_processes(
    pool: Pool,
) -> None:
    shared = f"minute={IDENTITY_LIMIT}/minute"
    identity, keys = await pool.identity(
        {"rate_limit": shared, "keys": [{"rate_limit": f"{KEY_LIMIT}/minute"}] * 3}
    )
    # Every process first serves every key once (it has read the key and its identity:
    # the burst finds them all ready), then as many requests with each key as its own limit
    # in all: a refusal charged to a key would show.
    warm = [(url + PATH, key["key"]) for url in pool.urls for key in keys]
    warmed = await fire(warm, concurrency=1)
    assert [answer.status_code for answer in warmed] == [200] * len(warm)
    load = spread(pool.urls, keys, 3 * (KEY_LIMIT - len(pool.urls)))
    answers = await fire(load)

    admitted = warm + [load[i] for i, answer in enumerate(answers) if answer.status_code == 200]
    by_key = Counter(token for _, token in admitted)
    by_process = Counter(url for url, _ in admitted)
    print(
        f"{pool.config.kind}: admitted by key {sorted(by_key.values())}, "
        f"by process {sorted(by_process.values())}"
    )
    assert len(admitted) == IDENTITY_LIMIT
    for answer in answers:
        if answer.status_code != 200:
            body = assert_problem(answer, 429, "rate_limited")
            assert body["violated_policies"] == ["identity.minute"]
            assert remaining(answer)["identity.minute"] == 0
            # The identity's minute is the only wait (Redis' TTL is in whole seconds: 61).
            assert 1 <= int(answer.headers["retry-after"]) <= 61
            assert (
                f'"identity.minute";q={IDENTITY_LIMIT};w=60' in answer.headers["ratelimit-policy"]
            )

    # One more request with each key, in every process: refused by the identity, and
    # charged to nothing either.
    probes = await fire([(url + PATH, key["key"]) for url in pool.urls for key in keys])
    for answer in probes:
        assert assert_problem(answer, 429, "rate_limited")["violated_policies"] == [
            "identity.minute"
        ]
    if pool.config.kind == "memory":
        # One process: its windows are the whole truth, and the headers show them.
        for answer, key in zip(probes, keys, strict=True):
            assert remaining(answer)["default"] == KEY_LIMIT - by_key[key["key"]]
        return
    # Each key's window counted its admitted requests, the identity's its limit: nothing
    # for the refusals, whichever process refused them.
    counts = await counters(pool.config, {key["id"]: (identity, shared) for key in keys})
    assert counts == {
        "identity.minute": IDENTITY_LIMIT,
        **{key["id"]: by_key[key["key"]] for key in keys},
    }


@pytest.mark.parametrize("kind", CREDIT_KINDS)
async def test_if_three_keys_share_an_identitys_credits_then_each_is_spent_once_across_processes(
    pool: Pool,
) -> None:
    identity, keys = await pool.identity(
        {"credits": IDENTITY_CREDITS, "keys": [{"credits": OWN_CREDITS}, {}, {}]}
    )
    own = keys[0]["key"]
    warm = [(url + PATH, key["key"]) for url in pool.urls for key in keys]
    warmed = await fire(warm, concurrency=1)
    assert [answer.status_code for answer in warmed] == [200] * len(warm)
    # The key with credits of its own first: it runs out while the identity still has some.
    load = [(pool.urls[i % 2] + PATH, own) for i in range(2 * OWN_CREDITS)]
    load += spread(pool.urls, keys, 4 * IDENTITY_CREDITS)
    load, answers = warm + load, warmed + await fire(load)

    # Then one request at a time with a key of no credits of its own, until refused.
    drained = await drain(pool.urls, keys[1]["key"])

    admitted = [i for i, answer in enumerate(answers) if answer.status_code == 200]
    by_key = Counter(load[i][1] for i in admitted)
    by_process = Counter(load[i][0] for i in admitted)
    print(
        f"{pool.config.kind}: admitted by key {[by_key[key['key']] for key in keys]}, "
        f"by process {sorted(by_process.values())}, after the burst {len(drained)}"
    )
    assert len(admitted) + len(drained) == IDENTITY_CREDITS
    for answer in answers:
        if answer.status_code != 200:
            assert_problem(answer, 429, "credits_exhausted")
    shown = sorted(remaining(answer)["identity.credits"] for answer in admitted_answers(answers))
    shown += [remaining(answer)["identity.credits"] for answer in drained]
    if pool.config.kind == "cluster":
        # The identity is charged before the key, and refunded when the key refuses: a
        # request in between sees its balance lower than it will be, never higher (and may
        # be refused for it: what the burst left, one request at a time then takes).
        assert all(0 <= left < IDENTITY_CREDITS for left in shown)
    else:
        # Each credit spent once, none below zero, none refused while one was left.
        assert drained == []
        assert shown == list(range(IDENTITY_CREDITS))
    # The key's own credits, spent after the identity's: each once.
    spent_own = by_key[own]
    assert spent_own <= OWN_CREDITS
    own_shown = sorted(remaining(answers[i])["credits"] for i in admitted if load[i][1] == own)
    assert own_shown == list(range(OWN_CREDITS - spent_own, OWN_CREDITS))
    async with pool.config.manager() as manager:
        assert (await manager.get_identity(identity)).credits == 0
        assert (await manager.get(keys[0]["id"])).credits == OWN_CREDITS - spent_own


def admitted_answers(answers: Sequence[httpx.Response]) -> list[httpx.Response]:
    return [answer for answer in answers if answer.status_code == 200]


async def drain(urls: Sequence[str], token: str) -> list[httpx.Response]:
    """Requests with `token`, one at a time and taking turns over `urls`, until one is
    refused for credits (at most one more than an identity has): the admitted ones."""
    admitted: list[httpx.Response] = []
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
        for turn in range(IDENTITY_CREDITS + 1):
            answer = await client.get(
                urls[turn % len(urls)] + PATH, headers={"Authorization": f"Bearer {token}"}
            )
            if answer.status_code != 200:
                assert_problem(answer, 429, "credits_exhausted")
                return admitted
            admitted.append(answer)
    pytest.fail("more admitted than the identity had credits")
