"""The `testing` extra installs what a test suite of a Starlette or FastAPI app imports."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import starlette.testclient

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _testing_extra() -> set[str]:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    return {re.split(r"[<>=!~;\[ ]", requirement)[0] for requirement in extras["testing"]}


def test_the_testing_extra_installs_the_client_starlettes_testclient_imports_first() -> None:
    # Starlette's TestClient imports httpx2 first, and warns (StarletteDeprecationWarning)
    # when it falls back on httpx: `pytest -W error` would fail at collection.
    source = Path(starlette.testclient.__file__).read_text()
    first = re.search(r"^\s+import (httpx\w*)(?: as httpx)?$", source, re.M)
    assert first is not None
    assert first.group(1) in _testing_extra()


def test_the_testing_extra_installs_what_the_docs_samples_use() -> None:
    assert {"hypothesis", "pytest", "pytest-asyncio", "httpx"} <= _testing_extra()
