"""Helpers shared by the benchmarks: the bench venv, servers, keys, timing and reporting.

Every benchmark script starts with the same three lines, which put the repository root on
`sys.path` in place of `benchmarks/`: run as a script, a file's own folder comes first on
`sys.path`, where a file of the benchmarks could shadow a module of the standard library.

The bench venv (`benchmarks/.venv`, made on first use) holds what the library does not depend
on: uvicorn with uvloop and httptools, the peer libraries (Django, djangorestframework-api-key,
keyshield), matplotlib and the profilers, next to an editable install of this repository.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
BENCH_VENV = BENCHMARKS / ".venv"

POSTGRES_URL = os.environ.get(
    "APIKEYS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("APIKEYS_TEST_REDIS_URL", "redis://127.0.0.1:6379/14")
PEPPER = "OEuWsc6Opwdt8VlRqIf7G87HikHzfh9P9T8KeOssC2o"
UNLIMITED = "1000000000/minute"
# Every Redis key, table and database a benchmark makes carries this, so cleanup finds it.
BENCH_TAG = "apikeys-bench"

BENCH_REQUIREMENTS = (
    f"-e {ROOT}[sql,postgres,redis]",
    "uvicorn[standard]>=0.30",
    "httpx>=0.27",
    "matplotlib>=3.8",
    "pyinstrument>=4.6",
    "py-spy>=0.3",
    "django>=4.2",
    "djangorestframework>=3.14",
    "djangorestframework-api-key==3.1.*",
    "keyshield[argon2,bcrypt]==2.0.1",
)


def run_id() -> str:
    """A short random id for the names of one run's tables, databases and Redis keys."""
    return uuid.uuid4().hex[:10]


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so a section's cleanup (`finally`) still runs."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, interrupt)


# --- the bench venv -----------------------------------------------------------------------


def venv_python(venv: Path = BENCH_VENV) -> Path:
    return venv / "bin" / "python"


