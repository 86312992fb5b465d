"""The apikeys pytest plugin: fixtures for the test suite of an app that uses apikeys.

pytest loads it by itself once apikeys is installed (entry point `pytest11`); `-p
no:apikeys` turns it off. It imports neither hypothesis nor httpx nor pytest-asyncio.

- `apikeys_manager`: a `KeyManager` on a fresh in-memory store with a fixed test pepper,
  closed after the test. Build your app with it (override it in your `conftest.py` to
  test on another store or prefix; `make_key` follows).
- `make_key`: `await make_key(scopes=[…], full_access=…, rate_limit=…, status=…,
  workspace=…, name=…)` returns a `CreatedKey` in `apikeys_manager`, in the state asked
  for (`active`, `disabled`, `revoked` or `expired`); `make_key.sync(…)` in sync tests.
- `assert_problem`: `apikeys.testing.assert_problem(response, code, status=None)`.

In a hypothesis `@given` test, a function-scoped fixture lives across all the examples,
and hypothesis says so (`HealthCheck.function_scoped_fixture`). Keys piling up in one
manager are harmless: suppress that check, or build `KeyFactory(in_memory_manager())`
inside the test for a fresh store per example.

Every fixture is synchronous, on purpose: a sync fixture works in sync tests, in
pytest-asyncio's auto and strict modes and under anyio's plugin, with no async plugin at
all, and whatever the loop scope. The async work happens in the test: `make_key(...)`
returns a coroutine that the test awaits on its own event loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from apikeys.manager import KeyManager
from apikeys.testing.assertions import AssertProblem, assert_problem
from apikeys.testing.factory import KeyFactory, close_manager, in_memory_manager

__all__ = ["apikeys_manager", "assert_problem_fixture", "make_key"]


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


@pytest.fixture(name="assert_problem")
def assert_problem_fixture() -> AssertProblem:
    """`apikeys.testing.assert_problem(response, code, status=None)` as a fixture."""
    return assert_problem
