"""The pytest plugin, as a user's suite sees it: loaded from the entry point, in every mode.

Each test writes a small user test suite and runs it with `pytester`, in process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from datetime import UTC, datetime

import pytest

from apikeys import Hasher, InvalidAPIKey, KeyDisabled, KeyExpired, KeyManager, KeyRevoked
from apikeys.keys import parse_key
from apikeys.testing import (
    TEST_PEPPER,
    KeyFactory,
    assert_rejects_bad_credentials,
    in_memory_manager,
)
from apikeys.testing.factory import close_manager, run_sync
from apikeys.types import Receive, Scope, Send

pytest_plugins = ["pytester"]

APP = """
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware


async def contacts(request: Request) -> PlainTextResponse:
    return PlainTextResponse("contacts")


def build_app(manager):
    inner = Starlette(routes=[Route("/api/contacts", contacts)])
    return APIKeyMiddleware(
        inner, manager=manager, scopes={"GET /api/contacts": "contacts:read"}, protect="/api/"
    )
"""

SYNC_TESTS = """
from starlette.testclient import TestClient

from apikeys.testing.factory import run_sync
from app import build_app


def test_sync_test_with_test_client(apikeys_manager, make_key, assert_problem):
    good = make_key.sync(scopes=["contacts:read"])
    revoked = make_key.sync(scopes=["contacts:read"], status="revoked")
    with TestClient(build_app(apikeys_manager)) as client:
        ok = client.get("/api/contacts", headers={"Authorization": f"Bearer {good.key}"})
        gone = client.get("/api/contacts", headers={"Authorization": f"Bearer {revoked.key}"})
    assert ok.status_code == 200
    assert_problem(gone, "key_revoked")


def test_each_test_gets_a_fresh_manager(apikeys_manager):
    assert run_sync(apikeys_manager.list()) == []
"""

ASYNC_TESTS = """
import httpx
import pytest

from apikeys.testing.factory import run_sync
from app import build_app

USED = {}


# MARKER
async def test_async_test_with_httpx(apikeys_manager, make_key, assert_problem):
    created = await make_key(scopes=["contacts:read"])
    expired = await make_key(scopes=["contacts:read"], status="expired")
    transport = httpx.ASGITransport(app=build_app(apikeys_manager))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        for _ in range(3):
            response = await client.get(
                "/api/contacts", headers={"Authorization": f"Bearer {created.key}"}
            )
            assert response.status_code == 200
        response = await client.get(
            "/api/contacts", headers={"Authorization": f"Bearer {expired.key}"}
        )
    assert_problem(response, "key_expired")
    USED["manager"], USED["id"] = apikeys_manager, created.record.id


def test_the_manager_was_closed_and_its_usage_written():
    manager = USED["manager"]
    stored = run_sync(manager.store.get(USED["id"]))
    assert stored.record.request_count == 3
"""

ANYIO_TESTS = """
import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
async def test_anyio_test(apikeys_manager, make_key):
    created = await make_key(full_access=True)
    assert (await apikeys_manager.verify(created.key)).id == created.record.id
"""

HYPOTHESIS_TESTS = """
from hypothesis import HealthCheck, given, settings

from apikeys.testing import assert_rejects_bad_credentials, strategies as ak
from app import build_app


# Keys piling up in one manager across examples is harmless: say so to hypothesis.
@settings(max_examples=20, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scopes=ak.scope_sets())
def test_strategies(scopes, make_key):
    created = make_key.sync(scopes=scopes)
    assert set(created.record.scopes) == set(scopes)


def test_rejects(apikeys_manager, make_key):
    key = make_key.sync(scopes=["contacts:read"]).key
    assert_rejects_bad_credentials(
        build_app(apikeys_manager), "/api/contacts", valid_key=key, max_examples=30
    )
