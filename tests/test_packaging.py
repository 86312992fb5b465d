"""The package as a user gets it: a wheel and an sdist that `twine check` accepts, installed
into an empty venv, running the README's first screen exactly as written."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return out


@pytest.fixture(scope="module")
def venv(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty venv with the wheel installed as the README's install line says."""
    where = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    [wheel] = dist.glob("*.whl")
    line = re.search(r"^pip install '\.\[sql\]' uvicorn", README, flags=re.M)
    assert line, "the README's first install line changed: update this test"
    subprocess.run(
        [str(where / "bin" / "pip"), "install", "--quiet", f"{wheel}[sql]", "uvicorn"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return where


def test_the_wheel_and_sdist_pass_twine_check(dist: Path) -> None:
    files = sorted(dist.iterdir())
    assert {f.suffix for f in files} == {".gz", ".whl"}
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "zipfile", "-l", str(next(dist.glob("*.whl")))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "apikeys/py.typed" in listing
    assert "LICENSE" in listing
    # The Redis store's scripts are read from the package at run time.
    scripts = ROOT / "src" / "apikeys" / "stores" / "redis" / "scripts"
    for script in scripts.glob("*.lua"):
        assert f"apikeys/stores/redis/scripts/{script.name}" in listing


def test_the_readme_first_screen_runs_as_written_in_an_empty_venv(
    venv: Path, tmp_path: Path
) -> None:
    app_code = re.search(r"```python\n(.*?)```", README, flags=re.S)
    shell = re.search(r"Save the first as `app.py`.*?```shell\n(.*?)```", README, flags=re.S)
    assert app_code
    assert shell
    (tmp_path / "app.py").write_text(app_code.group(1))
    lines = shell.group(1).strip().splitlines()
    assert lines[0].startswith("export APIKEYS_PEPPER=")
    assert lines[1].startswith("python -c ")
    assert shlex.split(lines[2], comments=True) == ["uvicorn", "app:app"]
    env = {
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
    }
    # The pepper and the key, by the README's own two lines, in one shell.
    issued = subprocess.run(
        ["bash", "-c", f'{lines[0]}\necho "$APIKEYS_PEPPER"\n{lines[1]}'],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert issued.returncode == 0, issued.stderr
    pepper, key = issued.stdout.split()
    assert key.startswith("ak_live_")
    port = _free_port()
    log = (tmp_path / "uvicorn.log").open("wb")
    server = subprocess.Popen(
        [*shlex.split(lines[2], comments=True), "--port", str(port)],
        cwd=tmp_path,
        env={**env, "APIKEYS_PEPPER": pepper},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}/api/v1/contacts"
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, (tmp_path / "uvicorn.log").read_text()
                time.sleep(0.2)
        assert response.status_code == 200, response.text
        assert response.json() == {"workspace": "default", "data": []}
        assert httpx.get(url).status_code == 401
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl+C, as the README says
        server.wait(30)
        log.close()
    # The count was written when uvicorn stopped.
    count = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import asyncio, app\n"
            f"print(asyncio.run(app.manager.get({key.split('_')[2]!r})).request_count)",
        ],
        cwd=tmp_path,
        env={**env, "APIKEYS_PEPPER": pepper},
        capture_output=True,
        text=True,
        check=True,
    )
    assert count.stdout.strip() == "1"


def test_the_wheel_serves_the_mounted_settings_page(venv: Path, dist: Path, tmp_path: Path) -> None:
    """`pip install 'apikeys[ui]'` brings the page's templates and static files."""
    [wheel] = dist.glob("*.whl")
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", f"{wheel}[sql,ui]"],
        check=True,
        capture_output=True,
        timeout=600,
    )
    docs = (ROOT / "docs" / "settings-page.md").read_text()
    sample = re.search(r"<!-- file: keys_app.py -->\n```python\n(.*?)```", docs, flags=re.S)
    assert sample, "docs/settings-page.md lost its keys_app.py sample: update this test"
    (tmp_path / "keys_app.py").write_text(sample.group(1))
    # A stand-in for the application's own login: it puts a user id in the session.
    (tmp_path / "served.py").write_text(
        "from starlette.responses import RedirectResponse\n"
        "from starlette.routing import Route\n"
        "from keys_app import app\n\n"
        "async def login(request):\n"
        "    request.session['user_id'] = 'ops'\n"
        "    return RedirectResponse(request.query_params['next'], status_code=303)\n\n"
        "app.router.routes.append(Route('/login', login))\n"
    )
    port = _free_port()
    env = {"PATH": f"{venv / 'bin'}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    log = (tmp_path / "uvicorn.log").open("wb")
    server = subprocess.Popen(
        ["uvicorn", "served:app", "--port", str(port)],
        cwd=tmp_path,
        env={**env, "APIKEYS_PEPPER": "7fYpC_VkrZqsx7prdeokxy0Wxe3ZzNiOn7SeT0zcW3Q"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=base, follow_redirects=True, timeout=10) as http:
            while True:
                try:
                    page = http.get("/settings/api-keys/")
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline, (tmp_path / "uvicorn.log").read_text()
                    time.sleep(0.2)
            assert page.status_code == 200, page.text
            assert "<h1>API keys</h1>" in page.text
            assert "ops@acme.example" in page.text
            assert http.get("/settings/api-keys/static/app.css").status_code == 200
            token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
            assert token
            created = http.post(
                "/settings/api-keys/",
                data={"csrf_token": token.group(1), "name": "From the wheel", "access": "full"},
            )
            assert created.status_code == 200
            assert re.search(
                r'id="new-key-value"[^>]*value="ak_live_[0-9A-Za-z_]{51}"', created.text
            )
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
        log.close()


@pytest.mark.parametrize("missing", ["jinja2", "itsdangerous"])
def test_without_the_ui_extra_the_settings_page_names_it(missing: str) -> None:
    code = f"import sys; sys.modules[{missing!r}] = None\nimport apikeys.ui\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode != 0
    assert "pip install 'apikeys[ui]'" in result.stderr
