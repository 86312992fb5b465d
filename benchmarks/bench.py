"""Run every benchmark, side by side, and say where apikeys stands against its aims.

Sections, each in a process of its own (so that one's memory or servers never weigh on the
next), in this order:

- `http`: uvicorn + Starlette bare and behind `APIKeyMiddleware`, loaded by wrk, for every
  store with the key cache and without it, with round trips and store operations per request
  (benchmarks/http_load.py);
- `revoke`: how long `revoke` takes with four worker processes caching keys under load, and
  that no process admits the key after it returned (benchmarks/revoke.py);
- `peers`: verifications per second of apikeys, djangorestframework-api-key and keyshield
  (benchmarks/peers.py, in the bench venv);
- `growth`: verification time with 10, 10,000 and 1,000,000 keys (benchmarks/growth.py);
- `stores`: per-store verifications per second and round trips, in-process
  (benchmarks/stores.py);
- `overhead`: what the middleware adds per request, in-process (benchmarks/overhead.py);
- `handwritten`: what the middleware adds next to what a hand-written check adds, in CPU
  time per request, in-process (benchmarks/handwritten.py).
- `memory`: the key cache's memory per cached key, in RSS and by tracemalloc, with 10,000
  and 50,000 keys (benchmarks/cache_memory.py).

It makes the bench venv (`benchmarks/.venv`: uvicorn with uvloop and httptools, the peer
libraries, matplotlib, the profilers) on first use, installs wrk from Debian's packages when
it is missing and this runs as root (else the HTTP load comes from an httpx loop), prints a
summary with every aim, and writes `benchmarks/results/latest.json` and `latest.png`.
PostgreSQL and Redis come from `APIKEYS_TEST_POSTGRES_URL` and `APIKEYS_TEST_REDIS_URL`
(default: the local servers); a section skips what it cannot reach. Every server, database,
table, file and Redis key a section makes is removed when it ends, interrupted or not.

Run: `python benchmarks/bench.py [--only http,peers,growth,stores,overhead,handwritten,memory]
[--quick]`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [str(ROOT), *(p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks")]

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks._common import (  # noqa: E402
    POSTGRES_URL,
    RESULTS,
    ensure_bench_venv,
    fmt,
    git_state,
    machine,
    postgres_reachable,
    sqlite_rates,
    table,
    write_json,
)

from apikeys.cache import DEFAULT_LEASE  # noqa: E402

SECTIONS = ("http", "revoke", "peers", "growth", "stores", "overhead", "handwritten", "memory")
AIMS = {
    "http_memory_ratio": 0.85,
    "http_cached_ratio": 0.8,
    "sql_store_ops_per_request": 0.02,
    "redis_commands_per_request": 0.2,
    "revoke_p99_ms": 20.0,
    # p99 of revoke with the workers under wrk's load, in leases of the key cache
    "revoke_loaded_p99_leases": 1.5,
    "round_trips_per_request": 2.0,
    "vs_keyshield_default": 100.0,
    "vs_drf_api_key_sqlite": 10.0,
    # what the middleware adds to a request over what a hand-written check adds
    "handwritten_ratio": 2.0,
    "memory_verify_per_s": 100_000.0,
    "flat_growth": 1.5,
}


# The key cache's lease, which the revoke benchmark's workers keep.
LEASE_MS = DEFAULT_LEASE * 1000


class Interrupted(Exception):
    pass


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Interrupted()


# --- preparing ----------------------------------------------------------------------------


WRK_MISSING = (
    "wrk is not installed (Debian and Ubuntu: apt-get install wrk, which make bench does "
    "when run as root; macOS: brew install wrk)"
)


def ensure_wrk() -> str | None:
    """wrk's path; installed from Debian's packages when missing and we are root."""
    found = shutil.which("wrk")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    print("installing wrk (apt-get install -y wrk)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "wrk"]
    if subprocess.run(install, env=env, capture_output=True, check=False).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, check=False)
        subprocess.run(install, env=env, capture_output=True, check=False)
    return shutil.which("wrk")


# --- running the sections -----------------------------------------------------------------


def section_command(name: str, out: Path, quick: bool, venv: Path | None) -> list[str] | None:
    here = sys.executable
    quick_flag = ["--quick"] if quick else []
    if name == "http":
        command = [here, "-m", "benchmarks.http_load", "--json", str(out), *quick_flag]
        if venv is not None:
            command += ["--server-python", str(venv)]
        return command
    if name == "revoke":
        command = [here, "-m", "benchmarks.revoke", "--json", str(out), *quick_flag]
        if venv is not None:
            command += ["--server-python", str(venv)]
        return command
    if name == "peers":
        if venv is None:
            return None
        return [str(venv), "-m", "benchmarks.peers", "--json", str(out), *quick_flag]
    if name == "growth":
        return [here, "-m", "benchmarks.growth", "--json", str(out), *quick_flag]
    if name == "stores":
        seconds = "0.6" if quick else "1.5"
        return [here, "-m", "benchmarks.stores", "--seconds", seconds, "--json", str(out)]
    if name == "overhead":
        rounds = ["--rounds", "5", "--per-round", "2000"] if quick else []
        return [here, "-m", "benchmarks.overhead", *rounds]
    if name == "handwritten":
        rounds = ["--rounds", "10", "--per-round", "1000"] if quick else []
        return [here, "-m", "benchmarks.handwritten", "--json", str(out), *rounds]
    if name == "memory":
        keys = ["--keys", "10000"] if quick else []
        return [here, "-m", "benchmarks.cache_memory", "--json", str(out), *keys]
    raise ValueError(name)


async def _bench_tables() -> set[str]:
    """Tables named like the stores benchmark's (`bench_keys_<run>...`) in PostgreSQL."""
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL)
    try:
        rows = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE 'bench_keys_%'"
        )
    finally:
        await conn.close()
    return {row["tablename"] for row in rows}


