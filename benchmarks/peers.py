"""Peers: key verifications per second of apikeys, djangorestframework-api-key and keyshield.

All in one process, on one event loop, in alternating rounds (each contender gets the same
slice of time per round, and the report gives the median and the best round of each):

- apikeys: `KeyManager.verify(key)` with usage recording on (the middleware's path) and the
  default hasher (HMAC-SHA256 with a pepper), on the memory store and on SQLite (a file).
- djangorestframework-api-key 3.1: `APIKey.objects.is_valid(key)` on SQLite (a file), in a
  minimal in-process Django (contenttypes and rest_framework_api_key, migrated). 3.x hashes
  keys with its own `Sha512ApiKeyHasher` (one unsalted SHA-512), not with Django's
  `PASSWORD_HASHERS` (only keys made by 1.x/2.x go through those); the report says which
  hasher the stored keys name. It records no usage.
- keyshield 2.0.1: `ApiKeyService.verify_key(key)` on its `InMemoryApiKeyRepository`, with
  its default hasher (argon2, argon2-cffi's default parameters), bcrypt (12 rounds) and
  `MockApiKeyHasher` (plain string concatenation, meant for tests, so its fastest option:
  keyshield 2.0.1 has no HMAC hasher). `verify_key` sleeps a random 0.1 to 0.3 s by design
  (`min_delay`/`max_delay`); the service is built with both at 0 (it still awaits one
  `asyncio.sleep(0)`). Its in-memory repository finds a key by scanning every key, so
  one more row shows the mock hasher with 10,000 keys in the repository.

Every contender holds 10 keys and verifies them in turn. The peer libraries are not
dependencies of apikeys: this runs in the bench venv (`benchmarks/.venv`, made by
`bench.py`). Run: `benchmarks/.venv/bin/python benchmarks/peers.py [--quick] [--json F]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import importlib.metadata  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    PEPPER,
    fmt,
    interrupt_on_sigterm,
    summary,
    table,
    write_json,
)

KEYS = 10
SCAN_KEYS = 10_000


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


class Contender:
    """One library and setup, with a call that verifies the next of its keys."""

    def __init__(
        self,
        name: str,
        library: str,
        store: str,
        hasher: str,
        *,
        sync: Callable[[], object] | None = None,
        coro: Callable[[], Awaitable[object]] | None = None,
        notes: str = "",
    ) -> None:
        self.name = name
        self.library = library
        self.store = store
        self.hasher = hasher
        self.sync = sync
        self.coro = coro
        self.notes = notes
        self.rates: list[float] = []

    def measure(self, loop: asyncio.AbstractEventLoop, seconds: float, minimum: int) -> float:
        if self.sync is not None:
            call = self.sync
            done = 0
            started = time.perf_counter()
            deadline = started + seconds
            while done < minimum or time.perf_counter() < deadline:
                call()
                done += 1
            rate = done / (time.perf_counter() - started)
        else:
            rate = loop.run_until_complete(self._measure_async(seconds, minimum))
        self.rates.append(rate)
        return rate

    async def _measure_async(self, seconds: float, minimum: int) -> float:
        assert self.coro is not None
        call = self.coro
        done = 0
        started = time.perf_counter()
        deadline = started + seconds
        while done < minimum or time.perf_counter() < deadline:
            await call()
            done += 1
        return done / (time.perf_counter() - started)


def cycle(items: list[str]) -> Callable[[], str]:
    index = -1

    def next_item() -> str:
        nonlocal index
        index = (index + 1) % len(items)
        return items[index]

    return next_item


# --- apikeys ------------------------------------------------------------------------------


async def apikeys_contenders(directory: Path) -> tuple[list[Contender], list[Any]]:
    from apikeys import Hasher, KeyManager, store_from_url

    contenders, managers = [], []
    for store_name, url in (("memory", "memory://"), ("SQLite", f"sqlite:///{directory}/ak.db")):
        manager = KeyManager(store_from_url(url), hasher=Hasher(pepper=PEPPER))
        await manager.store.setup()
        managers.append(manager)
        keys = [
            (await manager.create(name=f"peer-{i}", scopes=["contacts:read"])).key
            for i in range(KEYS)
        ]
        next_key = cycle(keys)

        def verify(manager: Any = manager, next_key: Callable[[], str] = next_key) -> Any:
            return manager.verify(next_key())

        contenders.append(
            Contender(
                f"apikeys {version('apikeys')}",
                "apikeys",
                store_name,
                "HMAC-SHA256 with a pepper (default)",
                coro=verify,
                notes="KeyManager.verify, usage recorded",
            )
        )
    return contenders, managers


# --- djangorestframework-api-key ----------------------------------------------------------


def drf_contender(directory: Path) -> tuple[Contender, dict[str, Any]]:
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=["django.contrib.contenttypes", "rest_framework_api_key"],
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(directory / "drf.sqlite3"),
            }
        },
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()
    from django.core.management import call_command
    from rest_framework_api_key.models import APIKey

    call_command("migrate", verbosity=0)
    keys = [APIKey.objects.create_key(name=f"peer-{i}")[1] for i in range(KEYS)]
    stored = APIKey.objects.first()
    generator = APIKey.objects.key_generator
    hasher = type(generator.preferred_hasher).__name__
    algorithm = stored.hashed_key.split("$", 1)[0] if stored else "?"
    next_key = cycle(keys)
    is_valid = APIKey.objects.is_valid

    def verify() -> None:
        if not is_valid(next_key()):
            raise SystemExit("djangorestframework-api-key refused its own key")

    info = {
        "django": version("django"),
        "djangorestframework-api-key": version("djangorestframework-api-key"),
        "hasher": f"{hasher} (stored hashes start with '{algorithm}$$')",
        "password_hashers_used": False,
    }
    contender = Contender(
        f"djangorestframework-api-key {info['djangorestframework-api-key']}",
        "djangorestframework-api-key",
        "SQLite",
        f"{hasher} (unsalted SHA-512; Django's PASSWORD_HASHERS not used)",
        sync=verify,
        notes=f"APIKey.objects.is_valid, Django {info['django']}, records no usage",
    )
    return contender, info


# --- keyshield ----------------------------------------------------------------------------


async def keyshield_contenders() -> tuple[list[Contender], dict[str, Any]]:
    from keyshield import ApiKeyService
    from keyshield.hasher.argon2 import Argon2ApiKeyHasher
    from keyshield.hasher.base import MockApiKeyHasher
    from keyshield.hasher.bcrypt import BcryptApiKeyHasher
    from keyshield.repositories.in_memory import InMemoryApiKeyRepository

    argon2 = Argon2ApiKeyHasher(pepper=PEPPER)
    parameters = argon2._ph  # argon2-cffi's PasswordHasher, default parameters
    info = {
        "keyshield": version("keyshield"),
        "argon2": (
            f"argon2id, time_cost={parameters.time_cost}, "
            f"memory_cost={parameters.memory_cost} KiB, parallelism={parameters.parallelism}"
        ),
        "bcrypt": "12 rounds (keyshield's default)",
        "delay": "min_delay=0, max_delay=0 (default: a random 0.1-0.3 s sleep per verify_key)",
    }
    hashers = (
        ("argon2 (default)", argon2, KEYS),
        ("bcrypt", BcryptApiKeyHasher(pepper=PEPPER), KEYS),
        ("mock: concatenation, for tests", MockApiKeyHasher(pepper=PEPPER), KEYS),
        ("mock: concatenation, for tests", MockApiKeyHasher(pepper=PEPPER), SCAN_KEYS),
    )
    contenders = []
    for label, hasher, count in hashers:
        repo = InMemoryApiKeyRepository()
        service = ApiKeyService(repo=repo, hasher=hasher, min_delay=0, max_delay=0)
        keys = [(await service.create(name=f"peer-{i}"))[1] for i in range(KEYS)]
        if count > KEYS:
            # Filler keys straight into the repository (its create() scans every key too),
            # half before and half after the keys verified: a scan's average case.
            template = next(iter(repo._store.values()))
            fillers = [
                type(template)(key_id=f"filler{i:010d}", key_hash=template.key_hash, name="f")
                for i in range(count - KEYS)
            ]
            real = dict(repo._store)
            repo._store.clear()
            half = len(fillers) // 2
            for entity in fillers[:half]:
                repo._store[entity.id_] = entity
            repo._store.update(real)
            for entity in fillers[half:]:
                repo._store[entity.id_] = entity
        next_key = cycle(keys)

        def verify(service: Any = service, next_key: Callable[[], str] = next_key) -> Any:
            return service.verify_key(next_key())

        store = "memory" if count == KEYS else f"memory, {count:,} keys (scanned)"
        contenders.append(
            Contender(
                f"keyshield {info['keyshield']}",
                "keyshield",
                store,
                label,
                coro=verify,
                notes="ApiKeyService.verify_key, InMemoryApiKeyRepository, no delay",
            )
        )
    return contenders, info


# --- the run ------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    missing = [
        module
        for module in ("django", "rest_framework_api_key", "keyshield", "argon2", "bcrypt")
        if not _importable(module)
    ]
    if missing:
        raise SystemExit(
            f"peers.py needs {', '.join(missing)}: run it with the bench venv's python "
            "(python benchmarks/bench.py --only peers makes the venv)"
        )
    warnings.simplefilter("ignore")  # keyshield warns about peppers and delays; noted above
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with tempfile.TemporaryDirectory(prefix="apikeys-bench-peers-") as tmp:
        directory = Path(tmp)
        ours, managers = loop.run_until_complete(apikeys_contenders(directory))
        drf, drf_info = drf_contender(directory)
        keyshield, keyshield_info = loop.run_until_complete(keyshield_contenders())
        contenders = [*ours, drf, *keyshield]
        try:
            for contender in contenders:  # warm up: caches, prepared statements, imports
                contender.measure(loop, 0.05, 2)
                contender.rates.clear()
            for index in range(args.rounds):
                for contender in contenders:
                    contender.measure(loop, args.seconds, 3)
                print(
                    f"  round {index + 1}/{args.rounds}: "
                    + ", ".join(
                        f"{c.library} {c.store} {c.rates[-1]:,.0f}/s" for c in contenders[:3]
                    )
                    + " ...",
                    flush=True,
                )
        finally:
            for manager in managers:
                loop.run_until_complete(manager.aclose())
            loop.close()
    results = []
    for contender in contenders:
        rates = summary(contender.rates)
        results.append(
            {
                "name": contender.name,
                "library": contender.library,
                "store": contender.store,
                "hasher": contender.hasher,
                "notes": contender.notes,
                "verify_per_s": rates,
                "us_per_verify": 1e6 / rates["median"],
            }
        )

    def median(library: str, store: str, hasher_start: str = "") -> float:
        for r in results:
            if (
                r["library"] == library
                and r["store"] == store
                and r["hasher"].startswith(hasher_start)
            ):
                return float(r["verify_per_s"]["median"])
        raise KeyError((library, store, hasher_start))

    ours_memory = median("apikeys", "memory")
    ours_sqlite = median("apikeys", "SQLite")
    ratios = {
        "apikeys_memory_vs_keyshield_argon2_default": ours_memory
        / median("keyshield", "memory", "argon2"),
        "apikeys_sqlite_vs_keyshield_argon2_default": ours_sqlite
        / median("keyshield", "memory", "argon2"),
        "apikeys_memory_vs_keyshield_bcrypt": ours_memory / median("keyshield", "memory", "bcrypt"),
        "apikeys_memory_vs_keyshield_mock": ours_memory / median("keyshield", "memory", "mock"),
        "apikeys_sqlite_vs_drf_api_key_sqlite": ours_sqlite
        / median("djangorestframework-api-key", "SQLite"),
    }
    # The same ratio taken within each round (the two ran seconds apart), then the median
    # of the rounds: a neighbour's load that slows one round slows both sides of its ratio.
    ours_rounds = next(c for c in contenders if c.library == "apikeys" and c.store == "SQLite")
    drf_rounds = drf.rates
    within_rounds = sorted(a / b for a, b in zip(ours_rounds.rates, drf_rounds, strict=True))
    paired = {
        "apikeys_sqlite_vs_drf_api_key_sqlite": {
            "median": statistics.median(within_rounds),
            "worst": within_rounds[0],
            "best": within_rounds[-1],
            "rounds": [round(value, 2) for value in within_rounds],
        }
    }
    output = {
        "rounds": args.rounds,
        "seconds_per_round": args.seconds,
        "keys_per_contender": KEYS,
        "python": sys.version.split()[0],
        "versions": {"djangorestframework-api-key": drf_info, "keyshield": keyshield_info},
        "results": results,
        "ratios_of_medians": ratios,
        "ratios_within_rounds": paired,
    }
    report(output)
    return output


def _importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def report(output: dict[str, Any]) -> None:
    rows = [
        [
            r["name"],
            r["store"],
            r["hasher"],
            fmt(r["verify_per_s"]["median"]),
            fmt(r["verify_per_s"]["best"]),
            fmt(r["us_per_verify"], 1),
        ]
        for r in output["results"]
    ]
    print("\nPeers: key verifications per second, one after another (median / best round)")
    print(table(["library", "store", "hasher", "verify/s", "best", "us/verify"], rows, right=3))
    print("  " + output["versions"]["keyshield"]["delay"])
    print("  keyshield argon2: " + output["versions"]["keyshield"]["argon2"])
    print(
        "  djangorestframework-api-key hasher: "
        + output["versions"]["djangorestframework-api-key"]["hasher"]
    )
    for name, value in output["ratios_of_medians"].items():
        print(f"  {name.replace('_', ' ')}: {value:,.1f}x")
    for name, within in output.get("ratios_within_rounds", {}).items():
        print(
            f"  {name.replace('_', ' ')}, within each round: median {within['median']:,.1f}x "
            f"(rounds {within['worst']:,.1f}x to {within['best']:,.1f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 0.5 s")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="per contender per round")
    parser.add_argument("--json", type=Path, help="write the results to this file")
    args = parser.parse_args()
    interrupt_on_sigterm()
    if args.quick:
        args.rounds, args.seconds = 3, 0.5
    output = run(args)
    if args.json:
        write_json(args.json, output)


if __name__ == "__main__":
    main()
