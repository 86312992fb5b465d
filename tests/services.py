"""Where the test suite finds PostgreSQL and Redis, and what it does when they are missing.

Off CI a test that needs a server it cannot reach is skipped with a reason that says how to
run it; with `APIKEYS_REQUIRE_SERVICES=1` (as `.ci/run` sets) it fails instead.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

import pytest

POSTGRES_URL = os.environ.get(
    "APIKEYS_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/13"
"""A Redis database of the suite's own (not db 0, where other software keeps its data)."""
REDIS_URL = os.environ.get("APIKEYS_TEST_REDIS_URL", DEFAULT_REDIS_URL)
REQUIRE_SERVICES = os.environ.get("APIKEYS_REQUIRE_SERVICES", "") not in ("", "0")


def reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), 1.0):
            return True
    except OSError:
        return False


def require(url: str, name: str, env_var: str) -> None:
    """Skip (or fail, when services are required) unless `url` accepts connections."""
    if reachable(url):
        return
    message = (
        f"{name} is not reachable at {urlsplit(url).netloc}; start it or point {env_var} "
        f"at one (bash .ci/run starts both PostgreSQL and Redis)"
    )
    if REQUIRE_SERVICES:
        pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
    pytest.skip(message)
