"""Two hosts sharing one store: a revoke made on one host holds on the other, under partitions.

Hosts a and b are network namespaces (`tests/hosts.py`), each reaching PostgreSQL and Redis
only through forwarders of its own. Each runs the example contacts service
(`tests/netns_app.py`) with `uvicorn --workers 2` on the store under test; host a also runs a
writer (`tests/netns_writer.py`, a `KeyManager` with a cache, as a service's) and the CLI.
The test process, in the root namespace, keeps one connection to each of the four workers
(keep-alive pins a connection to the worker that accepted it) and sends requests on them.
Rate limits are counted in memory, per worker: what is under test is the key store.

- Without a fault, a key revoked through host a gets 401 from every worker on both hosts on
  the next request.
- Host b cut off from the notifications only (its caches' `LISTEN` / `SUBSCRIBE` connections
  black-holed or reset): no worker of b admits a revoked key after `revoke` returned (it reads
  the store once its proof runs out), and `revoke` waits about a lease at most.
- Host b cut off from the store entirely: b answers 503 `auth_unavailable`, never a stale
  200; the writer's wait stays bounded; b serves again once the partition heals.

A stale admission is a 200 to a request sent after `revoke` returned. Each test prints the
stale admissions it counted and the revoke times (p50/p99) measured in the writer; times are
never asserted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import services
from tests.conftest import TEST_PEPPER, delete_redis_keys_now, redis_prefix
from tests.hosts import Host, Hosts, Mode, require_netns, wait_until
from tests.test_middleware import bearer

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PORT = 8000  # in each host's own namespace
WORKERS = 2
STARTUP_TIMEOUT = 60.0
# Generous bounds for a loaded machine: they end a hung test, they do not measure anything.
ANSWERS_WITHIN = 120.0
RECOVERY_WITHIN = 60.0
PATH = "/api/v1/contacts"


# --- the deployment -------------------------------------------------------------------------


class Writer:
    """`tests/netns_writer.py` running in a host: one JSON request, one JSON answer."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)

    def answer(self, timeout: float = 60.0) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"the writer did not answer within {timeout} s")
        data: dict[str, Any] = json.loads(line)
        assert "error" not in data, data["error"]
        return data

    def call(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.answer()

    async def create(self) -> tuple[str, str]:
        created = await asyncio.to_thread(self.call, op="create")
        return str(created["id"]), str(created["key"])

    async def revoke(self, key_id: str) -> tuple[float, float]:
        """When the writer's `revoke` started and returned (`time.monotonic()`)."""
        answer = await asyncio.to_thread(self.call, op="revoke", id=key_id)
        return float(answer["started"]), float(answer["returned"])


@dataclass
class Deployment:
    """One store kind served on both hosts."""

    kind: str
    store_url: str  # as the root namespace sees it
    options: dict[str, Any]
    a: Host
    b: Host
    directory: Path
    writer: Writer | None = None
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def hosts(self) -> list[Host]:
        return [self.a, self.b]

    def env(self, host: Host) -> dict[str, str]:
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            "APIKEYS_STORE_URL": host.url(self.store_url),
            "APIKEYS_TEST_STORE_OPTIONS": json.dumps(self.host_options(host)),
            "APIKEYS_LIMITER_URL": "memory://",
            "APIKEYS_RATE_LIMIT": "100000/minute",
            "APIKEYS_PEPPER": TEST_PEPPER,
            "EXAMPLE_DATABASE_URL": f"sqlite:///{self.directory / f'example-{host.name}.db'}",
            "EXAMPLE_SESSION_SECRET": secrets.token_urlsafe(32),
        }

    def host_options(self, host: Host) -> dict[str, Any]:
        """The store's options in `host`: b, the host the tests partition, gets timeouts of a
        second, so that a black-holed store fails its reads (503) after one second instead
        of the product's 5 s (PostgreSQL) or 2 s (Redis); host a keeps the defaults."""
        if host is not self.b:
            return self.options
        return {**self.options, **SHORT_TIMEOUTS[self.kind]}

    def base_url(self, host: Host) -> str:
        return f"http://{host.address}:{PORT}"

    def start(self) -> None:
        self.writer = Writer(
            self.a.popen(
                [sys.executable, "-m", "tests.netns_writer"],
                env=self.env(self.a),
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        self.writer.answer(STARTUP_TIMEOUT)  # the store's tables exist before servers race
        for host in self.hosts:
            log = self.directory / f"uvicorn-{self.kind}-{host.name}.log"
            self.logs[host.name] = log
            command = [
                sys.executable,
                "-m",
                "uvicorn",
                "tests.netns_app:app",
                "--host",
                host.address,
                "--port",
                str(PORT),
                "--workers",
                str(WORKERS),
                "--no-access-log",
                "--log-level",
                "warning",
                "--timeout-keep-alive",
                "3600",
            ]
            with log.open("wb") as out:
                host.popen(command, env=self.env(host), cwd=ROOT, stdout=out)
        for host in self.hosts:
            self._wait_ready(host)

    def _wait_ready(self, host: Host) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        with httpx.Client(trust_env=False, timeout=2.0) as client:
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url(host) + "/api/v1/openapi.json").status_code == 200:
                        return
                time.sleep(0.1)
        pytest.fail(f"host {host.name} did not serve:\n{self.log_tail(host)}")

    def log_tail(self, host: Host) -> str:
        try:
            return self.logs[host.name].read_text(errors="replace")[-3000:]
        except (KeyError, OSError):
            return ""

    def cli(self, host: Host, *args: str) -> subprocess.CompletedProcess[str]:
        """The `apikeys` command line (with the test's store options), run in `host`."""
        command = [sys.executable, "-m", "tests.cli_with_options"]
        command += ["--store", host.url(self.store_url), *args]
        return host.run(command, env=self.env(host), cwd=ROOT)


# What a read waits for at most in host b: a connection from the pool, a new connection, an
# answer. Redis's `wait_timeout` must be at most half its socket timeout.
SHORT_TIMEOUTS: dict[str, dict[str, Any]] = {
    "postgres": {"pool_timeout": 1.0, "connect_timeout": 1.0, "command_timeout": 1.0},
    "redis": {
        "socket_timeout": 1.0,
        "socket_connect_timeout": 1.0,
        "timeout": 1.0,
        "wait_timeout": 0.5,
    },
}


def _options(kind: str) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:10]
    if kind == "postgres":
        # Small pools: four workers and a writer on one server shared with other tests.
        return {"table_name": f"netns_keys_{suffix}", "pool_size": 2, "max_overflow": 2}
    return {"key_prefix": redis_prefix("netns") + ":"}


