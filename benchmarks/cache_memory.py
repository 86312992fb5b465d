"""The key cache's memory: bytes a process holds per cached key, measured two ways.

A SQLite store of the run's own (in a temporary folder, removed after) is bulk-loaded with
the largest N keys (rows straight into the store's table, as `growth.py` does). Then, for
each N, fresh processes fill their key cache with N keys through the real request path:
GETs through `APIKeyMiddleware` on raw ASGI (the store's cache on, the memory limiter, a
rate limit per key, usage counted and written once at the end), or `--path verify` for
`KeyManager.verify` alone. Each key gets two requests: the first reads the store, the
second is served from the cache (as most are) and prepares what the path keeps per key
version. Each process warms up on 200 other keys first, so that what the first requests
allocate once (imports, prepared statements, pools) is not counted.

- **RSS**: the resident set growth of a process while it fills its cache (`/proc/self/statm`
  on Linux, else the peak from `getrusage`), over N: what a worker costs the machine,
  allocator overhead and fragmentation included.
- **tracemalloc**: in another process, the Python objects still allocated after the fill
  (usage written, `gc.collect()`), over N; then what emptying each per-key structure frees,
  in this order: the rate limiter's state, the SQLite store's decoded rows (10,000 at
  most), the gate's prepared entries, the manager's prepared versions, and last the key
  cache's entries (so the records the others share with it count there). What is left is
  anything else the path keeps per key.

Run: `python benchmarks/cache_memory.py [--keys 10000,50000] [--path http|verify]
[--json FILE]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import sqlite3  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import tracemalloc  # noqa: E402
from collections.abc import Callable  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PEPPER,
    asgi_caller,
    interrupt_on_sigterm,
    token_for,
    write_json,
)
from benchmarks.growth import COLUMNS, _row  # noqa: E402

from apikeys import APIKeyMiddleware, Hasher, KeyManager, store_from_url  # noqa: E402
from apikeys.keys import generate_key  # noqa: E402

WARM = 200
CREATED = datetime(2025, 1, 1, tzinfo=UTC)
DEFAULT_KEYS = "10000,50000"


# --- the store, filled once -------------------------------------------------------------


def fill(folder: Path, count: int) -> Path:
    """A SQLite store in `folder` with `count` keys; their tokens in `tokens.txt`."""
    database = folder / "keys.db"
    url = f"sqlite:///{database}"

    async def setup() -> str:
        store = store_from_url(url)
        await store.setup()
        table = str(store.table.name)  # type: ignore[attr-defined]
        await store.aclose()
        return table

    table = asyncio.run(setup())
    hasher = Hasher(pepper=PEPPER)
    tokens, rows = [], []
    for _ in range(count):
        parsed = generate_key()
        tokens.append(token_for(parsed.id, parsed.secret))
        rows.append(_row(parsed.id, hasher.hash(parsed.secret), sqlite=True))
    columns, marks = ", ".join(COLUMNS), ", ".join("?" * len(COLUMNS))
    conn = sqlite3.connect(database, isolation_level=None)
    try:
        conn.execute("BEGIN")
        conn.executemany(f'INSERT INTO "{table}" ({columns}) VALUES ({marks})', rows)  # noqa: S608
        conn.execute("COMMIT")
    finally:
        conn.close()
    (folder / "tokens.txt").write_text("\n".join(tokens), encoding="ascii")
    return database


# --- one process filling its cache --------------------------------------------------------


def rss_bytes() -> int:
    """This process's resident set now (Linux), or its peak elsewhere."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