def ensure_bench_venv(log: Any = print) -> Path | None:
    """The bench venv's python, made and filled on first use; None if that fails.

    Reinstalls when the requirement list or pyproject.toml changed since the last install.
    """
    python = venv_python()
    stamp = BENCH_VENV / ".bench-requirements"
    wanted = "\n".join(BENCH_REQUIREMENTS) + "\n"
    wanted += hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest() + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    log(f"setting up the bench venv in {BENCH_VENV.relative_to(ROOT)} (once; about a minute)")
    try:
        if not python.exists():
            # The interpreter the benchmarks run on, outside its own venv: same Python.
            base = getattr(sys, "_base_executable", sys.executable)
            subprocess.run([base, "-m", "venv", str(BENCH_VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        args: list[str] = []
        for requirement in BENCH_REQUIREMENTS:
            args.extend(requirement.split(" ", 1))
        subprocess.run([*pip, *args], check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        log(f"could not set up the bench venv: {exc}")
        return None
    stamp.write_text(wanted)
    return python


def python_has(python: Path | str, *modules: str) -> bool:
    """Whether `python` can import every one of `modules`."""
    code = "; ".join(f"import {module}" for module in modules) or "pass"
    result = subprocess.run(
        [str(python), "-c", code], capture_output=True, check=False, cwd=str(ROOT)
    )
    return result.returncode == 0


# --- raw ASGI -----------------------------------------------------------------------------


def asgi_caller(
    app: Any, headers: list[tuple[bytes, bytes]], path: str = "/api/v1/contacts"
) -> Callable[[], Awaitable[None]]:
    """One GET of `path` through `app` per call, on raw ASGI (no server, no client library).

    Any answer but a 200 stops the run.
    """
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
    }
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    async def call() -> None:
        await app(dict(scope), receive, send)
        answered = status.pop()
        if answered != 200:
            raise SystemExit(
                f"the benchmark request got {answered}: the numbers would mean nothing"
            )

    return call


# --- services -----------------------------------------------------------------------------


def reachable(url: str, default_port: int) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection(
            (parts.hostname or "127.0.0.1", parts.port or default_port), 1
        ):
            return True
    except OSError:
        return False


def postgres_reachable() -> bool:
    return reachable(POSTGRES_URL, 5432)


def redis_reachable() -> bool:
    return reachable(REDIS_URL, 6379)


def with_database(url: str, database: str) -> str:
    """`url` pointing at another database of the same server."""
    base, _, _ = url.rpartition("/")
    return f"{base}/{database}"


async def create_database(name: str) -> str:
    """Create a PostgreSQL database of the run's own; returns its URL."""
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(POSTGRES_URL, name)


async def drop_database(name: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(POSTGRES_URL)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


async def delete_redis_keys(pattern: str) -> int:
    """Delete every Redis key matching `pattern` (in batches); returns how many."""
    from redis.asyncio import Redis

    client = Redis.from_url(REDIS_URL)
    deleted = 0
    try:
        batch: list[bytes] = []
        async for name in client.scan_iter(match=pattern, count=5000):
            batch.append(name)
            if len(batch) >= 5000:
                deleted += await client.unlink(*batch)
                batch = []
        if batch:
            deleted += await client.unlink(*batch)
    finally:
        await client.aclose()
    return deleted


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), 0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def stop_process(process: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """Stop a process this run started: SIGTERM (a graceful shutdown), then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)


# --- keys ---------------------------------------------------------------------------------

_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_PAIRS = [a + b for a in _BASE62 for b in _BASE62]


def fast_ids(count: int) -> list[str]:
    """`count` distinct random 12-character base62 strings, quickly.

    For ids and secrets of the filler keys that fill a store to a million; the keys a
    benchmark verifies are made the usual way.
    """
    raw = os.urandom(9 * count)
    ids: set[str] = set()
    out: list[str] = []
    pairs, base = _PAIRS, 3844
    for index in range(count):
        value = int.from_bytes(raw[index * 9 : index * 9 + 9], "big")
        text = ""
        for _ in range(6):
            value, low = divmod(value, base)
            text += pairs[low]
        if text not in ids:
            ids.add(text)
            out.append(text)
    while len(out) < count:  # a collision in 62**12: practically never
        out.extend(fast_ids(count - len(out)))
    return out


def token_for(key_id: str, secret: str, prefix: str = "ak") -> str:
    """The full key `{prefix}_{id}_{secret}{checksum}` for a chosen id and secret."""
    from apikeys.keys import checksum

    body = f"{prefix}_{key_id}_{secret}"
    return body + checksum(body)


def bench_record(
    key_id: str, created_at: datetime | None = None, rate_limit: str | None = UNLIMITED
) -> Any:
    """The `KeyRecord` every benchmark key has: restricted to `contacts:read`, no expiry."""
    from apikeys.keys import mask
    from apikeys.types import KeyRecord

    return KeyRecord(
        id=key_id,
        name="bench",
        workspace="bench",
        prefix=mask("ak", key_id),
        access="restricted",
        scopes=("contacts:read",),
        state="active",
        rate_limit=rate_limit,
        created_at=created_at or datetime.now(UTC),
    )


# --- timing and numbers -------------------------------------------------------------------


def summary(values: Sequence[float], higher_is_better: bool = True) -> dict[str, float]:
    """Best, median and worst of a list of per-round measurements."""
    ordered = sorted(values, reverse=higher_is_better)
    return {
        "best": ordered[0],
        "median": statistics.median(ordered),
        "worst": ordered[-1],
        "rounds": len(ordered),
    }


def fmt(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}{suffix}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: int = 1) -> str:
    """A plain text table; columns from `right` on are right-aligned."""
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for index, cell in enumerate(row):
            widths[index] = max(widths[index], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for index, cell in enumerate(cells):
            if index >= right:
                parts.append(cell.rjust(widths[index]))
            else:
                parts.append(cell.ljust(widths[index]))
        return "  ".join(parts).rstrip()

    out = [line(headers), "  ".join("-" * width for width in widths)]
    out.extend(line(row) for row in text_rows)
    return "\n".join(out)


# --- the machine ---------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = [round(value, 2) for value in os.getloadavg()]
    except OSError:
        load = []
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "os": f"{platform.system()} {platform.release()}",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_at_start": load,
    }


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return None


def git_state() -> dict[str, Any]:
    """The commit measured, and whether the work tree had changes (which ones)."""
    git = shutil.which("git")
    if git is None:
        return {}

    def run(*args: str) -> str:
        result = subprocess.run(
            [git, *args], capture_output=True, text=True, check=False, cwd=str(ROOT)
        )
        return result.stdout.rstrip("\n")

    changed = [line[3:] for line in run("status", "--porcelain", "--", "src").splitlines()]
    return {"commit": run("rev-parse", "--short", "HEAD").strip(), "src_changes": changed}


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def sqlite_rates(ops: dict[str, Any]) -> str:
    """What SQLite's store ops/req is made of: a rate of statements over a rate of requests."""
    return (
        f"{ops['statements_per_second']:,.0f} statements/s ({ops['probes_per_second']:,.0f} of "
        f"them the cache channel's probes) at {ops['requests_per_second']:,.0f} requests/s; "
        f"key reads {ops['key_reads_per_request']:.4f}/request"
    )
