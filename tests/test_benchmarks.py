"""The benchmark scripts stay runnable.

`make bench` takes minutes and is not part of the suite, so what it starts is checked here
on a small scale: the app the HTTP servers import, and the in-process overhead script end to
end. Nothing here looks at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from uvicorn.importer import import_from_string

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT))


@pytest.mark.usefixtures("bench_path")
def test_the_http_servers_import_their_app(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import http_load

    factory = import_from_string(http_load.APP_TARGET)
    assert factory is http_load.build_app
    monkeypatch.setenv("BENCH_MODE", "bare")
    assert callable(factory())


@pytest.mark.usefixtures("bench_path")
def test_the_authenticated_http_app_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks import http_load
    from benchmarks._common import token_for

    from apikeys import APIKeyMiddleware

    monkeypatch.setenv("BENCH_MODE", "auth")
    monkeypatch.setenv("BENCH_STORE_URL", "memory://")
    monkeypatch.setenv("BENCH_TOKEN", token_for("httpsmoke001", "s" * 32))
    assert isinstance(http_load.build_app(), APIKeyMiddleware)


def test_the_overhead_script_runs() -> None:
    result = subprocess.run(
        [sys.executable, "benchmarks/overhead.py", "--rounds", "1", "--per-round", "50"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "added by the middleware" in result.stdout
