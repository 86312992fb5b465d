"""Several uvicorn processes, each caching keys, on PostgreSQL behind PgBouncer in
transaction mode: once the command line has revoked, disabled or rolled a key, no request
sent afterwards is admitted with the old state by any process, under load, and nothing
answers with a raw error.

Transaction mode hands each transaction to whichever server connection is free, so a
process's notifications are lost while it is idle; the readers' probes read the store's
change log instead (docs/consistency.md).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests import test_cache_servers
from tests.pgbouncer import PgBouncer
from tests.test_cache_servers import check_cli_changes_under_load
from tests.test_multiprocess import Config, Server

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


servers_of = test_cache_servers.servers_of  # the processes a test starts, stopped after it


async def test_if_changed_by_the_cli_through_transaction_mode_then_no_process_admits_it(
    pgbouncer: PgBouncer, postgres_url: str, tmp_path: Path, servers_of: list[list[Server]]
) -> None:
    url = pgbouncer.via(postgres_url) + "?prepared_statements=false"
    config = Config("postgres", url, {"table_name": f"pgb_mp_{uuid.uuid4().hex[:10]}"}, "memory://")
    load = await check_cli_changes_under_load(config, tmp_path, servers_of)
    # Nothing failed: every answer was an admission or the change's refusal.
    assert {sent.status for sent in load.sent} <= {200, 401}
