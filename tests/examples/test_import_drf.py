"""A djangorestframework-api-key project's keys, imported with `apikeys import`, are served
by the contacts service as they are: `Authorization: Bearer <old key>`."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.drf_databases import drf_database  # noqa: F401 - the `drf` fixture
from tests.examples.conftest import REPO, service_env, start_service, stop_service


@pytest.fixture
def served(
    tmp_path: Path, drf: tuple[str, dict[str, str]]
) -> Iterator[tuple[str, dict[str, str], str]]:
    """(base URL, {label: old key}, the import's output) of a service whose keys were
    imported from the drf-api-key database by the command line, before and while it runs."""
    url, keys = drf
    store_url = f"sqlite:///{tmp_path / 'apikeys.db'}"
    env = service_env(
        APIKEYS_STORE_URL=store_url, EXAMPLE_DATABASE_URL=f"sqlite:///{tmp_path / 'example.db'}"
    )
    log = tmp_path / "service.log"
    process, base_url = start_service(env, log)
    try:
        # Imported while the service runs: the keys work at once, without a restart.
        command = ["import", "--from", "drf-api-key", url, "--workspace", "acme"]
        done = subprocess.run(
            [sys.executable, "-m", "apikeys", *command, "--scope", "contacts:read,contacts:write"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        yield base_url, keys, done.stdout
    finally:
        stop_service(process, log)
    for key in keys.values():
        assert key not in log.read_text()


def test_if_drf_keys_imported_then_the_service_serves_them_with_old_key_strings(
    served: tuple[str, dict[str, str], str],
) -> None:
    base_url, keys, output = served
    assert f"Imported {len(keys)} key(s) into workspace 'acme'" in output

    def get(key: str, path: str = "/api/v1/contacts") -> httpx.Response:
        return httpx.get(f"{base_url}{path}", headers={"Authorization": f"Bearer {key}"})

    for label in ("active", "expiring", "pbkdf2_sha256", "argon2", "bcrypt_sha256"):
        first = get(keys[label])
        assert first.status_code == 200, (label, first.text)
        assert get(keys[label]).status_code == 200  # now checked against apikeys' own hash
    created = httpx.post(
        f"{base_url}/api/v1/contacts",
        headers={"Authorization": f"Bearer {keys['active']}"},
        json={"name": "Ada"},
    )
    assert created.status_code == 201, created.text
    refused = {
        "revoked": get(keys["revoked"]),
        "expired": get(keys["expired"]),
        "wrong": get(keys["active"][:-1] + ("A" if keys["active"][-1] != "A" else "B")),
        "unknown": get("Zz9Zz9Zz." + "x" * 32),
        "scope": get(keys["active"], "/api/v1/campaigns"),
    }
    codes = {name: (r.status_code, r.json()["code"]) for name, r in refused.items()}
    assert codes == {
        "revoked": (401, "key_revoked"),
        "expired": (401, "key_expired"),
        "wrong": (401, "invalid_api_key"),
        "unknown": (401, "invalid_api_key"),
        "scope": (403, "insufficient_scope"),
    }