@pytest.fixture(scope="module")
def hosts(postgres_url: str) -> Iterator[tuple[Host, Host]]:
    require_netns()
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    with Hosts(["a", "b"], services=[postgres_url, services.REDIS_URL]) as (a, b):
        yield a, b


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.redis]),
        pytest.param("redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
def deployment(
    request: pytest.FixtureRequest,
    hosts: tuple[Host, Host],
    postgres_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    kind = str(request.param)
    a, b = hosts
    store_url = postgres_url if kind == "postgres" else services.REDIS_URL
    options = _options(kind)
    deployment = Deployment(kind, store_url, options, a, b, tmp_path_factory.mktemp("hosts"))
    try:
        deployment.start()
        yield deployment
    finally:
        for host in deployment.hosts:
            host.heal()
            host.kill_processes()
        if kind == "redis":
            # The store's keys and its usage-batch markers: everything with the prefix in it.
            delete_redis_keys_now(services.REDIS_URL, f"*{options['key_prefix'].rstrip(':')}*")


# --- requests -------------------------------------------------------------------------------


@dataclass
class Answer:
    token: int  # index of the token sent
    sent: float
    received: float
    status: int  # 0: no answer (the client gave up or the connection broke)
    code: str


@dataclass
class Worker:
    """A connection pinned to one worker process of one host."""

    host: str
    pid: int
    client: httpx.AsyncClient
    answers: list[Answer] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.host}:{self.pid}"

    async def get(self, token: str, index: int = -1) -> Answer:
        sent = time.monotonic()
        try:
            response = await self.client.get(PATH, headers=bearer(token))
        except httpx.HTTPError as exc:
            answer = Answer(index, sent, time.monotonic(), 0, type(exc).__name__)
        else:
            pid = int(response.headers["x-worker-pid"])
            assert pid == self.pid, f"{self.name}'s connection was answered by {pid}"
            code = ""
            if response.headers.get("content-type") == "application/problem+json":
                code = str(response.json().get("code"))
            answer = Answer(index, sent, time.monotonic(), response.status_code, code)
        self.answers.append(answer)
        return answer


@contextlib.asynccontextmanager
async def pinned_workers(deployment: Deployment) -> Any:
    """One keep-alive connection to each worker of each host (4 in all)."""
    workers: list[Worker] = []
    spare: list[httpx.AsyncClient] = []
    try:
        for host in deployment.hosts:
            found: dict[int, httpx.AsyncClient] = {}
            for _ in range(200):
                client = httpx.AsyncClient(
                    base_url=deployment.base_url(host),
                    trust_env=False,
                    timeout=30.0,
                    # Never closed for being idle: a new connection may reach another worker.
                    limits=httpx.Limits(
                        max_connections=1, max_keepalive_connections=1, keepalive_expiry=None
                    ),
                )
                pid = int((await client.get("/api/v1/openapi.json")).headers["x-worker-pid"])
                if pid in found:
                    spare.append(client)  # kept open meanwhile: another worker accepts next
                else:
                    found[pid] = client
                if len(found) == WORKERS:
                    break
            assert len(found) == WORKERS, f"host {host.name}: reached only workers {list(found)}"
            workers += [Worker(host.name, pid, client) for pid, client in found.items()]
        for client in spare:
            await client.aclose()
        spare.clear()
        yield workers
    finally:
        for client in spare + [worker.client for worker in workers]:
            await client.aclose()


class Load:
    """Each worker's connection sends requests one after another, cycling through tokens."""

    def __init__(self, workers: Sequence[Worker], tokens: Sequence[str]) -> None:
        self.workers, self.tokens = workers, tokens
        self.stopping = asyncio.Event()
        self.tasks: list[asyncio.Task[None]] = []

    async def _loop(self, worker: Worker, offset: int) -> None:
        turn = offset
        while not self.stopping.is_set():
            index = turn % len(self.tokens)
            turn += 1
            await worker.get(self.tokens[index], index)
            await asyncio.sleep(0.02)  # two cores, shared: leave room for the servers

    def start(self) -> None:
        self.tasks = [
            asyncio.create_task(self._loop(worker, offset))
            for offset, worker in enumerate(self.workers)
        ]

    async def stop(self) -> None:
        self.stopping.set()
        await asyncio.gather(*self.tasks)


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def report(capsys: pytest.CaptureFixture[str], text: str) -> None:
    """Printed even when pytest captures output: the numbers are what these tests are for."""
    with capsys.disabled():
        print(f"\n[two hosts] {text}", flush=True)


# --- the scenario ----------------------------------------------------------------------------


@dataclass
class Outcome:
    latencies: list[float]
    stale: Counter[str]  # admissions sent after the revoke returned, by host
    in_flight: int  # admissions sent while the revoke ran (allowed)
    after: Counter[tuple[str, int, str]]  # (host, status, code) of answers sent after revoke
    first: dict[str, list[tuple[int, str]]]  # each worker's next answer after each revoke
    b_times: list[float]  # how long b took to answer the requests sent after a revoke

    def describe(self) -> str:
        after = ", ".join(
            f"{h} {s} {c or ''}".strip() + f" x{n}" for (h, s, c), n in sorted(self.after.items())
        )
        return (
            f"{len(self.latencies)} revokes on a: wait p50 {percentile(self.latencies, 50):.3f} s,"
            f" p99 {percentile(self.latencies, 99):.3f} s, max {max(self.latencies):.3f} s;"
            f" stale admissions {sum(self.stale.values())}"
            f" (a {self.stale['a']}, b {self.stale['b']});"
            f" admitted while a revoke ran {self.in_flight}; answers after revoke: {after};"
            f" b answered those in p50 {percentile(self.b_times, 50):.3f} s,"
            f" max {max(self.b_times):.3f} s"
        )


async def warm(workers: Sequence[Worker], tokens: Sequence[str]) -> None:
    """Every worker admits every key (twice: the second from its cache if it has one)."""
    for worker in workers:
        for token in tokens:
            for _ in range(2):
                answer = await worker.get(token)
                assert answer.status == 200, (worker.name, answer)
        worker.answers.clear()


async def load_flowing(workers: Sequence[Worker]) -> None:
    """Until every worker answered a request since now: the revoke that follows meets load
    on all of them (a worker cut off from the store answers once its read times out)."""
    since = time.monotonic()
    deadline = since + ANSWERS_WITHIN
    while not all(any(a.received > since for a in worker.answers) for worker in workers):
        if time.monotonic() > deadline:
            pytest.fail(f"no answer from every worker within {ANSWERS_WITHIN} s")
        await asyncio.sleep(0.02)


async def cached_again(workers: Sequence[Worker], host: str, token: int) -> None:
    """Until every worker of `host` says its cache is proven fresh, and then admitted the
    key `token` (of the load's) again: a partition made now meets a cache holding it."""
    deadline = time.monotonic() + RECOVERY_WITHIN
    for worker in [w for w in workers if w.host == host]:
        while not (await worker.client.get("/_test/cache")).json()["fresh"]:
            if time.monotonic() > deadline:
                pytest.fail(f"{worker.name}'s cache was not proven fresh again")
            await asyncio.sleep(0.05)
    since = time.monotonic()
    for worker in [w for w in workers if w.host == host]:
        while not any(
            a.token == token and a.status == 200 and a.sent > since for a in worker.answers
        ):
            if time.monotonic() > deadline:
                pytest.fail(f"{worker.name} did not admit key {token} again")
            await asyncio.sleep(0.02)


async def revoke_under_load(
    deployment: Deployment,
    workers: Sequence[Worker],
    keys: Sequence[tuple[str, str]],
    *,
    partition: Callable[[], None] | None = None,
    heal: Callable[[], None] | None = None,
    delays: Sequence[float] = (),
) -> Outcome:
    """Under load on every worker, revoke `keys` one by one through host a's writer.

    `partition` is made once, after the keys are cached everywhere; or, given `heal` too,
    before each revoke (which then starts `delays[i]` seconds after it) and healed after it,
    and the next one waits until every cache of b listens again and had time to be fresh.
    """
    assert deployment.writer is not None
    tokens = [key for _, key in keys]
    await warm(workers, tokens)
    for host in deployment.hosts:
        await wait_for_channels(host)  # every cache is listening: the partition will bite
    if partition is not None and heal is None:
        partition()
    load = Load(workers, tokens)
    started: dict[int, float] = {}
    returned: dict[int, float] = {}
    latencies: list[float] = []
    load.start()
    try:
        for index, (key_id, _) in enumerate(keys):
            if partition is not None and heal is not None:
                if index:
                    await wait_for_channels(deployment.b)
                    await cached_again(workers, "b", index)
                partition()
                await asyncio.sleep(delays[index] if index < len(delays) else 0.3)
            else:
                await load_flowing(workers)
            # The writer's own times: a request sent after `returned` (by the same clock)
            # was sent after `revoke` returned.
            try:
                started[index], returned[index] = await deployment.writer.revoke(key_id)
            finally:
                if heal is not None:
                    heal()
            latencies.append(returned[index] - started[index])
        # Until every worker answered a request for every key sent after its revoke.
        deadline = time.monotonic() + ANSWERS_WITHIN
        while time.monotonic() < deadline:
            if all(
                any(a.token == i and a.sent > returned[i] for a in worker.answers)
                for worker in workers
                for i in returned
            ):
                break
            await asyncio.sleep(0.1)
    finally:
        await load.stop()

    stale: Counter[str] = Counter()
    after: Counter[tuple[str, int, str]] = Counter()
    first: dict[str, list[tuple[int, str]]] = {}
    in_flight = 0
    b_times: list[float] = []
    for worker in workers:
        first[worker.name] = []
        for index in returned:
            later = [a for a in worker.answers if a.token == index and a.sent > returned[index]]
            assert later, f"{worker.name} never answered a request for key {index} after revoke"
            first[worker.name].append((later[0].status, later[0].code))
            for answer in later:
                after[(worker.host, answer.status, answer.code)] += 1
                if worker.host == "b":
                    b_times.append(answer.received - answer.sent)
                if answer.status == 200:
                    stale[worker.host] += 1
            in_flight += sum(
                a.status == 200 and started[index] <= a.sent <= returned[index]
                for a in worker.answers
                if a.token == index
            )
    return Outcome(latencies, stale, in_flight, after, first, b_times)


async def wait_for_channels(host: Host, count: int = WORKERS) -> None:
    """Until `count` caches of `host` have their notification connection open."""
    deadline = time.monotonic() + RECOVERY_WITHIN
    while host.notification_connections() < count:
        if time.monotonic() > deadline:
            pytest.fail(f"host {host.name}: {host.notification_connections()} channels open")
        await asyncio.sleep(0.1)


async def check_recovered(
    deployment: Deployment,
    workers: Sequence[Worker],
    capsys: pytest.CaptureFixture[str],
    label: str,
) -> None:
    """After a partition healed: a new key is served everywhere and its revoke holds."""
    assert deployment.writer is not None
    key_id, token = await deployment.writer.create()
    deadline = time.monotonic() + RECOVERY_WITHIN
    for worker in workers:
        while (answer := await worker.get(token)).status != 200:
            assert answer.status in (0, 503), (worker.name, answer)
            assert time.monotonic() < deadline, f"{worker.name} did not recover: {answer}"
            await asyncio.sleep(0.2)
    outcome = await revoke_under_load(deployment, workers, [(key_id, token)])
    report(capsys, f"{deployment.kind}, {label}, after healing: {outcome.describe()}")
    assert sum(outcome.stale.values()) == 0
    for name, answers in outcome.first.items():
        assert answers == [(401, "key_revoked")], name


# --- tests ------------------------------------------------------------------------------------


async def test_a_key_revoked_through_host_a_gets_401_from_every_worker_on_both_hosts(
    deployment: Deployment, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deployment.writer is not None
    async with pinned_workers(deployment) as workers:
        # Through the CLI, run in host a.
        key_id, token = await deployment.writer.create()
        await warm(workers, [token])
        started = time.monotonic()
        done = await asyncio.to_thread(deployment.cli, deployment.a, "revoke", key_id, "--yes")
        cli_seconds = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        for worker in workers:
            answer = await worker.get(token)
            assert (answer.status, answer.code) == (401, "key_revoked"), worker.name
        report(
            capsys,
            f"{deployment.kind}, no fault: `apikeys revoke` in host a took {cli_seconds:.2f} s"
            " (with the interpreter's start); next request on all 4 workers: 401 key_revoked",
        )

        # Through the manager of a long-running process in host a, under load.
        keys = [await deployment.writer.create() for _ in range(20)]
        outcome = await revoke_under_load(deployment, workers, keys)
        report(capsys, f"{deployment.kind}, no fault: {outcome.describe()}")
        assert sum(outcome.stale.values()) == 0
        for name, answers in outcome.first.items():
            assert answers == [(401, "key_revoked")] * len(keys), name


@pytest.mark.parametrize("mode", ["black_hole", "cut"])
async def test_host_b_cut_off_from_the_notifications_admits_no_revoked_key(
    deployment: Deployment, mode: Mode, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deployment.writer is not None
    b = deployment.b
    async with pinned_workers(deployment) as workers:
        before: list[int] = []

        def partition() -> None:
            if not before:
                before.append(sum(p.notification_connections for p in b.proxies.values()))
                before.append(sum(p.notifications_cut for p in b.proxies.values()))
                before.append(b.notification_connections())
            b.partition_notifications(mode)

        def counts() -> str:
            tried = sum(p.notification_connections for p in b.proxies.values()) - before[0]
            cut = sum(p.notifications_cut for p in b.proxies.values()) - before[1]
            return f"b's channels: {before[2]} open before, {tried} opened, {cut} reset"

        # Held through three revokes: the first comes while b's proofs are still young, the
        # later ones once b gave up on its channel.
        keys = [await deployment.writer.create() for _ in range(3)]
        try:
            outcome = await revoke_under_load(deployment, workers, keys, partition=partition)
        finally:
            b.heal()
        report(
            capsys,
            f"{deployment.kind}, b's notifications {mode}, held: {outcome.describe()}; {counts()}",
        )
        assert sum(outcome.stale.values()) == 0
        for name, answers in outcome.first.items():
            assert answers == [(401, "key_revoked")] * len(keys), name

        # Made afresh for each revoke, 0 to 0.9 s before it, and healed after it: each revoke
        # meets b's caches at another point of their proof, or of their reconnection.
        before.clear()
        keys = [await deployment.writer.create() for _ in range(4)]
        outcome = await revoke_under_load(
            deployment,
            workers,
            keys,
            partition=partition,
            heal=b.heal,
            delays=[0.0, 0.3, 0.6, 0.9],
        )
        report(
            capsys,
            f"{deployment.kind}, b's notifications {mode}, one per revoke:"
            f" {outcome.describe()}; {counts()}",
        )
        assert sum(outcome.stale.values()) == 0
        for name, answers in outcome.first.items():
            assert answers == [(401, "key_revoked")] * len(keys), name
        await check_recovered(deployment, workers, capsys, f"b's notifications {mode}")


@pytest.mark.parametrize("deployment", ["postgres"], indirect=True)
@pytest.mark.parametrize("lost", ["notices", "every notification"])
async def test_host_b_losing_postgres_notifications_admits_no_revoked_key(
    deployment: Deployment, lost: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What PgBouncer in transaction mode does to a listening client: notifications sent
    while it is not linked to a server connection are lost, its own statements are not.

    `notices`: only those on the store's notice channel (the readers' acknowledgements to
    the writer still arrive); `every notification`: all of them. The connections stay up.
    """
    from apikeys.stores.sql.log import notice_channel_name

    assert deployment.writer is not None
    b = deployment.b
    proxy = b.proxies["postgresql"]
    channel = notice_channel_name(deployment.options["table_name"]) if lost == "notices" else None
    async with pinned_workers(deployment) as workers:
        keys = [await deployment.writer.create() for _ in range(4)]
        before: list[int] = []

        def partition() -> None:
            before.extend([proxy.notices_dropped, proxy.notification_connections])
            b.drop_postgres_notices(channel)

        try:
            outcome = await revoke_under_load(deployment, workers, keys, partition=partition)
            dropped = proxy.notices_dropped - before[0]
            opened = proxy.notification_connections - before[1]
        finally:
            b.heal()
        report(
            capsys,
            f"postgres, b loses {lost}: {outcome.describe()}; notifications lost on the way to"
            f" b {dropped}; b's channels opened meanwhile {opened}",
        )
        assert dropped >= len(keys)  # b's two workers lost the notices of the revokes
        assert sum(outcome.stale.values()) == 0
        for name, answers in outcome.first.items():
            assert answers == [(401, "key_revoked")] * len(keys), name
        await check_recovered(deployment, workers, capsys, f"b lost {lost}")


@pytest.mark.parametrize("mode", ["cut", "black_hole"])
async def test_host_b_cut_off_from_the_store_fails_closed_and_recovers(
    deployment: Deployment, mode: Mode, capsys: pytest.CaptureFixture[str]
) -> None:
    assert deployment.writer is not None
    b = deployment.b
    async with pinned_workers(deployment) as workers:
        keys = [await deployment.writer.create() for _ in range(3)]
        try:
            outcome = await revoke_under_load(
                deployment, workers, keys, partition=lambda: b.partition_store(mode)
            )
        finally:
            b.heal()
        report(
            capsys, f"{deployment.kind}, b cut off from the store ({mode}): {outcome.describe()}"
        )
        assert sum(outcome.stale.values()) == 0
        for worker in workers:
            expected = (401, "key_revoked") if worker.host == "a" else (503, "auth_unavailable")
            assert outcome.first[worker.name] == [expected] * len(keys), worker.name
        assert {status for (host, status, _), _n in outcome.after.items() if host == "b"} <= {503}

        # Healed: b reads the store again and refuses the revoked keys as revoked.
        deadline = time.monotonic() + RECOVERY_WITHIN
        for worker in workers:
            for _, token in keys:
                while (answer := await worker.get(token)).status != 401:
                    assert answer.status in (0, 503), (worker.name, answer)
                    assert time.monotonic() < deadline, f"{worker.name} did not recover"
                    await asyncio.sleep(0.2)
                assert answer.code == "key_revoked"
        await check_recovered(deployment, workers, capsys, f"b cut off from the store ({mode})")


# --- the harness itself ---------------------------------------------------------------------


def test_hosts_and_their_processes_are_gone_after_a_failing_test(postgres_url: str) -> None:
    require_netns()
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    made: list[Host] = []
    started: list[subprocess.Popen[Any]] = []

    def failing_test() -> None:
        with Hosts(["a", "b"], services=[postgres_url, services.REDIS_URL]) as hosts:
            made.extend(hosts)
            a = hosts[0]
            started.append(a.popen(["sleep", "600"], env=dict(os.environ), cwd=ROOT, stdout=None))
            assert wait_until(lambda: a.pids() == [started[0].pid], within=30)
            assert a.proxies["postgresql"].host == a.gateway
            raise RuntimeError("the test failed")

    with pytest.raises(RuntimeError, match="the test failed"):
        failing_test()
    assert started[0].returncode == -signal.SIGKILL
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for host in made:
        assert host.netns not in namespaces
        assert f" {host.outside}@" not in links
        assert f" {host.outside}:" not in links
        assert not host.proxies


async def test_the_forwarder_holds_or_cuts_only_listening_postgres_connections(
    postgres_url: str,
) -> None:
    import asyncpg

    from tests.tcpproxy import TcpProxy

    with TcpProxy.to_url(postgres_url) as proxy:
        url = proxy.url(postgres_url)
        heard: asyncio.Queue[str] = asyncio.Queue()
        listener = await asyncpg.connect(url)
        other = await asyncpg.connect(url)
        try:
            await listener.add_listener("netns_harness", lambda *args: heard.put_nowait(args[3]))
            assert (proxy.notification_connections, proxy.active_notification_connections) == (1, 1)

            proxy.black_hole_notifications()
            await other.execute("SELECT pg_notify('netns_harness', 'held')")
            assert await other.fetchval("SELECT 1") == 1  # other connections flow
            await asyncio.sleep(0.5)
            assert heard.empty()
            proxy.restore()  # the held bytes arrive
            assert await asyncio.wait_for(heard.get(), 30) == "held"

            proxy.cut_notifications()
            for _ in range(300):
                if listener.is_closed():
                    break
                await asyncio.sleep(0.05)
            assert listener.is_closed()
            again = await asyncpg.connect(url)  # connects: it has not listened yet
            with pytest.raises((OSError, asyncpg.exceptions.ConnectionDoesNotExistError)):
                await again.add_listener("netns_harness", lambda *args: None)
            again.terminate()
            assert await other.fetchval("SELECT 2") == 2
            assert proxy.notifications_cut == 2
        finally:
            listener.terminate()
            other.terminate()


async def test_the_forwarder_holds_or_cuts_only_redis_subscriptions() -> None:
    import redis.asyncio
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tests.tcpproxy import TcpProxy

    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    channel = f"apikeys-netns-harness-{uuid.uuid4().hex[:8]}"
    with TcpProxy.to_url(services.REDIS_URL) as proxy:
        client = redis.asyncio.Redis.from_url(proxy.url(services.REDIS_URL))
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(channel)
            # The forwarder tells the connection apart when it passes SUBSCRIBE on, in its
            # own thread: wait until it has (subscribe() does not wait for the reply).
            for _ in range(200):
                if proxy.active_notification_connections == 1:
                    break
                await asyncio.sleep(0.05)
            assert proxy.active_notification_connections == 1

            proxy.black_hole_notifications()
            assert await client.publish(channel, "held") == 1  # the server still sees it
            assert await client.ping()
            assert await pubsub.get_message(timeout=0.5) is None
            proxy.restore()
            message = None
            for _ in range(60):
                message = await pubsub.get_message(timeout=0.5)
                if message is not None:
                    break
            assert message is not None
            assert message["data"] == b"held"

            proxy.cut_notifications()
            with pytest.raises((RedisConnectionError, OSError)):
                await _messages(pubsub)
            fresh = client.pubsub()
            try:
                with pytest.raises((RedisConnectionError, OSError)):
                    await _subscribe_and_read(fresh, channel)
            finally:
                await fresh.aclose()
            assert await client.ping()
        finally:
            await pubsub.aclose()
            await client.aclose()


async def _messages(pubsub: Any) -> None:
    for _ in range(60):
        await pubsub.get_message(timeout=0.5)


async def _subscribe_and_read(pubsub: Any, channel: str) -> None:
    await pubsub.subscribe(channel)
    await _messages(pubsub)
