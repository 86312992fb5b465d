"""Cost growth: the time of one verification with 10, 10,000 and 1,000,000 keys in the store.

For each store (memory, SQLite, PostgreSQL, Redis) three stores of the same kind are filled,
one per size, and then measured in alternating rounds. `KeyManager.verify` runs as the
middleware runs it (usage recorded, HMAC-SHA256 with a pepper), one call after another,
over 1,000 keys spread through the store (all 10 in the smallest), in a random order, so
that a lookup is not always the same hot row.

Filling a store to a million goes around `KeyManager.create` (one round trip each): rows
are bulk-loaded straight into the store's own tables and hashes. The keys verified are made
with `generate_key` and hashed with the benchmark's `Hasher`; the filler keys get random ids
and real hashes of throwaway secrets, from the same `Hasher`. SQLite: `executemany` into
the table `SQLStore.setup()` made, in one transaction. PostgreSQL: `COPY` (asyncpg's
`copy_records_to_table`) into a database of the run's own, dropped after, then `ANALYZE`.
Redis: pipelined `HSET`s in the store's own layout (the store's encoder) and the two index
sorted sets, under a key prefix of the run's own, deleted after.

Run: `python benchmarks/growth.py [--quick] [--sizes 10,10000,1000000] [--json F]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sqlite3  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    BENCH_TAG,
    PEPPER,
    REDIS_URL,
    bench_record,
    create_database,
    delete_redis_keys,
    drop_database,
    fast_ids,
    fmt,
    interrupt_on_sigterm,
    postgres_reachable,
    redis_reachable,
    run_id,
    summary,
    table,
    token_for,
    write_json,
)

from apikeys import Hasher, KeyManager, MemoryStore, store_from_url  # noqa: E402
from apikeys.keys import generate_key  # noqa: E402
from apikeys.stores import KeyStore  # noqa: E402
from apikeys.stores.sql import schema as sql_schema  # noqa: E402
from apikeys.types import StoredKey  # noqa: E402

SAMPLE = 1000
BATCH = 10_000
CREATED = datetime(2025, 1, 1, tzinfo=UTC)


class Keys:
    """The keys verified (with their tokens) and the filler, shared by every store."""

    def __init__(self, largest: int, hasher: Hasher) -> None:
        self.hasher = hasher
        self.verified: list[tuple[str, StoredKey]] = []
        for _ in range(SAMPLE):
            parsed = generate_key()
            stored = StoredKey(bench_record(parsed.id, CREATED), hasher.hash(parsed.secret))
            self.verified.append((token_for(parsed.id, parsed.secret), stored))
        self.filler_ids = fast_ids(max(0, largest - SAMPLE))
        # Real hashes of throwaway secrets, made once for every store.
        hash_secret = hasher.hash
        self.filler_hashes = [hash_secret(key_id * 3) for key_id in self.filler_ids]

    def for_size(self, size: int) -> tuple[list[tuple[str, StoredKey]], int]:
        """(keys verified, number of filler keys) of a store of `size` keys."""
        verified = self.verified[: min(size, SAMPLE)]
        return verified, max(0, size - len(verified))

    def filler(self, count: int) -> Iterator[list[tuple[str, str]]]:
        """The first `count` filler keys as (id, hash), in batches."""
        ids, hashes = self.filler_ids, self.filler_hashes
        for start in range(0, count, BATCH):
            end = min(count, start + BATCH)
            yield list(zip(ids[start:end], hashes[start:end], strict=True))


# The store's own column order, so bulk rows line up with what it reads back: the columns
# up to the hash; the later ones (roll links, policies) stay NULL, as for a plain key.
_NAMES = tuple(column.name for column in sql_schema.keys.columns)
COLUMNS = _NAMES[: _NAMES.index("secret_hash") + 1]


def _row(key_id: str, secret_hash: str, sqlite: bool) -> tuple[Any, ...]:
    """A row of the keys table for a benchmark key (see `bench_record`)."""
    record = bench_record(key_id, CREATED)
    # UTCDateTime keeps naive UTC text on SQLite, timestamptz on PostgreSQL.
    created: Any = (
        CREATED.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f") if sqlite else CREATED
    )
    return (
        key_id,
        record.name,
        record.workspace,
        record.prefix,
        record.access,
        json.dumps(list(record.scopes), separators=(",", ":")),
        record.state,
        record.rate_limit,
        created,
        None,
        None,
        0,
        None,
        secret_hash,
    )


def _rows(keys: Keys, size: int, sqlite: bool) -> Iterator[list[tuple[Any, ...]]]:
    verified, filler = keys.for_size(size)
    yield [_row(s.record.id, s.secret_hash, sqlite) for _, s in verified]
    template = _row("x" * 12, "", sqlite)
    masked = template[3].replace("x" * 12, "{}")
    for batch in keys.filler(filler):
        yield [
            (key_id, *template[1:3], masked.format(key_id), *template[4:13], secret_hash)
            for key_id, secret_hash in batch
        ]


# --- filling each kind of store -----------------------------------------------------------


async def fill_memory(store: MemoryStore, keys: Keys, size: int) -> None:
    verified, filler = keys.for_size(size)
    for _, stored in verified:
        await store.insert(stored)
    for batch in keys.filler(filler):
        for key_id, secret_hash in batch:
            await store.insert(StoredKey(bench_record(key_id, CREATED), secret_hash))


async def fill_sqlite(store: Any, path: Path, keys: Keys, size: int) -> None:
    await store.setup()
    table = store.table.name
    columns, marks = ", ".join(COLUMNS), ", ".join("?" * len(COLUMNS))
    sql = f'INSERT INTO "{table}" ({columns}) VALUES ({marks})'  # noqa: S608 - our own names
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN")
        for rows in _rows(keys, size, sqlite=True):
            conn.executemany(sql, rows)
        conn.execute("COMMIT")
        conn.execute("ANALYZE")
    finally:
        conn.close()


async def fill_postgres(store: Any, url: str, keys: Keys, size: int) -> None:
    import asyncpg

    await store.setup()
    conn = await asyncpg.connect(url)
    try:
        table = store.table.name
        for rows in _rows(keys, size, sqlite=False):
            await conn.copy_records_to_table(table, records=rows, columns=COLUMNS)
        await conn.execute(f'ANALYZE "{table}"')
    finally:
        await conn.close()


# KEYS: none (one node, a benchmark's own prefix). ARGV[1] = the hash key's name before the
# id, ARGV[2] = after it, ARGV[3] = the masked prefix before the id, ARGV[4] = after it,
# ARGV[5] = n, the number of keys; then n ids, n hashes, and the other fields (name, value,
# ...) every key shares. Writes the hashes only; the caller adds the index entries.
_FILL = """
local n = tonumber(ARGV[5])
local shared = {}
for i = 6 + 2 * n, #ARGV do shared[#shared + 1] = ARGV[i] end
for i = 1, n do
  local id = ARGV[5 + i]
  redis.call('HSET', ARGV[1] .. id .. ARGV[2], 'id', id, 'prefix', ARGV[3] .. id .. ARGV[4],
    'secret_hash', ARGV[5 + n + i], unpack(shared))
