"""Every Python sample in the README runs as written."""

from __future__ import annotations

import re
import runpy
import shlex
from pathlib import Path

import httpx
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


pytest_plugins = ["pytester"]

MYAPP = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from apikeys import APIKeyMiddleware


async def contacts(request):
    return JSONResponse({"data": []})


def create_app(manager):
    return APIKeyMiddleware(
        Starlette(routes=[Route("/api/v1/contacts", contacts)]),
        manager=manager,
        scopes={"GET /api/v1/contacts": "contacts:read"},
        protect="/api/",
    )
"""


def test_readme_has_the_samples_this_test_runs() -> None:
    assert len(BLOCKS) == 4


def test_the_first_screen_shows_the_middleware_and_the_fastapi_dependency() -> None:
    # A FastAPI team reading the first screen sees the dependency beside the middleware.
    first_screen = "\n".join(README.read_text().splitlines()[:70])
    assert BLOCKS[0] in first_screen
    assert BLOCKS[1] in first_screen
    assert "APIKeyMiddleware(" in BLOCKS[0]
    assert "Security(api_key" in BLOCKS[1]
    assert "APIKeySecurity(" in BLOCKS[1]
    assert "uvicorn fastapi_app:app" in first_screen


async def test_if_readme_fastapi_app_served_then_a_key_with_the_scope_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "fastapi_app.py").write_text(BLOCKS[1])
    namespace = runpy.run_path(str(tmp_path / "fastapi_app.py"))
    manager, app = namespace["manager"], namespace["app"]
    async with manager:
        created = await manager.create(name="me", scopes=["contacts:read"])
        other = await manager.create(name="other", scopes=["campaigns:read"])
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.get(
                "/api/v1/contacts", headers={"Authorization": f"Bearer {created.key}"}
            )
            lacking = await client.get(
                "/api/v1/contacts", headers={"Authorization": f"Bearer {other.key}"}
            )
            refused = await client.get("/api/v1/contacts")
    assert response.status_code == 200
    assert response.json() == {"workspace": "default", "data": []}
    assert lacking.status_code == 403
    assert lacking.json()["code"] == "insufficient_scope"
    assert refused.status_code == 401
    assert refused.headers["content-type"] == "application/problem+json"


async def test_if_readme_app_served_then_key_from_readme_command_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "app.py").write_text(BLOCKS[0])
    namespace = runpy.run_path(str(tmp_path / "app.py"))
    manager, app = namespace["manager"], namespace["app"]
    created = await manager.create(name="me", scopes=["contacts:read"])
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.get(
            "/api/v1/contacts", headers={"Authorization": f"Bearer {created.key}"}
        )
        refused = await client.get("/api/v1/contacts")
    assert response.status_code == 200
    assert response.json() == {"workspace": "default", "data": []}
    assert refused.status_code == 401
    await manager.aclose()
    assert (tmp_path / "apikeys.db").exists()


def test_if_readme_management_sample_runs_then_it_prints_the_states(
    capsys: pytest.CaptureFixture[str],
) -> None:
    exec(compile(BLOCKS[2], "README.md", "exec"), {"__name__": "__main__"})  # noqa: S102
    lines = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"ak_live_\w{12}_\w{38}", lines[0])
    assert lines[1] == "['active', 'revoked']"


def test_if_readme_testing_sample_runs_with_the_plugin_then_it_passes(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(myapp=MYAPP, test_readme_sample=BLOCKS[3])
    pytester.makeini("[pytest]\nasyncio_mode = auto\n")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


_PIP_INSTALL = re.compile(r"pip install ([^`#\n]*)")


def test_the_pip_lines_install_the_clone_whatever_its_directory_is_named() -> None:
    # The lines are run in the clone (the directory README.md is in), whatever its name:
    # `./apikeys[sql]` only worked from the parent of a clone named `apikeys`.
    root = README.parent
    targets = [
        word
        for command in _PIP_INSTALL.findall(README.read_text())
        for word in shlex.split(command)
        if "[" in word
    ]
    assert len(targets) >= 3, targets
    for word in targets:
        path = word.split("[", 1)[0]
        if path.endswith(".whl"):  # built in the clone by `python -m build`
            assert path.startswith("dist/"), word
            continue
        assert (root / path).resolve() == root, word
        assert 'name = "apikeys"' in (root / path / "pyproject.toml").read_text()
