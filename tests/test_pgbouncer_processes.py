"""Several uvicorn processes, each caching keys, on PostgreSQL behind PgBouncer in
transaction mode: once the command line has revoked, disabled or rolled a key, no request
sent afterwards is admitted with the old state by any process, under load, and nothing
answers with a raw error.

Transaction mode hands each transaction to whichever server connection is free, so a
process's notifications are lost while it is idle; the readers' probes read the store's
change log instead (docs/consistency.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.pgbouncer import PgBouncer
from tests.test_cache_servers import Load, cli, each, health, start, wait_until_fresh
from tests.test_middleware import assert_problem
from tests.test_multiprocess import Config, Server, stop_servers

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def servers_of() -> Iterator[list[list[Server]]]:
    started: list[list[Server]] = []
    try:
        yield started
    finally:
        for group in started:
            stop_servers(group)


async def test_if_changed_by_the_cli_through_transaction_mode_then_no_process_admits_it(
    pgbouncer: PgBouncer, postgres_url: str, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    url = pgbouncer.via(postgres_url) + "?prepared_statements=false"
    config = Config("postgres", url, {"table_name": f"pgb_mp_{uuid.uuid4().hex[:10]}"}, "memory://")
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
        # Nothing failed: every answer was an admission or the change's refusal.
        assert {sent.status for sent in load.sent} <= {200, 401}
        assert load.admitted_after(tokens["keep"], 0.0)
        states = [await health(client, url) for url in urls]
        assert all(isinstance(s["cache"], dict) and s["cache"]["hits"] for s in states), states