async def _drop_tables(names: set[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL)
    try:
        for name in sorted(names):
            await conn.execute(f'DROP TABLE IF EXISTS "{name}"')
    finally:
        await conn.close()


def run_section(name: str, command: list[str], out: Path) -> dict[str, Any]:
    """`run_section_process`, and for `stores` a sweep of the tables it may leave behind.

    stores.py drops its keys table but not the usage-batches table the SQL store now makes
    beside it; whatever new `bench_keys_*` table is left after the section is dropped here.
    """
    if name != "stores" or not postgres_reachable():
        return run_section_process(name, command, out)
    before = asyncio.run(_bench_tables())
    try:
        return run_section_process(name, command, out)
    finally:
        left = asyncio.run(_bench_tables()) - before
        if left:
            asyncio.run(_drop_tables(left))
            print(f"dropped {len(left)} table(s) the stores section left: {sorted(left)}")


def run_section_process(name: str, command: list[str], out: Path) -> dict[str, Any]:
    """Run one section, its output shown as it comes; its JSON (or its text) back."""
    started = time.perf_counter()
    print(f"\n=== {name} " + "=" * (70 - len(name)), flush=True)
    process = subprocess.Popen(
        command,
        cwd=str(ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # A session of its own: a Ctrl-C reaches this runner only, which passes it on once.
        start_new_session=True,
    )
    lines: list[str] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
        process.wait()
    except BaseException:
        # Interrupted: let the section clean up (its servers, tables, Redis keys), then go.
        # SIGTERM, not SIGINT: a shell starts background jobs with SIGINT ignored, and every
        # section turns SIGTERM into KeyboardInterrupt.
        process.terminate()
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the section and whatever it started
            process.wait()
        raise
    elapsed = round(time.perf_counter() - started, 1)
    result: dict[str, Any] = {"seconds": elapsed}
    if process.returncode != 0:
        result["error"] = f"exited with {process.returncode}: {''.join(lines[-5:]).strip()}"
    elif out.exists():
        result.update(json.loads(out.read_text()))
    else:
        result["text"] = "".join(lines)
    if name == "overhead" and "text" in result:
        result.update(parse_overhead(result["text"]))
    return result


def parse_overhead(text: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, label in (
        ("bare_us", "bare Starlette"),
        ("middleware_us", "with APIKeyMiddleware"),
        ("added_us", "added by the middleware"),
        ("ratio", "ratio"),
    ):
        match = re.search(rf"^{re.escape(label)}:\s*([\d.]+)", text, re.M)
        if match:
            found[key] = float(match.group(1))
    return found


# --- aims ---------------------------------------------------------------------------------


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every aim of the issue with the measured value, its target and whether it is met."""
    aims: list[dict[str, Any]] = []

    def add(aim: str, value: float | None, target: str, met: bool | None, note: str) -> None:
        aims.append({"aim": aim, "value": value, "target": target, "met": met, "note": note})

    http = results.get("http", {})
    configs = http.get("configs", [])
    for hand in (c for c in configs if c.get("store") == "hand-written" and "ratio_paired" in c):
        headers = hand.get("limiter") == "headers"
        add(
            "HTTP throughput, hand-written check"
            + (" + the two RateLimit headers" if headers else "")
            + " (the yardstick, not an aim), vs bare",
            hand["ratio_paired"]["median"],
            "-",
            None,
            "a Bearer header, peppered HMAC-SHA256, a dict lookup, a scope test"
            + ("" if headers else "; no limits, no RateLimit headers")
            + f"; {fmt(hand.get('cpu_us_added_per_request'), 1)} us CPU added",
        )
    for config in http.get("configs", []):
        if config.get("store") == "memory" and "ratio_paired" in config:
            ratio = config["ratio_paired"]["median"]
            add(
                "HTTP throughput, memory store, vs bare",
                ratio,
                f">= {AIMS['http_memory_ratio']}",
                ratio >= AIMS["http_memory_ratio"],
                f"median of paired rounds; best/best {config['ratio_of_best']:.2f}",
            )
    for config in http.get("configs", []):
        if config.get("store") in ("memory", "hand-written") or not config.get("cache", True):
            continue
        label = f"{config['store']} + {config['limiter']} limiter, cache"
        if "ratio_paired" in config:
            ratio = config["ratio_paired"]["median"]
            add(
                f"HTTP throughput, {label}, vs bare",
                ratio,
                f">= {AIMS['http_cached_ratio']}",
                ratio >= AIMS["http_cached_ratio"],
                f"median of paired rounds; best/best {config['ratio_of_best']:.2f}",
            )
        ops = (config.get("store_operations") or {}).get("store_operations_per_request")
        if ops is not None:
            target = (
                AIMS["redis_commands_per_request"]
                if config["store"] == "redis"
                else AIMS["sql_store_ops_per_request"]
            )
            note = config["store_operations"].get("unit", "")
            if "statements_per_second" in config["store_operations"]:
                note += "; " + sqlite_rates(config["store_operations"])
            add(
                f"store operations per request, {label}",
                round(ops, 4),
                f"<= {target:g}",
                ops <= target,
                note,
            )
    revoke = results.get("revoke", {})
    for store, measured in (revoke.get("stores") or {}).items():
        if "p99_ms" in measured:
            loaded = measured.get("under_load") or {}
            stale = measured["stale_admits"] + loaded.get("stale_admits", 0)
            under = (
                f"; under wrk load p50 {loaded['p50_ms']:.1f} ms, p99 {loaded['p99_ms']:.0f} ms"
                if "p99_ms" in loaded
                else ""
            )
            add(
                f"revoke returns, {store}, {measured['workers']} worker processes",
                measured["p99_ms"],
                f"p99 < {AIMS['revoke_p99_ms']:g} ms",
                measured["p99_ms"] < AIMS["revoke_p99_ms"] and stale == 0,
                f"{measured['samples']} revokes; p50 {measured['p50_ms']:.1f} ms{under}; "
                f"{stale} stale admits after return",
            )
            if "p99_ms" in loaded:
                bound = AIMS["revoke_loaded_p99_leases"] * LEASE_MS
                # Without wrk the "loaded" run had no load: it says nothing of this aim.
                had_load = loaded.get("wrk", True)
                add(
                    f"revoke returns under wrk load, {store}, {measured['workers']} workers",
                    loaded["p99_ms"],
                    f"p99 <= {bound:g} ms ({AIMS['revoke_loaded_p99_leases']:g} leases)",
                    had_load and loaded["p99_ms"] <= bound and stale == 0,
                    f"p50 {loaded['p50_ms']:.1f} ms"
                    if had_load
                    else f"not measured under load: {WRK_MISSING}",
                )
    for config in http.get("configs", []):
        trips = config.get("round_trips")
        if trips:
            # Two decimals: a pool's connection setups, spread over thousands of requests, are
            # not a third round trip per request.
            total = round(trips["round_trips_per_request"], 2)
            add(
                f"round trips per request, {config['store']} + {config['limiter']} limiter",
                total,
                f"<= {AIMS['round_trips_per_request']:g}",
                total <= AIMS["round_trips_per_request"],
                f"store {trips['store_round_trips_per_request']:.2f}, "
                f"limiter {trips['limiter_round_trips_per_request']:.2f}; sequential requests",
            )
            under = trips.get("under_load")
            if under:
                total = round(under["round_trips_per_request"], 2)
                opened = under.get("store_connections_opened")
                add(
                    f"round trips per request, {config['store']} + {config['limiter']} limiter, "
                    f"under load ({under['load_connections']} connections)",
                    total,
                    f"<= {AIMS['round_trips_per_request']:g}",
                    total <= AIMS["round_trips_per_request"],
                    f"{opened} store connections opened in 3 s" if opened is not None else "",
                )
    peers = results.get("peers", {})
    ratios = peers.get("ratios_of_medians", {})
    if ratios:
        value = ratios["apikeys_memory_vs_keyshield_argon2_default"]
        add(
            "verifications/s vs keyshield default (argon2), both in memory",
            value,
            f">= {AIMS['vs_keyshield_default']:g}x",
            value >= AIMS["vs_keyshield_default"],
            f"apikeys on SQLite: {ratios['apikeys_sqlite_vs_keyshield_argon2_default']:,.0f}x; "
            "vs keyshield's test-only mock hasher: "
            f"{ratios['apikeys_memory_vs_keyshield_mock']:.1f}x",
        )
        value = ratios["apikeys_sqlite_vs_drf_api_key_sqlite"]
        note = "drf-api-key 3.1 hashes with one SHA-512"
        within = peers.get("ratios_within_rounds", {}).get("apikeys_sqlite_vs_drf_api_key_sqlite")
        if within:  # taken within each round, then the median: steadier on a shared machine
            value = within["median"]
            note = f"median of rounds ({within['worst']:.1f}x to {within['best']:.1f}x); " + note
        add(
            "verifications/s vs djangorestframework-api-key, both on SQLite",
            round(value, 1),
            f">= {AIMS['vs_drf_api_key_sqlite']:g}x",
            value >= AIMS["vs_drf_api_key_sqlite"],
            note,
        )
    handwritten = results.get("handwritten", {})
    if "ratio" in handwritten:
        value = handwritten["ratio"]
        add(
            "added CPU per request vs a hand-written check, in-process",
            round(value, 2),
            f"<= {AIMS['handwritten_ratio']:g}x",
            value <= AIMS["handwritten_ratio"],
            f"middleware adds {handwritten['apikeys_added_us']:.1f} us, the hand-written "
            f"check {handwritten['hand_written_added_us']:.1f} us (medians of "
            f"{handwritten['rounds']} rounds)",
        )
    memory_rates = [
        r["verify_per_s"]["median"]
        for r in peers.get("results", [])
        if r["library"] == "apikeys" and r["store"] == "memory"
    ]
    growth = results.get("growth", {})
    for r in growth.get("results", []):
        if r["store"] == "memory":
            memory_rates.append(1e6 / r["sizes"][-1]["us_per_verify"]["median"])
    if memory_rates:
        value = min(memory_rates)
        add(
            "memory store verifications/s",
            value,
            f">= {AIMS['memory_verify_per_s']:,.0f}",
            value >= AIMS["memory_verify_per_s"],
            "the lower of peers (10 keys) and growth (largest store)",
        )
    for r in growth.get("results", []):
        largest = r["sizes"][-1]["keys"]
        value = r["largest_vs_smallest"]
        add(
            f"flat lookup cost, {r['store']}, {r['sizes'][0]['keys']:,} -> {largest:,} keys",
            value,
            f"<= {AIMS['flat_growth']:g}x",
            value <= AIMS["flat_growth"],
            f"{r['sizes'][0]['us_per_verify']['median']:.1f} -> "
            f"{r['sizes'][-1]['us_per_verify']['median']:.1f} us",
        )
    return aims


def _label(result: dict[str, Any]) -> str:
    if result["store"] == "hand-written":
        from benchmarks.http_load import hand_label

        return hand_label(result)
    label = f"{result['store']} + {result['limiter']}"
    if result["store"] != "memory":
        label += ", cache" if result.get("cache", True) else ", no cache"
    return label


def summarise(output: dict[str, Any]) -> str:
    results = output["results"]
    parts: list[str] = []
    http = results.get("http", {})
    if http.get("configs"):
        rows = []
        for r in http["configs"]:
            if "error" in r:
                rows.append([_label(r), "FAILED", "", "", "", "", "", ""])
                continue
            trips = r.get("round_trips") or {}
            ops = (r.get("store_operations") or {}).get("store_operations_per_request")
            rows.append(
                [
                    _label(r),
                    fmt(r["bare"]["rps"]["median"]),
                    fmt(r["auth"]["rps"]["median"]),
                    fmt(r["ratio_paired"]["median"], 2),
                    fmt(r["auth"]["p50_ms"]["median"], 2),
                    fmt(r["auth"]["p99_ms"]["median"], 2),
                    (
                        f"{trips['round_trips_per_request']:.2f} / "
                        f"{trips['under_load']['round_trips_per_request']:.2f}"
                        if trips.get("under_load")
                        else fmt(trips.get("round_trips_per_request"), 2)
                    )
                    if trips
                    else "0 (no network)",
                    fmt(ops, 4),
                ]
            )
        server = http["server"]
        parts.append(
            f"HTTP (uvicorn, 1 worker, {server['loop']} + {server['http']}; "
            f"{http['load']['tool']}, {http['load']['connections']} connections; "
            "median of rounds)\n"
            + table(
                [
                    "store + limiter",
                    "bare req/s",
                    "auth req/s",
                    "ratio",
                    "p50 ms",
                    "p99 ms",
                    "round trips/req (seq. / load)",
                    "store ops/req",
                ],
                rows,
            )
        )
    peers = results.get("peers", {})
    if peers.get("results"):
        rows = [
            [
                r["name"],
                r["store"],
                r["hasher"].split(" (")[0],
                fmt(r["verify_per_s"]["median"]),
                fmt(r["us_per_verify"], 1),
            ]
            for r in peers["results"]
        ]
        parts.append(
            "Peers: verifications per second (median of rounds)\n"
            + table(["library", "store", "hasher", "verify/s", "us/verify"], rows, right=3)
        )
    growth = results.get("growth", {})
    if growth.get("results"):
        sizes = sorted({s["keys"] for r in growth["results"] for s in r["sizes"]})
        rows = []
        for r in growth["results"]:
            by_size = {s["keys"]: s for s in r["sizes"]}
            rows.append(
                [
                    r["store"],
                    *(
                        fmt(by_size[size]["us_per_verify"]["median"], 1) if size in by_size else "-"
                        for size in sizes
                    ),
                    fmt(r["largest_vs_smallest"], 2) + "x",
                ]
            )
        parts.append(
            "Growth: microseconds per verification\n"
            + table(["store", *(f"{size:,} keys" for size in sizes), "ratio"], rows)
        )
    overhead = results.get("overhead", {})
    if "added_us" in overhead:
        parts.append(
            f"Overhead (in-process ASGI, best round): bare {overhead['bare_us']:.2f} us, "
            f"with middleware {overhead['middleware_us']:.2f} us, "
            f"added {overhead['added_us']:.2f} us per request"
        )
    if output["aims"]:
        rows = [
            [
                aim["aim"],
                fmt(aim["value"], 2 if aim["value"] is not None and aim["value"] < 100 else 0),
                aim["target"],
                "-" if aim["met"] is None else "yes" if aim["met"] else "NO",
                aim["note"],
            ]
            for aim in output["aims"]
        ]
        parts.append("Aims\n" + table(["aim", "measured", "target", "met", "note"], rows, right=1))
    for name, result in results.items():
        if "error" in result:
            parts.append(f"section {name} FAILED: {result['error']}")
    return "\n\n".join(parts)


# --- the chart ----------------------------------------------------------------------------


def draw(data: dict[str, Any], path: Path) -> None:
    """A small PNG: HTTP ratio to bare, peers' verifications/s, growth. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), dpi=100)
    ax = axes[0]
    configs = [c for c in results.get("http", {}).get("configs", []) if "ratio_paired" in c]
    if configs:
        labels = [_label(c).replace(" + ", "\n+ ").replace(", ", "\n") for c in configs]
        values = [c["ratio_paired"]["median"] for c in configs]
        bars = ax.bar(labels, values, color="#3f51b5")
        ax.axhline(AIMS["http_memory_ratio"], color="#e53935", linestyle="--", linewidth=1)
        ax.text(
            len(values) - 0.5,
            AIMS["http_memory_ratio"] + 0.02,
            f"aim (memory) {AIMS['http_memory_ratio']}",
            color="#e53935",
            ha="right",
            fontsize=8,
        )
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
        ax.set_ylim(0, 1.1)
        ax.tick_params(axis="x", labelsize=8)
    ax.set_title("HTTP throughput with the middleware / bare", fontsize=10)
    ax = axes[1]
    peers = results.get("peers", {}).get("results", [])
    if peers:
        labels = [
            f"{r['library'].replace('djangorestframework-api-key', 'drf-api-key')}\n"
            f"{r['store'].split(' (')[0]}, {r['hasher'].split(' (')[0].split(':')[0]}"
            for r in peers
        ]
        values = [r["verify_per_s"]["median"] for r in peers]
        colors = ["#3f51b5" if r["library"] == "apikeys" else "#9e9e9e" for r in peers]
        bars = ax.barh(labels, values, color=colors)
        ax.set_xscale("log")
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=7, padding=2)
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlim(1, max(values) * 20)
    ax.set_title("Key verifications per second (log scale)", fontsize=10)
    ax = axes[2]
    for r in results.get("growth", {}).get("results", []):
        sizes = [s["keys"] for s in r["sizes"]]
        values = [s["us_per_verify"]["median"] for s in r["sizes"]]
        ax.plot(sizes, values, marker="o", label=r["store"])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys in the store", fontsize=8)
    ax.set_ylabel("microseconds per verification", fontsize=8)
    if results.get("growth", {}).get("results"):
        ax.legend(fontsize=8)
    ax.set_title("Verification time as the store grows", fontsize=10)
    m = data.get("machine", {})
    fig.suptitle(
        f"apikeys benchmarks, {m.get('date', '')}: {m.get('cpu', '')}, {m.get('cores', '?')} "
        f"cores, Python {m.get('python', '')}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def shown(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


# --- main ---------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--quick", action="store_true", help="shorter runs, 100,000 keys at most")
    parser.add_argument("--json", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--png", type=Path, default=RESULTS / "latest.png")
    parser.add_argument("--chart", nargs=2, metavar=("JSON", "PNG"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--report", type=Path, metavar="JSON", help="print the summary of a saved run again"
    )
    args = parser.parse_args()
    if args.chart:
        draw(json.loads(Path(args.chart[0]).read_text()), Path(args.chart[1]))
        return 0
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["aims"] = evaluate(saved["results"])
        m = saved["machine"]
        print(f"{m['date']}: {m['cpu']}, {m['cores']} cores, Python {m['python']}\n")
        print(summarise(saved))
        return 0
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections: {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.perf_counter()
    output: dict[str, Any] = {
        "machine": machine(),
        "git": git_state(),
        "quick": args.quick,
        "sections": only,
        "results": {},
        "aims": [],
    }
    m = output["machine"]
    print(
        f"apikeys benchmarks: {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
        f"load average {m['load_average_at_start']}",
        flush=True,
    )
    venv = None
    if {"http", "peers"} & set(only) or args.png:
        venv = ensure_bench_venv()
    if {"http", "revoke"} & set(only) and not ensure_wrk():
        print(
            f"{WRK_MISSING}; the HTTP load comes from an httpx loop instead, and revoke "
            "runs without load",
            flush=True,
        )
    try:
        with tempfile.TemporaryDirectory(prefix="apikeys-bench-") as tmp:
            for name in (section for section in SECTIONS if section in only):
                out = Path(tmp) / f"{name}.json"
                command = section_command(name, out, args.quick, venv)
                if command is None:
                    output["results"][name] = {"error": "the bench venv could not be made"}
                    continue
                output["results"][name] = run_section(name, command, out)
    except (KeyboardInterrupt, Interrupted):
        print("\ninterrupted: sections cleaned up; nothing written", flush=True)
        return 130
    output["aims"] = evaluate(output["results"])
    output["elapsed_s"] = round(time.perf_counter() - started, 1)
    print("\n" + "=" * 74 + "\nSummary\n")
    print(summarise(output))
    write_json(args.json, output)
    print(f"\nresults: {shown(args.json)}")
    if venv is not None:
        chart = subprocess.run(
            [str(venv), "-m", "benchmarks.bench", "--chart", str(args.json), str(args.png)],
            cwd=str(ROOT),
            check=False,
        )
        if chart.returncode == 0:
            print(f"chart: {shown(args.png)}")
    print(f"total: {output['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
