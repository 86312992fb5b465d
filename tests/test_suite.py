"""The suite itself: it cannot fail because the machine is slow, and it cleans up after itself.

A property test is about inputs, not speed: on a loaded machine one example may take a
second, and hypothesis's default 200 ms deadline would then fail a test that is right. The
suite loads a profile without deadlines (tests/conftest.py) and no test sets one of its own.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests import services

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _test_modules() -> list[str]:
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts) for path in TESTS.rglob("test_*.py")
    )


def test_the_suite_runs_hypothesis_without_deadlines() -> None:
    assert settings.default.deadline is None
    assert settings.get_profile("ci").deadline is None


def test_the_profile_can_be_chosen_with_hypothesis_profile() -> None:
    conftest = (TESTS / "conftest.py").read_text()
    assert 'os.environ.get("HYPOTHESIS_PROFILE", "ci")' in conftest
    assert os.environ.get("HYPOTHESIS_PROFILE", "ci") in {"ci", "dev"}
    assert settings.get_profile("dev").deadline is None


def test_no_test_sets_a_deadline_of_its_own() -> None:
    # `deadline=None` is allowed (and redundant); any other value can fail on a slow machine.
    offending = []
    for path in [*TESTS.rglob("*.py"), *(ROOT / "src" / "apikeys" / "testing").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.keyword)
                and node.arg == "deadline"
                and not (isinstance(node.value, ast.Constant) and node.value.value is None)
            ):
                offending.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not offending, offending


def test_every_property_test_runs_without_a_deadline() -> None:
    # The settings each `@given` test really runs with: its own `@settings` on top of the
    # profile, as hypothesis resolves them.
    checked = 0
    late = []
    for name in _test_modules():
        module = importlib.import_module(name)
        candidates = list(vars(module).values())
        for value in list(candidates):
            if isinstance(value, type):
                candidates.extend(vars(value).values())
        for value in candidates:
            inner = getattr(value, "hypothesis", None)
            if inner is None or not hasattr(inner, "inner_test"):
                continue
            chosen = getattr(value, "_hypothesis_internal_use_settings", settings.default)
            checked += 1
            if chosen.deadline is not None:
                late.append(f"{name}.{value.__qualname__}: deadline={chosen.deadline}")
    assert checked >= 20
    assert not late, late


# -- the table of stores: what runs on every store ----------------------------------------------


def test_a_test_that_cannot_reach_the_store_is_not_run_on_every_store() -> None:
    # `manager` repeats a test on each store of the table. A plain `def` test cannot await
    # the manager, so no store can change its outcome: it asks for `memory_manager` and runs
    # once (an argument refused before the store is asked is checked the same way).
    offending = []
    for path in TESTS.rglob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.name.startswith("test_")
                and "manager" in {argument.arg for argument in node.args.args}
            ):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not offending, offending


# -- Redis: the suite deletes what it writes ----------------------------------------------------

# Tests that once left keys behind: a store's keys and 24-hour usage-batch markers (a test
# that used a prefix without the `store` fixture; the servers of the multiprocess tests) and
# limiter counters outside any test prefix (`LIMITS:apikeys/…`, from apps built with a
# `limiter_url`).
LEFT_KEYS_ONCE = [
    "tests/test_manager.py::test_if_a_store_moves_to_a_new_event_loop_then_it_keeps_working[redis]",
    "tests/test_faults.py::test_if_only_the_redis_limiter_is_severed_then_503_and_back_after_restore",
    "tests/test_multiprocess.py::test_if_key_revoked_then_401_in_every_process[redis]",
    "tests/test_multiprocess.py::test_if_key_revoked_then_401_in_every_process[postgres]",
    "tests/test_cache_servers.py::test_if_a_process_is_frozen_across_a_revoke_then_it_admits_nothing_stale[redis]",
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis server of this test's own (so every key in it is one the suite made)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (bash .ci/run installs it)")
    port = _free_port()
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            if services.reachable(f"redis://127.0.0.1:{port}"):
                break
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/13"
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.postgres
def test_the_tests_that_write_redis_keys_leave_none_behind(private_redis: str) -> None:
    import redis

    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    env = {**os.environ, "APIKEYS_TEST_REDIS_URL": private_redis, "APIKEYS_REQUIRE_SERVICES": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *LEFT_KEYS_ONCE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = redis.Redis.from_url(private_redis, decode_responses=True)
    try:
        left = sorted(client.scan_iter(count=1000))
    finally:
        client.close()
    assert left == []


def test_the_session_fails_if_it_leaves_a_redis_key(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    services.require(services.REDIS_URL, "Redis", "APIKEYS_TEST_REDIS_URL")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(
        test_leak="""
import redis

from conftest import redis_prefix
from tests import services


def test_writes_a_key_and_forgets_it():
    client = redis.Redis.from_url(services.REDIS_URL)
    client.set(redis_prefix("leak") + ":k", "v", ex=600)
    client.close()
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the suite left 1 Redis keys in*(deleted now)*-leak-*"])


# -- the processes tests start find the project compiled ----------------------------------------


def test_the_session_compiles_the_project_once_and_removes_only_the_bytecode_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.bytecode import compiled

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 1\n")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "old.py").write_text("VALUE = 2\n")
    (tmp_path / "kept" / "__pycache__").mkdir()  # there before: someone else's
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    with compiled([tmp_path, tmp_path / "missing"]):
        written = sorted(path.name for path in (tmp_path / "pkg" / "__pycache__").iterdir())
        assert [name.split(".")[0] for name in written] == ["__init__", "mod"]
        assert list((tmp_path / "kept" / "__pycache__").iterdir())
    assert not (tmp_path / "pkg" / "__pycache__").exists()
    assert (tmp_path / "kept" / "__pycache__").is_dir()

    # An interpreter that writes bytecode itself needs none compiled ahead.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    with compiled([tmp_path]):
        assert not (tmp_path / "pkg" / "__pycache__").exists()


# -- make test runs the suite in one process per core ---------------------------------------


def test_make_test_runs_one_process_per_core_each_file_in_one_of_them() -> None:
    # The default: not what this run was given (`make test PYTEST_WORKERS=3` reaches this
    # process as the variable and, through make, in MAKEFLAGS).
    unset = {"PYTEST_WORKERS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    workers = subprocess.run(
        ["make", "-s", "-f", "-", "show"],
        input=(ROOT / "Makefile").read_text() + "\nshow:\n\t@echo $(PYTEST_WORKERS)\n",
        cwd=ROOT,
        env={name: value for name, value in os.environ.items() if name not in unset},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert workers == str(_nproc())
    makefile = (ROOT / "Makefile").read_text()
    assert "pytest -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)" in makefile
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "in one process per core of the machine (pytest-xdist;" in readme
    assert "`make test PYTEST_WORKERS=0` runs the suite in one process" in readme


def _nproc() -> int:
    return int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout)