"""


def ini(mode: str | None) -> str:
    lines = ["[pytest]", "filterwarnings =", "    error"]
    if mode is not None:
        lines += [f"asyncio_mode = {mode}", "asyncio_default_fixture_loop_scope = function"]
    return "\n".join(lines) + "\n"


def user_suite(pytester: pytest.Pytester, mode: str | None, **tests: str) -> None:
    pytester.makefile(".ini", pytest=ini(mode))
    pytester.makepyfile(app=APP, **{name: textwrap.dedent(code) for name, code in tests.items()})
    pytester.syspathinsert()


class TestModes:
    def test_auto_mode(self, pytester: pytest.Pytester) -> None:
        user_suite(
            pytester,
            "auto",
            test_sync=SYNC_TESTS,
            test_async=ASYNC_TESTS,
            test_hypothesis=HYPOTHESIS_TESTS,
        )
        pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=6)

    def test_strict_mode(self, pytester: pytest.Pytester) -> None:
        user_suite(
            pytester,
            "strict",
            test_sync=SYNC_TESTS,
            test_async=ASYNC_TESTS.replace("# MARKER", "@pytest.mark.asyncio"),
            test_anyio=ANYIO_TESTS,
        )
        pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=5)

    def test_async_tests_run_as_pasted_without_any_asyncio_setting(
        self, pytester: pytest.Pytester
    ) -> None:
        # No asyncio_mode, no loop scope, no marker: what a user pasting the README gets.
        user_suite(pytester, None, test_sync=SYNC_TESTS, test_async=ASYNC_TESTS)
        result = pytester.runpytest("-p", "no:randomly")
        # The async tests ran (none skipped), with no warning about the loop scope.
        result.assert_outcomes(passed=4, warnings=0)

    def test_without_pytest_asyncio(self, pytester: pytest.Pytester) -> None:
        user_suite(pytester, None, test_sync=SYNC_TESTS, test_anyio=ANYIO_TESTS)
        pytester.runpytest("-p", "no:asyncio").assert_outcomes(passed=3)

    def test_plugin_can_be_turned_off(self, pytester: pytest.Pytester) -> None:
        user_suite(pytester, None, test_sync=SYNC_TESTS)
        result = pytester.runpytest("-p", "no:apikeys", "-p", "no:asyncio")
        result.assert_outcomes(errors=2)
        result.stdout.fnmatch_lines(["*fixture 'apikeys_manager' not found*"])

    def test_fixtures_are_listed(self, pytester: pytest.Pytester) -> None:
        user_suite(pytester, None, test_sync=SYNC_TESTS)
        result = pytester.runpytest("--fixtures", "-p", "no:asyncio")
        result.stdout.fnmatch_lines(
            ["*apikeys_manager*", "*A `KeyManager` on a fresh in-memory store*"]
        )
        result.stdout.fnmatch_lines(["*make_key*"])
        result.stdout.fnmatch_lines(["*assert_problem*"])


def test_plugin_imports_without_hypothesis() -> None:
    code = (
        "import sys; sys.modules['hypothesis'] = None\n"
        "import apikeys.testing.plugin, apikeys.testing as t\n"
        "assert t.assert_problem and t.KeyFactory\n"
        "try:\n"
        "    t.strategies\n"
        "except ImportError:\n"
        "    print('lazy')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lazy"


class TestMakeKey:
    async def test_defaults_to_an_active_full_access_key(
        self, make_key: KeyFactory, apikeys_manager: KeyManager
    ) -> None:
        created = await make_key()
        record = await apikeys_manager.verify(created.key)
        assert record.access == "full"
        assert record.status == "active"
        assert record.workspace == "default"
        assert record.name.startswith("test key ")

    async def test_passes_everything_on(self, make_key: KeyFactory) -> None:
        created = await make_key(
            scopes=["b:read", "a:*"], rate_limit="3/second", workspace="acme", name="Zapier"
        )
        record = created.record
        assert record.scopes == ("a:*", "b:read")
        assert (record.access, record.rate_limit) == ("restricted", "3/second")
        assert (record.workspace, record.name) == ("acme", "Zapier")

    @pytest.mark.parametrize(
        ("status", "error"),
        [("disabled", KeyDisabled), ("revoked", KeyRevoked), ("expired", KeyExpired)],
    )
    async def test_every_status(
        self,
        make_key: KeyFactory,
        apikeys_manager: KeyManager,
        status: str,
        error: type[Exception],
    ) -> None:
        created = await make_key(scopes=["contacts:read"], status=status)  # type: ignore[arg-type]
        assert created.record.status == status
        assert (await apikeys_manager.get(created.record.id)).status == status
        with pytest.raises(error):
            await apikeys_manager.verify(created.key)
        # No second key: "expired" is not a roll.
        assert len(await apikeys_manager.list()) == 1

    async def test_expired_means_now(self, make_key: KeyFactory) -> None:
        created = await make_key(status="expired")
        expires_at = created.record.expires_at
        assert expires_at is not None
        assert expires_at <= datetime.now(UTC)

    def test_unknown_status_is_refused_before_anything_runs(self, make_key: KeyFactory) -> None:
        with pytest.raises(ValueError, match="status must be one of"):
            make_key(status="gone")  # type: ignore[arg-type, unused-coroutine]

    async def test_sync_works_inside_a_running_loop(
        self, make_key: KeyFactory, apikeys_manager: KeyManager
    ) -> None:
        created = make_key.sync(scopes=["contacts:read"])
        assert (await apikeys_manager.verify(created.key)).id == created.record.id

    async def test_the_manager_uses_the_test_pepper(self, apikeys_manager: KeyManager) -> None:
        created = await KeyFactory(apikeys_manager)()
        stored = await apikeys_manager.store.get(created.record.id)
        assert stored is not None
        secret = parse_key(created.key).secret
        assert Hasher(pepper=TEST_PEPPER).verify(secret, stored.secret_hash).ok
        assert (
            not Hasher(pepper="XbZDoDZ5s9swxJpGjo4cRReO8vebpbjlIThtYuHY0KE")
            .verify(secret, stored.secret_hash)
            .ok
        )


class TestClosing:
    """Closing writes usage even when the manager's usage task lives on another loop."""

    def used_on_a_loop(self, runner: asyncio.Runner) -> tuple[KeyManager, str]:
        manager = in_memory_manager()
        key = KeyFactory(manager).sync().key
        manager.usage_buffer.interval = 3600  # the task sleeps: it is pending when we close

        async def use() -> str:
            return (await manager.verify(key)).id

        return manager, runner.run(use())

    def test_loop_still_open(self) -> None:
        with asyncio.Runner() as runner:
            manager, key_id = self.used_on_a_loop(runner)
            close_manager(manager)
            stored = run_sync(manager.store.get(key_id))
            assert stored is not None
            assert stored.record.request_count == 1

    def test_loop_already_closed(self) -> None:
        with asyncio.Runner() as runner:
            manager, key_id = self.used_on_a_loop(runner)
        close_manager(manager)
        stored = run_sync(manager.store.get(key_id))
        assert stored is not None
        assert stored.record.request_count == 1

    def test_unknown_keys_stay_unknown(self) -> None:
        manager = in_memory_manager()
        elsewhere = in_memory_manager()
        try:
            key = KeyFactory(elsewhere).sync().key
            with pytest.raises(InvalidAPIKey):
                run_sync(manager.verify(key))
        finally:
            close_manager(elsewhere)
            close_manager(manager)


def test_sync_helpers_leave_the_threads_event_loop_alone(make_key: KeyFactory) -> None:
    """A loop pytest-asyncio keeps for a module or session must survive the sync helpers."""
    loop = asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        make_key.sync()
        assert_rejects_bad_credentials(refuse_all, "/api", max_examples=2)
        assert asyncio.get_event_loop_policy().get_event_loop() is loop
    finally:
        asyncio.set_event_loop(None)
        loop.close()


async def refuse_all(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 401, "headers": []})
    await send({"type": "http.response.body", "body": b""})
