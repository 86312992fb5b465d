"""The management API served by `uvicorn --workers 2` on one shared store, end to end.

A key is created, rolled (no grace) and revoked through the API with httpx; after each
change's answer, the key it ends is refused by both workers at once, each having just
served it (so each had it in its key cache), and a Standard Webhooks receiver gets the
events the command line would send, signed. Retries of one `POST /keys` with one
`Idempotency-Key`, sent at once to both workers, make one key, and each gets its answer.

The app is `tests/api/processes_app.py`; every answer names the worker that gave it. Each
store kind's servers start once for the module; each test works in a workspace of its own.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from apikeys import Hasher, KeyManager
from apikeys.api import READ_SCOPE, WRITE_SCOPE
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.targets import ALLOW_PRIVATE_ENV
from tests import services
from tests.conftest import TEST_PEPPER, _create_database, _drop_database
from tests.test_middleware import assert_problem, bearer
from tests.test_multiprocess import STARTUP_TIMEOUT, Server, free_port, stop_servers
from tests.webhooks.receiver import Receiver

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
API = "/v1/api-keys"
PROTECTED = "/api/v1/contacts"
# Requests, each on a new connection, sent to reach both workers: far more than needed.
MAX_TRIES = 200
# A delivery takes a poll (1 s by default) and a send: the receiver is given plenty.
EVENTS_WITHIN = 30.0
PID_HEADER = "x-worker-pid"  # set by tests/api/processes_app.py on every answer


@dataclass
class Workers:
    """`uvicorn --workers 2` serving one store, and the pids of its two workers."""

    store_url: str
    server: Server
    pids: frozenset[int]

    @property
    def url(self) -> str:
        return self.server.url

    @asynccontextmanager
    async def manager(self) -> AsyncIterator[KeyManager]:
        """The operator's `KeyManager` on the servers' store: it delivers no webhooks, so
        every event the receiver gets was sent by a worker."""
        hasher = Hasher(pepper=TEST_PEPPER)
        async with KeyManager(self.store_url, hasher=hasher, webhooks=False) as manager:
            yield manager


def _spawn(store_url: str, log: Path) -> Server:
    port = free_port()
    env = {
        **os.environ,
        "APIKEYS_STORE_URL": store_url,
        "APIKEYS_PEPPER": TEST_PEPPER,
        ALLOW_PRIVATE_ENV: "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [
        *(sys.executable, "-m", "uvicorn", "tests.api.processes_app:app", "--workers", "2"),
        *("--host", "127.0.0.1", "--port", str(port), "--no-access-log"),
        *("--log-level", "warning", "--timeout-graceful-shutdown", "10"),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its workers are killed with it
        )
    return Server(process, f"http://127.0.0.1:{port}", log)


def _worker_pids(server: Server) -> frozenset[int]:
    """The pids of both workers, once each has answered `/health`."""
    pids: set[int] = set()
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while len(pids) < 2 and time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"uvicorn exited:\n{server.log_tail()}")
        # A new connection each time: whichever worker accepts it answers.
        with suppress(httpx.TransportError), httpx.Client(trust_env=False, timeout=2) as client:
            pids.add(int(client.get(server.url + "/health").json()["pid"]))
            continue
        time.sleep(0.05)
    if len(pids) < 2:
        pytest.fail(f"both workers did not answer: {pids}\n{server.log_tail()}")
    return frozenset(pids)


async def _prepare(store_url: str) -> None:
    # The tables exist before two workers race to make them.
    async with KeyManager(store_url, hasher=Hasher(pepper=TEST_PEPPER), webhooks=False):
        pass


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("sqlite", marks=pytest.mark.sqlite),
    ],
)
def workers(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Workers]:
    directory = tmp_path_factory.mktemp("api-processes")
    database = ""
    if request.param == "sqlite":
        store_url = f"sqlite:///{directory / 'keys.db'}"
    else:
        services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
        database = f"apikeys_api_{uuid.uuid4().hex[:12]}"
        asyncio.run(_create_database(services.POSTGRES_URL, database))
        store_url = f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{database}"
    server: Server | None = None
    try:
        asyncio.run(_prepare(store_url))
        server = _spawn(store_url, directory / "uvicorn.log")
        yield Workers(store_url, server, _worker_pids(server))
    finally:
        if server is not None:
            exit_codes = stop_servers([server])
            log = server.log_tail()
            assert "Traceback" not in log, log
            assert exit_codes == [0], log
        if database:
            asyncio.run(_drop_database(services.POSTGRES_URL, database))


async def _send(url: str, method: str, headers: dict[str, str], json: Any = None) -> httpx.Response:
    """One request on a connection of its own, which either worker may accept."""
    async with httpx.AsyncClient(trust_env=False, timeout=30) as client:
        return await client.request(method, url, headers=headers, json=json)


async def each_worker(workers: Workers, token: str) -> list[httpx.Response]:
    """Requests with `token` to the protected route, a few at a time on new connections,
    until both workers have answered; every answer, to be checked by the caller."""
    answers: list[httpx.Response] = []
    while {int(a.headers[PID_HEADER]) for a in answers} != workers.pids:
        assert len(answers) < MAX_TRIES, "one worker never answered"
        answers += await asyncio.gather(
            *(_send(workers.url + PROTECTED, "GET", bearer(token)) for _ in range(4))
        )
    return answers


@asynccontextmanager
async def pinned_clients(
    workers: Workers, per_worker: int
) -> AsyncIterator[list[httpx.AsyncClient]]:
    """`per_worker` clients on each worker: each keeps the connection whose worker it
    learnt from `/health`, so the requests it sends go to that worker."""
    async with AsyncExitStack() as stack:
        on: dict[int, list[httpx.AsyncClient]] = {pid: [] for pid in workers.pids}
        for _ in range(MAX_TRIES):
            if all(len(clients) >= per_worker for clients in on.values()):
                break
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=workers.url, trust_env=False, timeout=30)
            )
            pid = int((await client.get("/health")).headers[PID_HEADER])
            on[pid].append(client)
        else:
            pytest.fail("one worker never answered")
        yield [client for clients in on.values() for client in clients[:per_worker]]


async def caches_fresh(workers: Workers) -> None:
    """Until both workers say their key cache is proven fresh: it starts with a worker's
    first request with a key, and until then the worker reads the store at each request."""
    async with pinned_clients(workers, 1) as clients:
        for _ in range(2 * MAX_TRIES):  # 20 s at the most
            states = [(await client.get("/health")).json() for client in clients]
            if all(state["cache_fresh"] for state in states):
                return
            await asyncio.sleep(0.05)
    pytest.fail(f"the key caches did not become fresh: {states}")


def statuses(answers: Sequence[httpx.Response]) -> set[int]:
    return {answer.status_code for answer in answers}


async def operator_key(manager: KeyManager, workspace: str) -> dict[str, str]:
    """A management key of `workspace`, made by the operator, as its headers."""
    made = await manager.create(
        name="provisioning", workspace=workspace, scopes=[READ_SCOPE, WRITE_SCOPE, "contacts:read"]
    )
    return bearer(made.key)


async def test_a_key_created_rolled_and_revoked_through_the_api_is_refused_by_every_worker(
    workers: Workers, receiver: Receiver
) -> None:
    workspace = f"e2e-{uuid.uuid4().hex[:8]}"
    async with workers.manager() as manager:
        caller = await operator_key(manager, workspace)
        hooks = manager.store.webhooks()
        assert hooks is not None
        endpoint = await add_endpoint(
            hooks, receiver.url, workspace=workspace, hasher=manager.hasher, allow_private=True
        )
    api = workers.url + API

    made = await _send(
        api + "/keys", "POST", caller, {"name": "zapier", "scopes": ["contacts:read"]}
    )
    assert made.status_code == 201, made.text
    first = made.json()
    assert statuses(await each_worker(workers, first["key"])) == {200}
    await caches_fresh(workers)

    rolled = await _send(api + f"/keys/{first['id']}/roll", "POST", caller, {"grace_seconds": 0})
    assert rolled.status_code == 201, rolled.text
    second = rolled.json()
    assert second["id"] != first["id"]
    # The old key is refused by both workers from the roll's answer on; the new one works.
    for answer in await each_worker(workers, first["key"]):
        assert_problem(answer, 401, "key_expired")
    assert statuses(await each_worker(workers, second["key"])) == {200}

    revoked = await _send(api + f"/keys/{second['id']}/revoke", "POST", caller)
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["status"] == "revoked"
    for answer in await each_worker(workers, second["key"]):
        assert_problem(answer, 401, "key_revoked")

    # The events the command line's create, roll and revoke send, signed, in order per key.
    await asyncio.wait_for(receiver.wait_for(4), EVENTS_WITHIN)
    verifier = Webhook(endpoint.secret)
    events = [verifier.verify(item.body, item.headers) for item in receiver.received]
    per_key: dict[str, list[str]] = {}
    for event in events:
        per_key.setdefault(event["data"]["key"]["id"], []).append(event["type"])
    assert per_key == {
        first["id"]: ["key.created", "key.rolled"],
        second["id"]: ["key.created", "key.revoked"],
    }
    new_key = next(e for e in events if e["data"]["key"]["id"] == second["id"])
    assert new_key["data"]["key"]["replaces"] == first["id"]

    # Both workers serve keys from their key caches (fresh since before the roll): the
    # refusals above came through the store's change channel to caches that held the keys.
    async with pinned_clients(workers, 1) as clients:
        for client in clients:
            for _ in range(2):  # a key's first request in a worker loads it; then it hits
                answer = await client.get(PROTECTED, headers=caller)
                assert answer.status_code == 200, answer.text
            assert (await client.get("/health")).json()["cache_hits"] > 0


async def test_retried_posts_with_one_idempotency_key_make_one_key(workers: Workers) -> None:
    workspace = f"e2e-{uuid.uuid4().hex[:8]}"
    async with workers.manager() as manager, pinned_clients(workers, 4) as clients:
        caller = await operator_key(manager, workspace)
        headers = {**caller, "Idempotency-Key": f"zapier-{uuid.uuid4().hex}"}
        body = {"name": "retried", "scopes": ["contacts:read"]}

        async def post(client: httpx.AsyncClient) -> httpx.Response:
            return await client.post(API + "/keys", headers=headers, json=body)

        # Sent at once, four to each worker. One runs; those that arrive while it runs
        # answer 409 and are sent again, as a client would.
        answers = list(await asyncio.gather(*(post(client) for client in clients)))
        assert {int(answer.headers[PID_HEADER]) for answer in answers} == workers.pids
        assert statuses(answers) <= {201, 409}
        for _ in range(MAX_TRIES):
            pending = [i for i, answer in enumerate(answers) if answer.status_code == 409]
            if not pending:
                break
            for i in pending:
                assert_problem(answers[i], 409, "conflict")
                answers[i] = await post(clients[i])
            await asyncio.sleep(0.05)

        assert statuses(answers) == {201}
        assert len({answer.content for answer in answers}) == 1
        replayed = [answer.headers.get("idempotent-replayed") for answer in answers]
        assert replayed.count("true") == len(answers) - 1
        made = answers[0].json()
        keys = [record for record in await manager.list(workspace) if record.name == "retried"]
        assert [record.id for record in keys] == [made["id"]]
        assert statuses(await each_worker(workers, made["key"])) == {200}
