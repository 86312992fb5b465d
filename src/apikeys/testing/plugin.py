"""The apikeys pytest plugin: fixtures for the test suite of an app that uses apikeys.

pytest loads it by itself once apikeys is installed (entry point `pytest11`); `-p
no:apikeys` turns it off. It imports neither hypothesis nor httpx nor pytest-asyncio.

- `apikeys_manager`: a `KeyManager` on a fresh in-memory store with a fixed test pepper,
  closed after the test. Build your app with it (override it in your `conftest.py` to
  test on another store or prefix; `make_key` follows).
- `make_key`: `await make_key(scopes=[…], full_access=…, rate_limit=…, status=…,
  workspace=…, name=…)` returns a `CreatedKey` in `apikeys_manager`, in the state asked
  for (`active`, `disabled`, `revoked` or `expired`); `make_key.sync(…)` in sync tests.
- `make_identity`: `await make_identity(identity_id=None, workspace=…, rate_limit=…,
  credits=…, status=…)` returns an `IdentityRecord` in `apikeys_manager` (`active`, `disabled` or
  `revoked`), for keys to belong to: `await make_key(identity=identity.id)`;
  `make_identity.sync(…)` in sync tests.
- `assert_problem`: `apikeys.testing.assert_problem(response, code, status=None)`.

In a hypothesis `@given` test, a function-scoped fixture lives across all the examples,
and hypothesis says so (`HealthCheck.function_scoped_fixture`). Keys piling up in one
manager are harmless: suppress that check, or build `KeyFactory(in_memory_manager())`
inside the test for a fresh store per example.

Every fixture is synchronous, on purpose: a sync fixture works in sync tests, in
pytest-asyncio's auto and strict modes and under anyio's plugin, with no async plugin at
all, and whatever the loop scope. The async work happens in the test: `make_key(...)`
returns a coroutine that the test awaits on its own event loop.

An `async def` test that asks for one of these fixtures and has no async marker of its
own is marked `pytest.mark.asyncio` when pytest-asyncio is installed, so that it runs as
written in pytest-asyncio's default (strict) mode, without `asyncio_mode = "auto"`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest

from apikeys.manager import KeyManager
from apikeys.testing.assertions import AssertProblem, assert_problem
from apikeys.testing.factory import (
    IdentityFactory,
    KeyFactory,
    close_manager,
    in_memory_manager,
)

__all__ = [
    "apikeys_manager",
    "assert_problem_fixture",
    "make_identity",
    "make_key",
    "pytest_configure",
    "pytest_pycollect_makeitem",
]

_FIXTURES = frozenset({"apikeys_manager", "make_key", "make_identity", "assert_problem"})
_ASYNC_MARKERS = frozenset({"asyncio", "anyio", "trio"})


def pytest_configure(config: pytest.Config) -> None:
    """Give pytest-asyncio's fixture loop scope a value, unless the project set one.

    pytest-asyncio warns on every run while `asyncio_default_fixture_loop_scope` is unset;
    the scope it would pick, `function`, is the one these fixtures are written for.
    """
    if not config.pluginmanager.hasplugin("asyncio"):
        return
    try:
        current = config.getini("asyncio_default_fixture_loop_scope")
    except ValueError:  # a pytest-asyncio without that setting
        return
    if not current:
        config._inicache["asyncio_default_fixture_loop_scope"] = "function"


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any) -> None:
    """Mark `async def` tests that use these fixtures for pytest-asyncio (see the doc)."""
    if not inspect.iscoroutinefunction(obj) or not name.startswith("test"):
        return
    config = collector.config
    if not config.pluginmanager.hasplugin("asyncio"):
        return
    try:
        if config.getini("asyncio_mode") == "auto":
            return
    except ValueError:
        return
    marks = {mark.name for mark in getattr(obj, "pytestmark", [])}
    if marks & _ASYNC_MARKERS:
        return
    if _FIXTURES & set(inspect.signature(obj).parameters):
        pytest.mark.asyncio(obj)


@pytest.fixture
def apikeys_manager() -> Iterator[KeyManager]:
    """A `KeyManager` on a fresh in-memory store (test pepper), closed after the test."""
    manager = in_memory_manager()
    try:
        yield manager
    finally:
        close_manager(manager)


@pytest.fixture
def make_key(apikeys_manager: KeyManager) -> KeyFactory:
    """`await make_key(scopes=…, status=…)`: a `CreatedKey` in `apikeys_manager`."""
    return KeyFactory(apikeys_manager)


@pytest.fixture
def make_identity(apikeys_manager: KeyManager) -> IdentityFactory:
    """`await make_identity(rate_limit=…, status=…)`: an `IdentityRecord` in
    `apikeys_manager`."""
    return IdentityFactory(apikeys_manager)


@pytest.fixture(name="assert_problem")
def assert_problem_fixture() -> AssertProblem:
    """`apikeys.testing.assert_problem(response, code, status=None)` as a fixture."""
    return assert_problem
