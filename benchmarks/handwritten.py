"""What `APIKeyMiddleware` adds to a request next to a hand-written check, in one run.

Three apps answer the same trivial Starlette endpoint on raw ASGI (no server, no client
library, so the numbers are quiet):

- `bare`: the endpoint alone;
- `hand-written`: behind a pure ASGI check written the way one would by hand: read the
  Authorization header, HMAC-SHA256 of the secret with a pepper, one dict lookup, one
  scope test (`HandWrittenCheck` below);
- `apikeys`: behind `APIKeyMiddleware` with the memory store and limiter, one scope rule and
  one rate limit: checksum, peppered hash, cache, scopes, the limit and its IETF headers,
  usage counting and the telemetry guards all run.

Rounds alternate between the three, so that drift in the machine's speed hits them alike.
Each round measures the process's CPU time (`time.process_time`), not the wall clock: on a
shared machine another process's work is not counted. Printed: the CPU time per request of
each (median and best round), what the hand-written check and the middleware add to bare,
and the ratio of the two additions, pair by pair within a round (its median is the figure).
The aim: at most 2.

Run: `python benchmarks/handwritten.py [--rounds 30] [--per-round 3000] [--json FILE]`.
`--rate-limit` gives the key several limits ("a=1000000000/second, b=1000000000/day").
`--count` counts what the interpreter executes per request instead of timing it: bytecode
instructions (`sys.settrace` opcode events), Python calls and calls into C
(`sys.setprofile`). The counts do not depend on the machine's load. With `--watched`, a
webhook endpoint wants `key.usage_threshold`, so the limiter is watched for thresholds.
With `--identity [LIMIT]`, the key belongs to an identity with that limit (unlimited by
default): its limits are charged with the key's.
`--only APP --requests N` only calls one app (`bare`, `hand-written` or `apikeys`) N times
after a warm-up, for a profiler that counts machine instructions: run it under
`valgrind --tool=callgrind` with N and with 0 (and `PYTHONHASHSEED=0`) and divide the
difference by N.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import hmac  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import UNLIMITED, asgi_caller  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from apikeys import APIKeyMiddleware, Hasher, KeyManager, MemoryStore  # noqa: E402
from apikeys.webhooks.admin import add_endpoint  # noqa: E402

AIM = 2.0
PATH = "/api/v1/contacts"


async def endpoint(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok")


def starlette_app() -> Starlette:
    return Starlette(routes=[Route(PATH, endpoint)])


class HandWrittenCheck:
    """The check one would write by hand: a Bearer token, its peppered HMAC-SHA256 looked up
    in a dict of hashes, and the route's scope among the key's.

    No key format, no cache, no limits, no usage counts, no telemetry: the yardstick.
    """

    def __init__(self, app: Any, pepper: bytes, scopes: dict[tuple[str, str], str]) -> None:
        self.app = app
        self.pepper = pepper
        self.scopes = scopes
        self.keys: dict[str, frozenset[str]] = {}  # hex digest -> the key's scopes

    def add_key(self, token: str, scopes: list[str]) -> None:
        digest = hmac.new(self.pepper, token.encode(), hashlib.sha256).hexdigest()
        self.keys[digest] = frozenset(scopes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                token = value
        if not token.startswith(b"Bearer "):
            await self.refuse(send, 401)
            return
        digest = hmac.new(self.pepper, token[7:], hashlib.sha256).hexdigest()
        granted = self.keys.get(digest)
        if granted is None:
            await self.refuse(send, 401)
            return
        required = self.scopes.get((scope["method"], scope["path"]))
        if required is None or required not in granted:
            await self.refuse(send, 403)
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def refuse(send: Any, status: int) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})


async def build(rate_limit: str, identity: str | None = None) -> tuple[dict[str, Any], KeyManager]:
    """The three apps with the headers each is called with, and the manager to close.
    `identity`: the key belongs to an identity with that limit (or limits)."""
    pepper = os.urandom(32)
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=pepper))
    protected = APIKeyMiddleware(
        starlette_app(),
        manager=manager,
        scopes={f"GET {PATH}": "contacts:read"},
        protect="/api/",
        rate_limit=UNLIMITED,
    )
    options: dict[str, Any] = {}
    if identity is not None:
        await manager.create_identity("bench", workspace="default", rate_limit=identity or None)
        options["identity"] = "bench"
    created = await manager.create(
        name="bench", scopes=["contacts:read"], rate_limit=rate_limit, **options
    )
    hand = HandWrittenCheck(starlette_app(), pepper, {("GET", PATH): "contacts:read"})
    hand.add_key(created.key, ["contacts:read"])
    auth = [(b"user-agent", b"bench"), (b"authorization", f"Bearer {created.key}".encode())]
    apps = {
        "bare": asgi_caller(starlette_app(), auth, PATH),
        "hand-written": asgi_caller(hand, auth, PATH),
        "apikeys": asgi_caller(protected, auth, PATH),
    }
    return apps, manager


async def measure(rounds: int, per_round: int, rate_limit: str) -> dict[str, Any]:
    calls, manager = await build(rate_limit)

    async def run(name: str, count: int) -> float:
        call = calls[name]
        start = time.process_time()
        for _ in range(count):
            await call()
        return (time.process_time() - start) / count

    try:
        for name in calls:
            await run(name, 2000)
        gc.collect()
        per: dict[str, list[float]] = {name: [] for name in calls}
        names = list(calls)
        for index in range(rounds):
            # Alternate the order too: the first of a round may pay for the last's garbage.
            for name in names if index % 2 == 0 else reversed(names):
                per[name].append(await run(name, per_round) * 1e6)
    finally:
        await manager.aclose()
    rows = zip(per["bare"], per["hand-written"], per["apikeys"], strict=True)
    ratios = [(apikeys - bare) / (hand - bare) for bare, hand, apikeys in rows if hand > bare]
    median = {name: statistics.median(values) for name, values in per.items()}
    return {
        "rounds": rounds,
        "per_round": per_round,
        "rate_limit": rate_limit,
        "us_per_request": median,
        "best_us_per_request": {name: min(values) for name, values in per.items()},
        "hand_written_added_us": median["hand-written"] - median["bare"],
        "apikeys_added_us": median["apikeys"] - median["bare"],
        "ratio": statistics.median(ratios) if ratios else float("inf"),
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "aim": AIM,
        "rounds_us": per,
    }


async def _counted(call: Any, requests: int) -> dict[str, float]:
    """Instructions, Python calls and C calls per request of `requests` calls of `call`."""
    tally = {"instructions": 0, "python calls": 0, "C calls": 0}

    def on_opcode(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            tally["instructions"] += 1
        return on_opcode

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return on_opcode

    def on_profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            tally["python calls"] += 1
        elif event == "c_call":
            tally["C calls"] += 1

    sys.settrace(on_call)
    sys.setprofile(on_profile)
    try:
        for _ in range(requests):
            await call()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return {kind: value / requests for kind, value in tally.items()}


async def count(
    requests: int, rate_limit: str, watched: bool = False, identity: str | None = None
) -> dict[str, Any]:
    """Bytecode instructions, Python calls and C calls per request of each app, and what the
    hand-written check and the middleware add to bare: counts, not times. `watched`: an
    endpoint wants `key.usage_threshold`, and a delivery round has seen it. `identity`: the
    key belongs to an identity with that limit."""
    calls, manager = await build(rate_limit, identity)
    per: dict[str, dict[str, float]] = {}
    try:
        if watched:
            hooks = manager.store.webhooks()
            assert hooks is not None
            assert manager.deliverer is not None
            await add_endpoint(
                hooks,
                "http://127.0.0.1:9/hooks",
                events=["key.usage_threshold"],
                allow_private=True,
            )
            await manager.deliverer.run_once()
            assert manager.deliverer.thresholds.on
        for name, call in calls.items():
            for _ in range(50):  # caches filled, windows opened, first-call work done
                await call()
            per[name] = await _counted(call, requests)
    finally:
        await manager.aclose()
    added = {
        name: {kind: per[name][kind] - per["bare"][kind] for kind in per["bare"]}
        for name in ("hand-written", "apikeys")
    }
    ratio = added["apikeys"]["instructions"] / added["hand-written"]["instructions"]
    return {
        "requests": requests,
        "rate_limit": rate_limit,
        "watched": watched,
        "identity": identity,
        "per_request": per,
        "added": added,
        "instruction_ratio": ratio,
    }


def report_count(result: dict[str, Any]) -> None:
    print(
        f"per request, counted over {result['requests']} requests (sys.settrace, "
        f"sys.setprofile); rate limit {result['rate_limit']}"
        + ("; watched for thresholds" if result.get("watched") else "")
        + (
            f"; a key of an identity limited to {result['identity']}"
            if result.get("identity")
            else ""
        )
    )
    kinds = list(result["per_request"]["bare"])
    print(f"  {'':<24}" + "".join(f"{kind:>16}" for kind in kinds))
    for name, values in result["per_request"].items():
        print(f"  {name:<24}" + "".join(f"{values[kind]:16.1f}" for kind in kinds))
    for name, values in result["added"].items():
        print(f"  {name + ' adds':<24}" + "".join(f"{values[kind]:16.1f}" for kind in kinds))
    print(f"  ratio of the added instructions: {result['instruction_ratio']:.2f}x")


async def steps(rounds: int, per_round: int) -> dict[str, float]:
    """What each step of the middleware's request path costs: the CPU time per request of
    the middleware whole, then with one step at a time replaced by a stub that answers what
    the step would have (a lambda: its own call is counted in), in alternating rounds.
    The difference is that step's share; what no step accounts for is the rest of the
    path (reading the header, the Bearer scheme, the shape of the limit, `scope["auth"]`
    and `scope["user"]`, the wrapper of `send` that adds the headers)."""
    from apikeys.keys import CHECKSUM_LENGTH, environments_of, prefixes_splitter

    pepper = os.urandom(32)
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=pepper))
    app = APIKeyMiddleware(
        starlette_app(),
        manager=manager,
        scopes={f"GET {PATH}": "contacts:read"},
        protect="/api/",
        rate_limit=UNLIMITED,
    )
    created = await manager.create(name="bench", scopes=["contacts:read"])
    auth = [(b"user-agent", b"bench"), (b"authorization", f"Bearer {created.key}".encode())]
    call = asgi_caller(app, auth, PATH)
    bare = asgi_caller(starlette_app(), auth, PATH)
    parts = prefixes_splitter(environments_of(manager.prefix))(created.key)
    stored = await manager.store.get_for_verification(parts[1])
    assert stored is not None
    record = stored.record
    charged = app.limiter.charge(app.limiter.plan(record.id, record.rate_limit))
    assert isinstance(charged, tuple)
    required = app.scopes.required("GET", PATH)
    originals = {
        # The full check of the key format (regex, checksum): since verify_now splits by
        # position, run at a key version's first request only, so about 0 here.
        "key format, in full (prefixes_splitter: regex, checksum)": (
            manager,
            "_split",
            lambda token: parts,
        ),
        # The key version's prepared check of its hash (Hasher.matcher), answering a match,
        # and the checksum of the token it matched.
        "peppered hash (HMAC-SHA256)": (
            manager,
            "_plain",
            {
                record.id: (
                    stored,
                    lambda secret: True,
                    created.key[-CHECKSUM_LENGTH:],
                    record.key_prefix,
                )
            },
        ),
        "store or cache lookup": (
            manager.store,
            "get_for_verification_now",
            lambda key_id: stored,
        ),
        "usage counting": (manager.usage_buffer, "record", lambda key_id: None),
        "rate limit (count and decision)": (
            app.limiter,
            "charge",
            lambda plan, cost=1: charged,
        ),
        "scope table lookup": (app.scopes, "required", lambda method, path: required),
        "verification whole (manager.verify_now)": (
            manager,
            "verify_now",
            lambda token, count=True, identity=True: record,
        ),
    }

    async def run(count: int, stub: str | None) -> float:
        chosen = call if stub != "bare" else bare
        patched = originals.get(stub or "")
        own: dict[str, Any] = {}
        if patched is not None:
            owner, name, replacement = patched
            own = vars(owner)
            saved = own.get(name)
            setattr(owner, name, replacement)
        try:
            start = time.process_time()
            for _ in range(count):
                await chosen()
            return (time.process_time() - start) / count
        finally:
            if patched is not None:
                if saved is not None:
                    setattr(owner, name, saved)  # a module's own function
                else:
                    delattr(owner, name)  # an instance's: its class's method again

    names: list[str | None] = [None, "bare", *originals]
    try:
        for name in names:
            await run(1000, name)
        per: dict[str | None, list[float]] = {name: [] for name in names}
        for _ in range(rounds):
            for name in names:
                per[name].append(await run(per_round, name) * 1e6)
    finally:
        await manager.aclose()
    whole = statistics.median(per[None])
    shares = {name: whole - statistics.median(per[name]) for name in originals}
    shares["whole middleware (added to bare)"] = whole - statistics.median(per["bare"])
    return shares


async def only(name: str, requests: int, rate_limit: str) -> None:
    """`requests` calls of the app `name`, after 300 to warm up, and nothing else."""
    calls, manager = await build(rate_limit)
    try:
        call = calls[name]
        for _ in range(300 + requests):
            await call()
    finally:
        await manager.aclose()


def report_steps(shares: dict[str, float]) -> None:
    print("what each step costs (us/request, CPU time, the whole minus the whole with a stub):")
    for name, value in shares.items():
        print(f"  {name:<42} {value:6.2f}")


def report(result: dict[str, Any]) -> None:
    print(
        f"CPU time per request (time.process_time), {result['rounds']} alternating rounds of "
        f"{result['per_round']} requests; rate limit {result['rate_limit']}"
    )
    for name, value in result["us_per_request"].items():
        best = result["best_us_per_request"][name]
        print(f"  {name:<14} {value:7.2f} us/request (median)   {best:7.2f} (best round)")
    print(f"  added by the hand-written check: {result['hand_written_added_us']:6.2f} us")
    print(f"  added by APIKeyMiddleware:       {result['apikeys_added_us']:6.2f} us")
    low, high = result["ratio_range"] or (float("nan"), float("nan"))
    verdict = "met" if result["ratio"] <= result["aim"] else "not met"
    print(
        f"  ratio of the additions: {result['ratio']:.2f}x (pair by pair: {low:.2f}-{high:.2f}); "
        f"aim <= {result['aim']:.0f}x: {verdict}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("-p", "--per-round", type=int, default=3000)
    parser.add_argument("--rate-limit", default=UNLIMITED, help="the key's limit or limits")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--steps", action="store_true", help="what each step costs")
    parser.add_argument(
        "--count", action="store_true", help="instructions and calls per request, not time"
    )
    parser.add_argument(
        "--watched",
        action="store_true",
        help="with --count: an endpoint wants key.usage_threshold (the limiter is watched)",
    )
    parser.add_argument(
        "--identity",
        nargs="?",
        const=UNLIMITED,
        help="with --count: the key belongs to an identity with this limit (default: unlimited)",
    )
    parser.add_argument("--only", choices=["bare", "hand-written", "apikeys"])
    parser.add_argument("--requests", type=int, default=2000, help="with --only")
    args = parser.parse_args()
    if args.only:
        asyncio.run(only(args.only, args.requests, args.rate_limit))
        raise SystemExit(0)
    if args.count:
        counted = asyncio.run(count(200, args.rate_limit, args.watched, args.identity))
        report_count(counted)
        if args.json:
            args.json.write_text(json.dumps(counted, indent=2))
        raise SystemExit(0)
    if args.steps:
        report_steps(asyncio.run(steps(args.rounds, args.per_round)))
        raise SystemExit(0)
    outcome = asyncio.run(measure(args.rounds, args.per_round, args.rate_limit))
    report(outcome)
    if args.json:
        args.json.write_text(json.dumps(outcome, indent=2))
