"""How long `revoke` takes with four worker processes caching keys, and that it holds.

For SQLite, PostgreSQL and Redis: four uvicorn processes (one worker each, separate ports)
serve the benchmark app of `http_load.py` with the key cache on, each under load from its
own `wrk` (the load key). For each of `--samples` fresh keys, every process serves the key
(so all four cache it), then `KeyManager.revoke` runs in this process and is timed; right
after it returns, every process is asked once more with the key: any answer but 401 is a
stale admit, and is reported (it must be 0).

Run: `python benchmarks/revoke.py [--quick] [--json out.json]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    BENCH_TAG,
    PEPPER,
    create_database,
    delete_redis_keys,
    drop_database,
    fmt,
    interrupt_on_sigterm,
    postgres_reachable,
    redis_reachable,
    run_id,
    table,
    token_for,
    write_json,
)
from benchmarks.http_load import Config, Server, server_flavour  # noqa: E402

WORKERS = 4


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


async def measure(config: Config, servers: list[Server], samples: int) -> dict[str, Any]:
    import httpx

    from apikeys import Hasher, KeyManager, StoreUnavailable, store_from_url

    urls = [server.url for server in servers]
    timings: list[float] = []
    stale = unavailable = 0
    store = store_from_url(config.store_url, **config.options)
    async with (
        KeyManager(store, hasher=Hasher(pepper=PEPPER)) as manager,
        httpx.AsyncClient(timeout=10.0) as client,
    ):

        async def ask(url: str, key: str) -> int:
            answer = await client.get(url, headers={"Authorization": f"Bearer {key}"})
            return answer.status_code

        sample = attempts = 0
        while sample <= samples and attempts < 5 * (samples + 1):
            attempts += 1
            try:
                created = await manager.create(name="revoke-bench", full_access=True)
            except StoreUnavailable:
                unavailable += 1  # a saturated SQLite file: its writers wait in turn
                continue
            for _ in range(2):  # every process reads it, caches it, and serves it from cache
                statuses = await asyncio.gather(*(ask(url, created.key) for url in urls))
                if statuses != [200] * len(urls):
                    raise RuntimeError(f"a fresh key was not served everywhere: {statuses}")
            await asyncio.sleep(0.05)
            started = time.perf_counter()
            try:
                await manager.revoke(created.record.id)
            except StoreUnavailable:
                # Not revoked (it failed closed, with nothing changed): not a sample.
                unavailable += 1
                continue
            if sample:  # the first one also connects this process's channel: not timed
                timings.append((time.perf_counter() - started) * 1000)
            sample += 1
            statuses = await asyncio.gather(*(ask(url, created.key) for url in urls))
            stale += sum(status != 401 for status in statuses)
        if not timings:
            raise RuntimeError(f"no revoke succeeded in {attempts} attempts")
    return {
        "workers": len(servers),
        "samples": len(timings),
        "p50_ms": percentile(timings, 0.50),
        "p90_ms": percentile(timings, 0.90),
        "p99_ms": percentile(timings, 0.99),
        "max_ms": max(timings),
        "stale_admits": stale,
        "store_unavailable": unavailable,
        "timings_ms": [round(value, 2) for value in timings],
    }


@contextlib.contextmanager
def background_load(urls: list[str], token: str, seconds: float) -> Any:
    """A `wrk` per server for `seconds` (or an idle context when wrk is missing)."""
    wrk = shutil.which("wrk")
    processes: list[subprocess.Popen[bytes]] = []
    if wrk:
        for url in urls:
            processes.append(
                subprocess.Popen(
                    [
                        wrk,
                        "-t1",
                        "-c4",
                        f"-d{int(seconds)}s",
                        "-H",
                        f"Authorization: Bearer {token}",
                        url,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
    try:
        yield bool(wrk)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    python = args.server_python or sys.executable
    loop, http = server_flavour(python)
    tag = run_id()
    database = f"apikeys_bench_revoke_{tag}"
    from apikeys.keys import generate_key

    parsed = generate_key()
    token = token_for(parsed.id, parsed.secret)
    output: dict[str, Any] = {"server": {"loop": loop, "http": http}, "stores": {}}
    wanted = [store for store in ("sqlite", "postgres", "redis") if store in args.stores]
    print(
        f"revoke: {WORKERS} uvicorn processes per store (--loop {loop} --http {http}), "
        f"each under wrk load, {args.samples} revokes",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="apikeys-bench-revoke-") as tmp:
        directory = Path(tmp)
        made_database = False
        try:
            for store in wanted:
                if (store == "postgres" and not postgres_reachable()) or (
                    store == "redis" and not redis_reachable()
                ):
                    output["stores"][store] = {"skipped": "server not reachable"}
                    continue
                if store == "postgres" and not made_database:
                    asyncio.run(create_database(database))
                    made_database = True
                limiter = "redis" if store == "redis" else "memory"
                config = Config(store, limiter, tag, directory, database)
                env = config.server_env(token)
                servers: list[Server] = []
                try:
                    for index in range(WORKERS):
                        servers.append(
                            Server(python, env, loop, http, directory / f"{store}-{index}.log")
                        )
                    urls = [server.url for server in servers]
                    # First with the processes idle but for the key's own requests, then
                    # with each under wrk's load (two cores: the load takes them all).
                    result = asyncio.run(measure(config, servers, args.samples))
                    seconds = 30 + args.samples * 1.5
                    with background_load(urls, token, seconds) as loaded:
                        result["under_load"] = asyncio.run(measure(config, servers, args.samples))
                    result["under_load"]["wrk"] = loaded
                except Exception as exc:
                    result = {"error": str(exc)}
                finally:
                    for server in servers:
                        server.stop()
                output["stores"][store] = result
                print(f"  {store}: {result}", flush=True)
        finally:
            if made_database:
                asyncio.run(drop_database(database))
            if redis_reachable():
                asyncio.run(delete_redis_keys(f"*{BENCH_TAG}-{tag}*"))
    report(output)
    return output


def report(output: dict[str, Any]) -> None:
    rows = []
    for store, r in output["stores"].items():
        if "p99_ms" not in r:
            rows.append([store, r.get("error") or r.get("skipped"), "", "", "", "", ""])
            continue
        for label, measured in (("idle", r), ("under load", r.get("under_load") or {})):
            if "p99_ms" not in measured:
                continue
            rows.append(
                [
                    store,
                    f"{r['workers']}, {label}",
                    fmt(measured["p50_ms"], 1),
                    fmt(measured["p90_ms"], 1),
                    fmt(measured["p99_ms"], 1),
                    fmt(measured["max_ms"], 1),
                    str(measured["stale_admits"]),
                ]
            )
    print("\nrevoke: how long until it returns, every process having dropped the key")
    headers = ["store", "processes", "p50 ms", "p90 ms", "p99 ms", "max ms", "stale admits"]
    print(table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 revokes per store")
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--stores", default="sqlite,postgres,redis")
    parser.add_argument("--server-python", help="interpreter of the servers (default: this one)")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args()
    interrupt_on_sigterm()
    if args.quick:
        args.samples = 15
    output = run(args)
    if args.json:
        write_json(args.json, output)


if __name__ == "__main__":
    main()
