"""The key cache against real servers: several uvicorn processes, changes from the CLI, faults.

Every process caches keys (the default); these tests check the contract's promise that
survives it: once a command that changes a key has returned, no request sent afterwards is
admitted with the old state, by any process, under load, with the invalidation channel cut
(a TCP proxy in front of it), and across a process frozen with SIGSTOP.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from apikeys.cache import CLOCK_RATE_MARGIN, DEFAULT_LEASE
from tests.tcpproxy import TcpProxy
from tests.test_middleware import assert_problem
from tests.test_multiprocess import (
    KINDS,
    ROOT,
    Config,
    Server,
    make_config,
    start_servers,
    stop_servers,
)

pytestmark = pytest.mark.slow

NETWORK_KINDS = [param for param in KINDS if param.id != "sqlite"]
# A change waits at most a lease for a process it does not hear from; the rest is for a
# loaded two-core machine.
LEASE_WAIT = DEFAULT_LEASE * (1 + CLOCK_RATE_MARGIN) + 0.01
MARGIN = 2.0


@pytest.fixture
def config(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Config]:
    made = make_config(kind, request, tmp_path)
    try:
        yield made
    finally:
        asyncio.run(made.cleanup())


@pytest.fixture
def servers_of(tmp_path: Path) -> Iterator[list[list[Server]]]:
    started: list[list[Server]] = []
    try:
        yield started
    finally:
        for group in started:
            stop_servers(group)


async def start(
    config: Config,
    directory: Path,
    started: list[list[Server]],
    count: int,
    extra_env: dict[str, str] | None = None,
) -> list[Server]:
    if extra_env:
        original = config.env

        def env(flush_interval: float) -> dict[str, str]:
            return {**original(flush_interval), **extra_env}

        config.env = env  # type: ignore[method-assign]
    await _setup(config)
    servers = await asyncio.to_thread(start_servers, config, directory, count=count)
    started.append(servers)
    return servers


async def _setup(config: Config) -> None:
    async with config.manager():
        pass


def cli(config: Config, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the `apikeys` command line (with the test's store options) in a process of its own."""
    command = [sys.executable, "-m", "tests.cli_with_options", "--store", config.store_url, *args]
    return subprocess.run(
        command,
        cwd=ROOT,
        env=config.env(1.0),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def health(client: httpx.AsyncClient, url: str) -> dict[str, object]:
    answer = await client.get(url + "/health")
    data: dict[str, object] = answer.json()
    return data


async def wait_until_fresh(urls: Sequence[str], within: float = 20.0) -> None:
    """Until every process says its cache is proven fresh."""
    deadline = time.monotonic() + within
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            states = [await health(client, url) for url in urls]
            if all(isinstance(s["cache"], dict) and s["cache"]["fresh"] for s in states):
                return
            await asyncio.sleep(0.05)
    pytest.fail(f"the caches did not become fresh: {states}")


async def each(client: httpx.AsyncClient, urls: Sequence[str], token: str) -> list[httpx.Response]:
    headers = {"Authorization": f"Bearer {token}"}
    calls = (client.get(url + "/api/v1/contacts", headers=headers) for url in urls)
    return list(await asyncio.gather(*calls))


@dataclass
class Sent:
    token: str
    sent_at: float
    status: int


class Load:
    """Requests with every token to every process, until stopped; each noted with its time."""

    def __init__(self, urls: Sequence[str], tokens: Sequence[str], concurrency: int = 6) -> None:
        self.urls, self.tokens, self.concurrency = list(urls), list(tokens), concurrency
        self.sent: list[Sent] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _worker(self, offset: int) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
            step = offset
            while not self._stop.is_set():
                url = self.urls[step % len(self.urls)]
                token = self.tokens[(step // len(self.urls)) % len(self.tokens)]
                step += 1
                sent_at = time.monotonic()
                try:
                    answer = await client.get(
                        url + "/api/v1/contacts", headers={"Authorization": f"Bearer {token}"}
                    )
                except httpx.HTTPError:
                    continue
                self.sent.append(Sent(token, sent_at, answer.status_code))

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._worker(i)) for i in range(self.concurrency)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    def admitted_after(self, token: str, moment: float) -> list[Sent]:
        return [s for s in self.sent if s.token == token and s.sent_at > moment and s.status == 200]


async def check_cli_changes_under_load(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> Load:
    """Three caching processes under load; the CLI revokes, disables and rolls a key each:
    no request sent after a command returned is admitted with the old state. Returns the
    load, for more checks."""
    servers = await start(config, tmp_path, servers_of, count=3)
    urls = [server.url for server in servers]
    async with config.manager() as manager:
        keys = {
            action: await manager.create(name=action, workspace="mp", scopes=["contacts:read"])
            for action in ("revoke", "disable", "roll", "keep")
        }
    tokens = {action: created.key for action, created in keys.items()}
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
        for token in tokens.values():
            for _ in range(2):
                assert [a.status_code for a in await each(client, urls, token)] == [200] * 3
        await wait_until_fresh(urls)
        load = Load(urls, list(tokens.values()))
        load.start()
        try:
            await asyncio.sleep(0.5)
            steps = [
                ("revoke", ["revoke", keys["revoke"].record.id, "--yes"], "key_revoked"),
                ("disable", ["disable", keys["disable"].record.id], "key_disabled"),
                ("roll", ["roll", keys["roll"].record.id, "--grace", "0s"], "key_expired"),
            ]
            returned: dict[str, float] = {}
            for action, args, code in steps:
                done = await asyncio.to_thread(cli, config, *args)
                returned[action] = time.monotonic()
                assert done.returncode == 0, done.stderr
                for answer in await each(client, urls, tokens[action]):
                    assert_problem(answer, 401, code)
                await asyncio.sleep(0.3)
        finally:
            await load.stop()
        for action, moment in returned.items():
            stale = load.admitted_after(tokens[action], moment)
            assert not stale, f"{len(stale)} requests admitted after `{action}` returned"
        # The load went on all along, and the key nobody changed was served throughout.
        assert load.admitted_after(tokens["keep"], 0.0)
        states = [await health(client, url) for url in urls]
        assert all(isinstance(s["cache"], dict) and s["cache"]["hits"] for s in states), states
    return load


@pytest.mark.parametrize("kind", KINDS)
async def test_if_changed_by_the_cli_under_load_then_no_process_admits_the_old_state(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    await check_cli_changes_under_load(config, tmp_path, servers_of)


@pytest.mark.parametrize("kind", NETWORK_KINDS)
async def test_if_the_channel_is_cut_mid_load_then_changes_still_hold_and_the_cache_comes_back(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    with TcpProxy.to_url(config.store_url) as proxy:
        servers = await start(
            config,
            tmp_path,
            servers_of,
            count=2,
            extra_env={"APIKEYS_TEST_CHANNEL_PORT": str(proxy.port)},
        )
        urls = [server.url for server in servers]
        async with config.manager() as manager:
            first = await manager.create(name="first", workspace="mp", scopes=["contacts:read"])
            second = await manager.create(name="second", workspace="mp", scopes=["contacts:read"])
            async with httpx.AsyncClient(trust_env=False, timeout=10.0) as client:
                for created in (first, second):
                    await each(client, urls, created.key)
                await wait_until_fresh(urls)
                load = Load(urls, [first.key, second.key])
                load.start()
                try:
                    await asyncio.sleep(0.3)
                    proxy.sever()
                    began = time.monotonic()
                    await manager.revoke(first.record.id)
                    returned = time.monotonic()
                    assert returned - began < LEASE_WAIT + MARGIN
                    for answer in await each(client, urls, first.key):
                        assert_problem(answer, 401, "key_revoked")
                    # Without the channel the processes read the store: valid keys still pass.
                    assert [a.status_code for a in await each(client, urls, second.key)] == [
                        200,
                        200,
                    ]
                    proxy.restore()
                    await wait_until_fresh(urls)
                    before = [await health(client, url) for url in urls]
                    for _ in range(3):
                        await each(client, urls, second.key)
                    after = [await health(client, url) for url in urls]
                finally:
                    await load.stop()
        assert not load.admitted_after(first.key, returned)
        hits = [
            (b["cache"]["hits"], a["cache"]["hits"])  # type: ignore[index]
            for b, a in zip(before, after, strict=True)
        ]
        assert all(later > earlier for earlier, later in hits), hits


@pytest.mark.parametrize("kind", KINDS)
async def test_if_a_process_is_frozen_across_a_revoke_then_it_admits_nothing_stale(
    config: Config, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    servers = await start(config, tmp_path, servers_of, count=2)
    urls = [server.url for server in servers]
    async with config.manager() as manager:
        created = await manager.create(name="frozen", workspace="mp", scopes=["contacts:read"])
        async with httpx.AsyncClient(trust_env=False, timeout=30.0) as client:
            for _ in range(2):
                assert [a.status_code for a in await each(client, urls, created.key)] == [200, 200]
            await wait_until_fresh(urls)
            frozen = json.loads((await client.get(urls[1] + "/health")).text)["pid"]
            os.kill(frozen, signal.SIGSTOP)
            try:
                began = time.monotonic()
                await manager.revoke(created.record.id)
                waited = time.monotonic() - began
                # Sent while the process is frozen, after revoke returned: answered on resume.
                pending = asyncio.ensure_future(
                    client.get(
                        urls[1] + "/api/v1/contacts",
                        headers={"Authorization": f"Bearer {created.key}"},
                    )
                )
                await asyncio.sleep(0.3)
                assert not pending.done()
            finally:
                os.kill(frozen, signal.SIGCONT)
            assert_problem(await pending, 401, "key_revoked")
            for answer in await each(client, urls, created.key):
                assert_problem(answer, 401, "key_revoked")
    # The frozen process never acknowledged: revoke waited out the lease, and no longer.
    assert LEASE_WAIT - 0.05 <= waited < LEASE_WAIT + MARGIN
