"""Helpers for the test suites of apps protected by apikeys: property-based first.

```python
# test_api.py: the pytest plugin is loaded by itself once apikeys[testing] is installed
from hypothesis import given
from apikeys.testing import assert_problem, assert_rejects_bad_credentials, strategies as ak

def test_bad_credentials_are_refused(app, make_key):        # app: built with apikeys_manager
    key = make_key.sync(scopes=["contacts:read"]).key
    assert_rejects_bad_credentials(app, "/api/v1/contacts", valid_key=key)

async def test_revoked_key(client, make_key):
    created = await make_key(scopes=["contacts:read"], status="revoked")
    headers = {"Authorization": f"Bearer {created.key}"}
    response = await client.get("/api/v1/contacts", headers=headers)
    assert_problem(response, "key_revoked")
```

- `strategies`: hypothesis strategies for keys (valid, unknown, wrong secret, damaged),
  hostile `Authorization` values, scopes, rate limits, identity ids and identity records.
- `assert_problem(response, code, status=None)`: the contract's problem+json response.
- `assert_rejects_bad_credentials(app, path, ...)` and its async twin: drive an ASGI app
  with hypothesis-generated bad credentials; fail if any gets through or causes a 5xx.
- `in_memory_manager()`, `KeyFactory`, `IdentityFactory`: what the `apikeys_manager`,
  `make_key` and `make_identity` fixtures of the pytest plugin (`apikeys.testing.plugin`)
  are made of.

`strategies` and the `assert_rejects_*` functions need hypothesis (`apikeys[testing]`);
they are imported on first use, so the rest works without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from apikeys.testing.assertions import CONTRACT_STATUS, AssertProblem, ResponseLike, assert_problem
from apikeys.testing.factory import TEST_PEPPER, IdentityFactory, KeyFactory, in_memory_manager

if TYPE_CHECKING:
    from apikeys.testing import strategies
    from apikeys.testing.rejects import (
        BadCredentials,
        assert_rejects_bad_credentials,
        async_assert_rejects_bad_credentials,
    )

__all__ = [
    "CONTRACT_STATUS",
    "TEST_PEPPER",
    "AssertProblem",
    "BadCredentials",
    "IdentityFactory",
    "KeyFactory",
    "ResponseLike",
    "assert_problem",
    "assert_rejects_bad_credentials",
    "async_assert_rejects_bad_credentials",
    "in_memory_manager",
    "strategies",
]

# Names whose modules import hypothesis: imported when first used.
_LAZY = {
    "strategies": ("apikeys.testing.strategies", None),
    "BadCredentials": ("apikeys.testing.rejects", "BadCredentials"),
    "assert_rejects_bad_credentials": ("apikeys.testing.rejects", "assert_rejects_bad_credentials"),
    "async_assert_rejects_bad_credentials": (
        "apikeys.testing.rejects",
        "async_assert_rejects_bad_credentials",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
