"""The fixtures a user writes: the app, built on the plugin's `apikeys_manager`.

`apikeys_manager`, `make_key` and `assert_problem` come from the apikeys pytest plugin,
which pytest loads by itself once `apikeys[testing]` is installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from app import create_app
from starlette.testclient import TestClient

from apikeys import APIKeyMiddleware, KeyManager


@pytest.fixture
def app(apikeys_manager: KeyManager) -> APIKeyMiddleware:
    return create_app(apikeys_manager)


@pytest.fixture
def client(app: APIKeyMiddleware) -> Iterator[TestClient]:
    with TestClient(app) as test_client:
        yield test_client