end
return n
"""


async def fill_redis(store: Any, keys: Keys, size: int) -> None:
    """Each batch of filler keys is one short script (a few ms of the server's time), built
    from the store's own encoding of a benchmark key, so the layout is the store's."""
    from apikeys.stores.redis.codec import encode as _encode

    await store.setup()
    verified, filler = keys.for_size(size)
    for _, stored in verified:
        await store.insert(stored)
    marker = "x" * 12
    fields = _encode(StoredKey(bench_record(marker, CREATED), "h"))
    shared: list[str] = []
    masked = ("", "")
    for name, value in zip(fields[::2], fields[1::2], strict=True):
        if name == "prefix":
            before, _, after = value.partition(marker)
            masked = (before, after)
        elif name not in ("id", "secret_hash"):
            shared += [name, value]
    key_before, _, key_after = store.key_name(marker).partition(marker)
    client = store.client
    script = client.register_script(_FILL)
    score = int(CREATED.timestamp() * 1_000_000)
    for batch in keys.filler(filler):
        ids = [key_id for key_id, _ in batch]
        hashes = [secret_hash for _, secret_hash in batch]
        args = [key_before, key_after, *masked, len(batch), *ids, *hashes, *shared]
        await script(keys=[], args=args)
        members = dict.fromkeys(ids, score)
        await client.zadd(store.all_index_name, members)
        await client.zadd(store.workspace_index_name("bench"), members)


# --- measuring ----------------------------------------------------------------------------


class Sized:
    """One filled store of a given size, its manager, and the tokens to verify."""

    def __init__(self, size: int, manager: KeyManager, tokens: list[str], fill_s: float) -> None:
        self.size = size
        self.manager = manager
        self.tokens = tokens
        self.fill_s = fill_s
        self.us: list[float] = []

    async def measure(self, seconds: float) -> None:
        tokens = self.tokens
        verify = self.manager.verify
        count = len(tokens)
        done = 0
        started = time.perf_counter()
        deadline = started + seconds
        while time.perf_counter() < deadline:
            await verify(tokens[done % count])
            done += 1
        self.us.append((time.perf_counter() - started) / done * 1e6)


async def build(
    kind: str, size: int, keys: Keys, directory: Path, run: str, pg_url: str | None
) -> Sized:
    started = time.perf_counter()
    store: KeyStore
    if kind == "memory":
        store = MemoryStore()
        await fill_memory(store, keys, size)
    elif kind == "sqlite":
        path = directory / f"growth-{size}.db"
        store = store_from_url(f"sqlite:///{path}")
        await fill_sqlite(store, path, keys, size)
    elif kind == "postgres":
        assert pg_url is not None
        store = store_from_url(pg_url, table_name=f"growth_{size}")
        await fill_postgres(store, pg_url, keys, size)
    else:
        store = store_from_url(REDIS_URL, key_prefix=f"{BENCH_TAG}-{run}-g{size}:")
        await fill_redis(store, keys, size)
    fill_s = time.perf_counter() - started
    manager = KeyManager(store, hasher=keys.hasher)
    tokens = [token for token, _ in keys.for_size(size)[0]]
    random.shuffle(tokens)
    for token in tokens[:50]:  # connections, prepared statements, and a check that it works
        await manager.verify(token)
    return Sized(size, manager, tokens, fill_s)


async def measure_store(
    kind: str,
    sizes: list[int],
    keys: Keys,
    directory: Path,
    run: str,
    rounds: int,
    seconds: float,
    pg_url: str | None,
) -> dict[str, Any]:
    built: list[Sized] = []
    try:
        for size in sizes:
            print(f"  {kind}: filling {size:,} keys", flush=True)
            built.append(await build(kind, size, keys, directory, run, pg_url))
            print(f"    filled in {built[-1].fill_s:.1f} s", flush=True)
        for index in range(rounds):
            order = built if index % 2 == 0 else list(reversed(built))
            for sized in order:
                await sized.measure(seconds)
        result: dict[str, Any] = {"store": kind, "sizes": []}
        for sized in built:
            result["sizes"].append(
                {
                    "keys": sized.size,
                    "keys_verified": len(sized.tokens),
                    "fill_seconds": round(sized.fill_s, 2),
                    "us_per_verify": summary(sized.us, higher_is_better=False),
                }
            )
        smallest = result["sizes"][0]["us_per_verify"]["median"]
        largest = result["sizes"][-1]["us_per_verify"]["median"]
        result["largest_vs_smallest"] = largest / smallest
        return result
    finally:
        for sized in built:
            await sized.manager.aclose()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = sorted(int(size) for size in args.sizes.split(","))
    wanted = [name.strip() for name in args.stores.split(",") if name.strip()]
    hasher = Hasher(pepper=PEPPER)
    tag = run_id()
    database = f"apikeys_bench_{tag}"
    results: list[dict[str, Any]] = []
    skipped: list[str] = []
    print(f"growth: generating keys for up to {max(sizes):,} keys", flush=True)
    started = time.perf_counter()
    keys = Keys(max(sizes), hasher)
    print(f"  generated in {time.perf_counter() - started:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="apikeys-bench-growth-") as tmp:
        pg_url = None
        try:
            for kind in wanted:
                kind_sizes = sizes
                if kind == "redis" and args.redis_max and max(sizes) > args.redis_max:
                    kind_sizes = [size for size in sizes if size < args.redis_max]
                    kind_sizes.append(args.redis_max)
                    skipped.append(f"redis: largest size {args.redis_max:,} (--redis-max)")
                if kind == "postgres":
                    if not postgres_reachable():
                        skipped.append("postgres: server not reachable")
                        continue
                    pg_url = await create_database(database)
                if kind == "redis" and not redis_reachable():
                    skipped.append("redis: server not reachable")
                    continue
                try:
                    results.append(
                        await measure_store(
                            kind,
                            kind_sizes,
                            keys,
                            Path(tmp),
                            tag,
                            args.rounds,
                            args.seconds,
                            pg_url,
                        )
                    )
                finally:
                    if kind == "postgres":
                        await drop_database(database)
                        pg_url = None
                    if kind == "redis":
                        print("  redis: deleting the run's keys", flush=True)
                        await delete_redis_keys(f"{BENCH_TAG}-{tag}-*")
        finally:
            if pg_url is not None:
                await drop_database(database)
    output = {
        "sizes": sizes,
        "keys_verified_per_store": SAMPLE,
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "results": results,
        "skipped": skipped,
    }
    report(output)
    return output


def report(output: dict[str, Any]) -> None:
    sizes = sorted({s["keys"] for r in output["results"] for s in r["sizes"]})
    rows = []
    for r in output["results"]:
        by_size = {s["keys"]: s for s in r["sizes"]}
        cells = [r["store"]]
        for size in sizes:
            entry = by_size.get(size)
            cells.append(fmt(entry["us_per_verify"]["median"], 1) if entry else "-")
        cells.append(fmt(r["largest_vs_smallest"], 2) + "x")
        rows.append(cells)
    print("\nCost growth: microseconds per verification (median of the rounds; lower is better)")
    print(table(["store", *(f"{size:,} keys" for size in sizes), "largest/smallest"], rows))
    fills = ", ".join(
        f"{r['store']} {r['sizes'][-1]['keys']:,} in {r['sizes'][-1]['fill_seconds']:.0f} s"
        for r in output["results"]
    )
    print(f"  bulk fill of the largest: {fills}")
    for line in output["skipped"]:
        print(f"  note: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 100,000 keys, 3 rounds")
    parser.add_argument("--sizes", default="10,10000,1000000")
    parser.add_argument("--stores", default="memory,sqlite,postgres,redis")
    parser.add_argument("--redis-max", type=int, default=0, help="cap the largest Redis store")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.4, help="per size per round")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args()
    interrupt_on_sigterm()
    if args.quick:
        args.sizes, args.rounds, args.seconds = "10,10000,100000", 3, 0.3
    output = asyncio.run(run(args))
    if args.json:
        write_json(args.json, output)


if __name__ == "__main__":
    main()
