"""What the deliverers' minute look for `key.expiring` and `key.usage_threshold` costs on Redis.

Every process that delivers webhooks runs, every `check_interval` (60 s), `expiring` and
`usage_thresholds` on its store. This fills a Redis server of the benchmark's own with
`--keys` keys (default 20,000: one in 100 expiring within 3 days, one in 100 with a daily
credit refill spent to 85 %, one in 10 expiring in 90 days, the rest with no expiry), adds
an endpoint that wants both events, lets `take` read the keys' outboxes once (as a running
deliverer would have, key by key, as they were made; `--no-take` leaves them unread, as
for keys made before an upgrade), and times rounds of the look. Printed per round: the
wall time, the commands the server ran (`INFO commandstats`, commands run by scripts
included) and the deliveries made.

Run: `python benchmarks/webhook_sweep.py [--keys 20000] [--rounds 5] [--no-take]`.
Needs `redis-server` on the PATH; the server is stopped and its data gone at the end.
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
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from datetime import timedelta  # noqa: E402

from benchmarks._common import free_port, stop_process, wait_for_port  # noqa: E402

from apikeys import Hasher, KeyManager, store_from_url  # noqa: E402
from apikeys.types import utcnow  # noqa: E402
from apikeys.webhooks.admin import add_endpoint  # noqa: E402


@contextlib.contextmanager
def own_redis() -> Iterator[str]:
    """A Redis server of the benchmark's own, so that the commands counted are ours."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        process = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for_port(port, process)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_process(process)


async def commands(client: object) -> int:
    stats = await client.info("commandstats")  # type: ignore[attr-defined]
    return sum(int(value["calls"]) for name, value in stats.items() if name != "cmdstat_info")


async def fill(manager: KeyManager, count: int) -> None:
    async def one(number: int) -> None:
        options: dict[str, object] = {}
        if number % 100 == 0:
            options["expires_in"] = timedelta(days=3)
        elif number % 100 == 1:
            options["credit_refill"] = "100/day"
        elif number % 10 == 2:
            options["expires_in"] = timedelta(days=90)
        created = await manager.create(name=f"k{number}", full_access=True, **options)
        if "credit_refill" in options:
            await manager.spend_credits(created.record, 85)

    for start in range(0, count, 200):
        await asyncio.gather(*(one(number) for number in range(start, min(count, start + 200))))


async def main(keys: int, rounds: int, take: bool) -> None:
    with own_redis() as url:
        store = store_from_url(url)
        hooks = store.webhooks()
        assert hooks is not None
        async with KeyManager(
            store,
            hasher=Hasher(pepper=b"L8dw49pa41XlgoBNkvoeuME4lzC2vZHAO-p4QCm4Kiw"),
            webhooks=False,
        ) as manager:
            await add_endpoint(
                hooks,
                "http://127.0.0.1:9/hooks",
                events=["key.expiring", "key.usage_threshold"],
                allow_private=True,  # never sent to: the benchmark times the look only
            )
            started = time.perf_counter()
            await fill(manager, keys)
            print(f"{keys} keys made in {time.perf_counter() - started:.1f} s")
            if take:
                while await store.client.zcard(store.outbox_index_name):
                    await hooks.take(utcnow())
            client = store.client
            print(f"{'round':>5} {'ms':>8} {'commands':>9} {'made':>6}")
            times = []
            for number in range(1, rounds + 1):
                before = await commands(client)
                now = utcnow()
                started = time.perf_counter()
                made = await hooks.expiring(now) + await hooks.usage_thresholds(now)
                elapsed = (time.perf_counter() - started) * 1000
                ran = await commands(client) - before
                times.append(elapsed)
                print(f"{number:>5} {elapsed:>8.1f} {ran:>9} {made:>6}")
            steady = times[1:] or times
            print(f"median of rounds 2-{rounds}: {statistics.median(steady):.1f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-take", action="store_true", help="leave the outboxes unread")
    args = parser.parse_args()
    asyncio.run(main(args.keys, args.rounds, not args.no_take))
