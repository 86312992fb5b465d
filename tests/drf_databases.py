"""Databases of a djangorestframework-api-key project, made by that package
(`tests/drf_project.py`, in a process of its own): the `drf` fixture, SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import services
from tests.conftest import _create_database, _drop_database

HERE = Path(__file__).resolve().parent

DRF_DATABASES = [
    pytest.param("sqlite", marks=pytest.mark.sqlite, id="drf-sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="drf-postgres"),
]


def make_drf_database(url: str) -> dict[str, Any]:
    """A djangorestframework-api-key database at `url`, made by that package."""
    done = subprocess.run(
        [sys.executable, str(HERE / "drf_project.py"), url],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    made: dict[str, Any] = json.loads(done.stdout)
    return made


def drf_accepts(url: str, keys: list[str]) -> list[bool]:
    """Whether the djangorestframework-api-key project at `url` accepts each of `keys`, as
    its own `APIKey.objects.is_valid` answers (in a process of its own)."""
    done = subprocess.run(
        [sys.executable, str(HERE / "drf_project.py"), url, "--check"],
        input=json.dumps(keys),
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answers: list[bool] = json.loads(done.stdout)
    return answers


@pytest.fixture(scope="module", params=DRF_DATABASES, name="drf")
def drf_database(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, str]]]:
    """(database URL, {label: key string}) of a drf-api-key project, SQLite or PostgreSQL."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('drf') / 'django.db'}"
        yield url, make_drf_database(url)["keys"]
        return
    services.require(services.POSTGRES_URL, "PostgreSQL", "APIKEYS_TEST_POSTGRES_URL")
    name = f"apikeys_drf_{uuid.uuid4().hex[:12]}"
    asyncio.run(_create_database(services.POSTGRES_URL, name))
    url = f"{services.POSTGRES_URL.rsplit('/', 1)[0]}/{name}"
    try:
        yield url, make_drf_database(url)["keys"]
    finally:
        asyncio.run(_drop_database(services.POSTGRES_URL, name))