async def _endpoint(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _callers(
    manager: KeyManager, path: str, *token_lists: list[str]
) -> tuple[list[list[Callable[[], Any]]], Any]:
    """A call per token of each list, and the middleware's gate (None for `verify`)."""
    if path == "verify":
        return [[lambda t=t: manager.verify(t) for t in tokens] for tokens in token_lists], None
    app = APIKeyMiddleware(
        _endpoint,
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
        rate_limit="1000000000/minute",
    )
    calls = [
        [asgi_caller(app, [(b"authorization", f"Bearer {t}".encode())]) for t in tokens]
        for tokens in token_lists
    ]
    return calls, app.gate


def _freed(drop: Callable[[], None]) -> int:
    before = tracemalloc.get_traced_memory()[0]
    drop()
    gc.collect()
    return before - tracemalloc.get_traced_memory()[0]


async def _breakdown(manager: KeyManager, gate: Any) -> dict[str, int]:
    """Bytes freed by emptying each per-key structure, in order (see the module doc)."""
    cache = manager.cache
    assert cache is not None
    parts = {}
    limiter = manager.limiter if gate is None else gate.limiter
    before = tracemalloc.get_traced_memory()[0]
    await limiter.storage.reset()
    if limiter._leases is not None:
        limiter._leases.slices.clear()
    for table in (limiter._window_ends, limiter._plans):
        table.clear()
    gc.collect()
    parts["rate limiter"] = before - tracemalloc.get_traced_memory()[0]
    decoded = getattr(manager.store, "_decoded", None)
    if decoded is not None:
        parts["decoded rows (SQLite store)"] = _freed(decoded.clear)
    if gate is not None:
        parts["prepared entries (gate)"] = _freed(gate._prepared.clear)
    parts["prepared versions (manager)"] = _freed(manager._plain.clear)
    # Last: the records the structures above share with it are freed here.
    parts["key cache entries (records)"] = _freed(cache._clear)
    return parts


async def _requests(manager: KeyManager, calls: list[Callable[[], Any]]) -> int:
    """Two requests per key: the first reads the store and fills the cache; the second,
    served from the cache (as most are), prepares what the path keeps per key version.
    The number of keys whose second request the cache served."""
    cache = manager.cache
    assert cache is not None
    for call in calls:
        await call()
    # Back-to-back requests give the cache's probe little time, and a proof that lapsed
    # sends a request to the store: such keys are asked again once the cache is fresh.
    pending = calls
    for _ in range(10):
        if not pending:
            break
        # On a loaded machine the channel may fail for a while: the cache reads the store
        # until it is back, and then proves itself fresh again.
        for _ in range(100):
            await asyncio.sleep(cache.lease / 4)
            if cache.fresh:
                break
        missed = []
        for number, call in enumerate(pending):
            if number % 100 == 0:
                # A request served from the cache never yields: let the probe run, as a
                # server's event loop would between requests.
                await asyncio.sleep(0)
            hits = cache.hits
            await call()
            if cache.hits == hits:
                missed.append(call)
        pending = missed
    return len(calls) - len(pending)


async def child(database: str, count: int, path: str, traced: bool) -> dict[str, Any]:
    tokens = (Path(database).parent / "tokens.txt").read_text(encoding="ascii").split("\n")
    warm, tokens = tokens[:WARM], tokens[WARM : WARM + count]
    if len(tokens) < count:
        raise SystemExit(f"the store holds {len(tokens)} keys past the warm-up, not {count}")
    manager = KeyManager(
        store_from_url(f"sqlite:///{database}"),
        hasher=Hasher(pepper=PEPPER),
        cache_size=count + WARM,
        webhooks=False,
        # Usage is counted as ever, and written at the end (`flush`): a write of every key's
        # count each second would invalidate the cache, and hold SQLite's lock for long.
        usage_flush_interval=3600,
    )
    async with manager:
        (warm_calls, calls), gate = _callers(manager, path, warm, tokens)
        await _requests(manager, warm_calls)
        await manager.flush()
        gc.collect()
        if traced:
            tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0] if traced else rss_bytes()
        served = await _requests(manager, calls)
        await manager.flush()
        gc.collect()
        cache = manager.cache
        assert cache is not None
        cached = len(cache)
        # A failing channel (a loaded machine) can send a key's every request to the store:
        # such keys lack their prepared entries, and the figure is low. Said, not hidden.
        if served < count:
            print(
                f"warning: the cache served {served} of the {count} keys; the others lack "
                "their prepared entries",
                file=sys.stderr,
            )
        if not traced:
            return {"rss_growth": rss_bytes() - before, "cached": cached, "served": served}
        grown = tracemalloc.get_traced_memory()[0] - before
        parts = await _breakdown(manager, gate)
        tracemalloc.stop()
        return {"traced_growth": grown, "cached": cached, "served": served, "parts": parts}


def run_child(database: Path, count: int, path: str, traced: bool) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", str(database), "--keys", str(count)]
    command += ["--path", path, *(["--traced"] if traced else [])]
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the measuring process failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the run ------------------------------------------------------------------------------


def measure(counts: list[int], path: str) -> list[dict[str, Any]]:
    results = []
    with tempfile.TemporaryDirectory(prefix="apikeys-bench-cache-") as folder:
        database = fill(Path(folder), max(counts) + WARM)
        for count in counts:
            rss = run_child(database, count, path, traced=False)
            traced = run_child(database, count, path, traced=True)
            results.append(
                {
                    "keys": count,
                    "path": path,
                    "cached": rss["cached"],
                    "served_from_cache": min(rss["served"], traced["served"]),
                    "rss_bytes_per_key": rss["rss_growth"] / count,
                    "traced_bytes_per_key": traced["traced_growth"] / count,
                    "traced_parts_per_key": {
                        name: freed / count for name, freed in traced["parts"].items()
                    },
                }
            )
    return results


def report(results: list[dict[str, Any]]) -> None:
    for result in results:
        print(
            f"{result['keys']:>7,} keys ({result['path']}): "
            f"RSS {result['rss_bytes_per_key']:,.0f} bytes per cached key, "
            f"tracemalloc {result['traced_bytes_per_key']:,.0f} bytes per cached key "
            f"({result['served_from_cache']:,} of the keys served from the cache)"
        )
        for name, size in result["traced_parts_per_key"].items():
            print(f"    {name:<30} {size:>7,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default=DEFAULT_KEYS, help="comma-separated N")
    parser.add_argument("--path", choices=("http", "verify"), default="http")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--traced", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.child, int(args.keys), args.path, args.traced))))
        return
    interrupt_on_sigterm()  # the temporary folder goes, interrupted or not
    counts = [int(n) for n in args.keys.split(",")]
    print(f"The key cache's memory per cached key, SQLite store, path: {args.path}")
    results = measure(counts, args.path)
    report(results)
    if args.json:
        write_json(args.json, {"cache_memory": results})


if __name__ == "__main__":
    main()
