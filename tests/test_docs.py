"""The documentation in docs/ runs as written, and the site builds with `mkdocs build --strict`.

Conventions for the Markdown pages:

- Each ```python block runs alone, as a reader pastes it: in a namespace of its own, in a
  fresh temporary working directory (SQLite files land there), with `APIKEYS_PEPPER` set.
  So every sample has its own imports and makes what it uses.
- `<!-- file: NAME -->` on the line before a block: the reader saves the block as NAME, so
  it is written to NAME in that directory instead of being run; later blocks import it.
- `<!-- not-run: reason -->` on the line before a block: compiled but not run. Only for
  samples that need a live server or a package apikeys does not depend on.
- `<!-- server: COMMAND -->` on the line before a shell block: the block talks to the app
  COMMAND serves (`python -m uvicorn …`, which the block shows the reader too). The test
  starts it, on a free port, in the page's directory (its files saved there, the repository
  importable), then runs every line of the block, curl and `python file.py` included, in
  one shell: `127.0.0.1:8000` in the block and in the page's files is that port.

Shell blocks: every `apikeys …` command in them must parse with the real command line, and
each page's `apikeys …` lines and variable assignments run, in page order, in one shell in a
fresh directory (with empty `src/`, `config/` and `logs/`): an id a command uses comes from
a command run earlier on the page (`ID=$(echo "$KEY" | cut -d_ -f3)`), never an example id.
Lines of other programs (curl, uvicorn, pip, git) are left to the reader, and so is a block
after `<!-- not-run: reason -->` (one that reads another system's database). The
problem+json bodies of the HTTP error reference must be the ones the code sends.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from apikeys import errors
from apikeys.cli import main
from apikeys.keys import (
    BASE62,
    MalformedAPIKey,
    ParsedKey,
    checksum,
    generate_key,
    parse_key,
    parse_key_of,
)
from apikeys.problems import problem_body

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
PEPPER = "A-fCCRkLiznK5jeQtf4uP3mlDGQQ8xKyS9-qOdLRQ-4"

_FENCE = re.compile(r"^```(\w*)\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*(file|not-run|server):\s*(.+?)\s*-->$")


@dataclass(frozen=True)
class Block:
    page: Path
    language: str
    line: int
    """Line number of the block's first line of code in the page (1-based)."""
    code: str
    directive: str | None = None
    argument: str | None = None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, with the directive comment before each, if any."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        start = index + 1
        end = start
        while end < len(lines) and lines[end] != "```":
            end += 1
        assert end < len(lines), f"{page}:{index + 1}: unclosed code fence"
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        directive = _DIRECTIVE.match(previous.strip())
        found.append(
            Block(
                page=page,
                language=match.group(1),
                line=start + 1,
                code="\n".join(lines[start:end]) + "\n",
                directive=directive.group(1) if directive else None,
                argument=directive.group(2) if directive else None,
            )
        )
        index = end + 1
    return found


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


PYTHON_PAGES = [page for page in PAGES if any(b.language == "python" for b in blocks(page))]


def test_the_docs_have_pages_and_samples() -> None:
    assert (DOCS / "index.md") in PAGES
    assert len(PYTHON_PAGES) >= 10


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_code_fence_is_indented(page: Path) -> None:
    # An indented fence (in an admonition or a list) would escape the checks below.
    indented = [
        number
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        if re.match(r"^\s+```", line)
    ]
    assert not indented, f"{page_id(page)}: indented code fences on lines {indented}"


# -- Python samples ---------------------------------------------------------------------------


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")


async def _exercise_index(namespace: dict[str, Any]) -> None:
    """The home page's app answers 200 with a key that has the scope, 401 without one."""
    manager, app = namespace["manager"], namespace["app"]
    created = await manager.create(name="docs", scopes=["contacts:read"])
    async with _client(app) as client:
        allowed = await client.get(
            "/api/v1/contacts", headers={"Authorization": f"Bearer {created.key}"}
        )
        refused = await client.get("/api/v1/contacts")
    await manager.aclose()
    assert allowed.status_code == 200
    assert allowed.json() == {"workspace": "default", "data": []}
    assert refused.status_code == 401


# Pages whose apps the page itself does not call: the test calls them after the page ran.
EXERCISES: dict[str, Callable[[dict[str, Any]], Coroutine[Any, Any, None]]] = {
    "index.md": _exercise_index,
}


@pytest.fixture
def docs_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temporary working directory on `sys.path`, the pepper set, no other settings."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("APIKEYS_PEPPER", PEPPER)
    for name in ("APIKEYS_RATE_LIMIT", "APIKEYS_STORE_URL", "APIKEYS_LIMITER_URL"):
        monkeypatch.delenv(name, raising=False)
    before = set(sys.modules)
    try:
        yield tmp_path
    finally:
        # Forget the modules the page's files defined, so the next page starts afresh.
        for name in set(sys.modules) - before:
            module_file = getattr(sys.modules[name], "__file__", None) or ""
            if module_file.startswith(str(tmp_path)):
                del sys.modules[name]


# Every sample a reader may paste: each runs alone, in a fresh namespace and directory.
SAMPLES = [
    block
    for page in PYTHON_PAGES
    for block in blocks(page)
    if block.language == "python" and block.directive is None
]


@pytest.mark.parametrize("block", SAMPLES, ids=lambda block: block.where)
def test_every_python_sample_runs_alone_as_pasted(block: Block, docs_env: Path) -> None:
    # The files the page asked the reader to save before this sample are there; nothing
    # else is: no name another sample defined, no database another sample filled.
    for earlier in blocks(block.page):
        if earlier.line >= block.line:
            break
        if earlier.language == "python" and earlier.directive == "file":
            assert earlier.argument is not None
            (docs_env / earlier.argument).write_text(earlier.code)
    importlib.invalidate_caches()
    namespace: dict[str, Any] = {"__name__": "__main__"}
    # Padding keeps the page's line numbers in tracebacks.
    source = "\n" * (block.line - 1) + block.code
    exec(compile(source, str(block.page), "exec"), namespace)  # noqa: S102 - the point
    exercise = EXERCISES.get(page_id(block.page))
    if exercise is not None and "app" in namespace and "manager" in namespace:
        asyncio.run(exercise(namespace))


def test_every_exercised_page_has_a_sample_that_makes_the_app_and_its_manager() -> None:
    for name in EXERCISES:
        assert any(
            "\napp = " in block.code and "\nmanager = " in block.code
            for block in SAMPLES
            if page_id(block.page) == name
        ), name


def test_not_run_samples_are_rare() -> None:
    skipped = [
        block.where
        for page in PAGES
        for block in blocks(page)
        if block.language == "python" and block.directive == "not-run"
    ]
    assert len(skipped) <= 5, skipped


def test_file_samples_are_used_by_a_later_sample() -> None:
    for page in PAGES:
        page_blocks = blocks(page)
        for position, block in enumerate(page_blocks):
            if block.language != "python" or block.directive != "file":
                continue
            assert block.argument is not None
            module = block.argument.removesuffix(".py")
            later = "".join(b.code for b in page_blocks[position + 1 :])
            # Imported by a later sample or file, or run by name (`pytest test_app.py`,
            # `python manage.py` in a served shell block).
            used = (
                f"from {module} import",
                f"import {module}",
                f'"{block.argument}"',
                f"python {block.argument}",
            )
            assert any(use in later for use in used), (
                f"{block.where}: nothing on the page runs {block.argument}"
            )


# -- shell samples -----------------------------------------------------------------------------

_SHELL = {"shell", "bash", "console", "sh"}
_SUBSTITUTION = re.compile(r"\$\((apikeys [^)|]*)")


def apikeys_commands() -> list[tuple[str, str]]:
    """Every `apikeys …` command line in the shell blocks, with where it is."""
    commands: list[tuple[str, str]] = []
    for page in PAGES:
        for block in blocks(page):
            if block.language not in _SHELL:
                continue
            for offset, raw in enumerate(block.code.splitlines()):
                line = raw.removeprefix("$ ").strip()
                where = f"{page_id(page)}:{block.line + offset}"
                commands.extend((where, found) for found in _SUBSTITUTION.findall(line))
                for part in re.split(r"\s*(?:;|&&|\|\|?)\s*", line):
                    if part.startswith("apikeys "):
                        commands.append((where, part))
    return commands


def _parse(command: str) -> tuple[int, str]:
    """Parse `command` with the real `apikeys` command line, without running it.

    `--help` is appended: click parses every option first (refusing unknown ones), then
    answers the eager `--help` and exits 0 before any callback touches a store.
    """
    words = shlex.split(command, comments=True)[1:]
    words = [re.sub(r"^<.*>$", "3xK9pQ2mZ7aB", word) for word in words]
    result = CliRunner().invoke(main, [*words, "--help"], prog_name="apikeys")
    return result.exit_code, result.output


APIKEYS_COMMANDS = apikeys_commands()


def test_the_docs_show_every_command() -> None:
    shown = {shlex.split(command, comments=True)[1] for _, command in APIKEYS_COMMANDS}
    assert shown >= set(main.commands), sorted(set(main.commands) - shown)


@pytest.mark.parametrize(("where", "command"), APIKEYS_COMMANDS, ids=lambda value: value)
def test_apikeys_commands_in_the_docs_parse(where: str, command: str) -> None:
    exit_code, output = _parse(command)
    assert exit_code == 0, f"{where}: `{command}`:\n{output}"


def test_every_option_of_the_command_line_is_documented() -> None:
    reference = (DOCS / "cli.md").read_text()
    missing = [
        f"{name} {option}"
        for name, command in [("apikeys", main), *main.commands.items()]
        for param in command.params
        for option in param.opts
        if option.startswith("--") and f"`{option}" not in reference
    ]
    assert not missing, missing


# -- shell samples, run --------------------------------------------------------------------------

# What the shell test runs of a page: `apikeys …` lines and variable assignments (which may
# call apikeys), in page order, in one shell. The rest (curl, uvicorn, pip, git, make)
# needs a server, a network or a clone, and is left to the reader.
_RUN_LINE = re.compile(r"^(?:apikeys\s|(?:export\s+)?[A-Z_][A-Z0-9_]*=)")


def shell_script(page: Path) -> list[tuple[int, str]]:
    """The lines of `page`'s shell blocks the shell test runs, with their line numbers."""
    found: list[tuple[int, str]] = []
    for block in blocks(page):
        if block.language not in _SHELL or block.directive in ("not-run", "server"):
            continue
        lines = block.code.replace("\\\n", " ").splitlines()
        for offset, raw in enumerate(lines):
            line = raw.removeprefix("$ ").strip()
            if _RUN_LINE.match(line):
                found.append((block.line + offset, line))
    return found


SHELL_PAGES = [page for page in PAGES if shell_script(page)]


@pytest.mark.slow
@pytest.mark.parametrize("page", SHELL_PAGES, ids=page_id)
def test_the_shell_samples_of_a_page_run_in_order(page: Path, tmp_path: Path) -> None:
    # One shell per page, in a fresh directory and store, as a reader who types the page's
    # commands in order: an id a command uses comes from a command run before it.
    for directory in ("src", "config", "logs"):  # what the scan samples scan in a project
        (tmp_path / directory).mkdir()
    script = ["set -eo pipefail"]
    for number, line in shell_script(page):
        script.append(f"echo '>>> {page_id(page)}:{number}' >&2")
        script.append(line)
    env = {**_clean_env(), "APIKEYS_PEPPER": PEPPER}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    failed = result.stderr.rsplit(">>> ", 1)[-1]
    assert result.returncode == 0, f"{failed}\n(exit {result.returncode})"


def test_shell_samples_left_to_the_reader_are_rare() -> None:
    skipped = [
        block.where
        for page in PAGES
        for block in blocks(page)
        if block.language in _SHELL and block.directive == "not-run"
    ]
    assert len(skipped) <= 3, skipped


# -- shell samples against a served app ----------------------------------------------------------

SERVED = [
    block
    for page in PAGES
    for block in blocks(page)
    if block.language in _SHELL and block.directive == "server"
]
_SAMPLE_ADDRESS = "127.0.0.1:8000"


def _start_server(command: str, directory: Path, env: dict[str, str]) -> tuple[Any, str]:
    """`command` (`python -m uvicorn …`) serving on a free port from `directory`: the
    process and the address it answers at, once it answers."""
    from tests.examples.conftest import free_port

    port = free_port()
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "uvicorn"], command
    log = (directory / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, *words[1:], "--host", "127.0.0.1", "--port", str(port)],
        cwd=directory,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    address = f"127.0.0.1:{port}"
    for _ in range(300):
        if process.poll() is not None:
            break
        try:
            httpx.get(f"http://{address}/", timeout=1)
        except httpx.TransportError:
            time.sleep(0.1)
            continue
        return process, address
    process.kill()
    process.wait()
    pytest.fail(f"{command} did not start:\n{(directory / 'server.log').read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("block", SERVED, ids=lambda block: block.where)
def test_a_served_shell_sample_runs_against_its_server(block: Block, tmp_path: Path) -> None:
    command = block.argument
    assert command is not None
    # The reader is shown how to start it, in the block itself.
    assert command in block.code, f"{block.where}: the block does not show `{command}`"
    env = {**_clean_env(), "APIKEYS_PEPPER": PEPPER}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    process, address = _start_server(command, tmp_path, env)
    try:
        for earlier in blocks(block.page):
            if earlier.directive == "file" and earlier.argument is not None:
                code = earlier.code.replace(_SAMPLE_ADDRESS, address)
                (tmp_path / earlier.argument).write_text(code)
        script = block.code.replace(_SAMPLE_ADDRESS, address)
        result = subprocess.run(
            ["bash", "-c", "set -eo pipefail\n" + script],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        process.terminate()
        process.wait(timeout=15)
    log = (tmp_path / "server.log").read_text()
    assert result.returncode == 0, f"{block.where}:\n{result.stdout}\n{result.stderr}\n{log}"
    assert "Traceback" not in log, log


# -- the HTTP error reference -------------------------------------------------------------------

_ERRORS: dict[str, Callable[[dict[str, Any]], errors.AuthenticationError]] = {
    "missing_api_key": lambda body: errors.MissingAPIKey(),
    "malformed_api_key": lambda body: errors.MalformedAPIKey(),
    "invalid_api_key": lambda body: errors.InvalidAPIKey(),
    "key_disabled": lambda body: errors.KeyDisabled(),
    "key_revoked": lambda body: errors.KeyRevoked(),
    "key_expired": lambda body: errors.KeyExpired(),
    "insufficient_scope": lambda body: errors.InsufficientScope(body["required_scopes"]),
    "rate_limited": lambda body: errors.RateLimited(body["retry_after"], body["violated_policies"]),
    "auth_unavailable": lambda body: errors.AuthUnavailable(),
    "ip_not_allowed": lambda body: errors.IPNotAllowed(),
    "credits_exhausted": lambda body: errors.CreditsExhausted(body.get("retry_after")),
    "forbidden_field": lambda body: errors.ForbiddenField(body["field"]),
}


def test_every_problem_body_in_the_error_reference_is_the_one_sent() -> None:
    shown: set[str] = set()
    for block in blocks(DOCS / "http-errors.md"):
        if block.language != "json":
            continue
        body = json.loads(block.code)
        assert body == problem_body(_ERRORS[body["code"]](body)), block.where
        assert body["type"] == f"urn:apikeys:problem:{body['code']}"
        shown.add(body["code"])
    assert shown == set(_ERRORS)


# -- no real key in the docs --------------------------------------------------------------------


def test_no_sample_key_has_a_valid_checksum() -> None:
    # Sample keys are the right shape with a wrong checksum, so `apikeys scan docs/` stays
    # quiet and nobody mistakes one for a leak.
    pattern = re.compile(
        rb"(?<![0-9A-Za-z])ak_(?:live_|test_)?[0-9A-Za-z]{12}_[0-9A-Za-z]{38}(?![0-9A-Za-z])"
    )
    samples = 0
    for page in PAGES:
        for match in pattern.finditer(page.read_bytes()):
            samples += 1
            with pytest.raises(MalformedAPIKey):
                parse_key(match.group().decode())
    assert samples > 0


# -- the key pattern for secret scanners ------------------------------------------------------


def documented_key_pattern() -> re.Pattern[str]:
    """The regular expression docs/leaks.md gives for the default prefix: its `text` block."""
    [block] = [
        block
        for block in blocks(DOCS / "leaks.md")
        if block.language == "text" and block.code.startswith("ak_")
    ]
    return re.compile(block.code.strip())


KEY_PATTERN = documented_key_pattern()
_ids = st.text(BASE62, min_size=12, max_size=12)
_secrets = st.text(BASE62, min_size=32, max_size=32)


def _shape_accepted(text: str) -> bool:
    """Whether `parse_key_of(…, "ak")` accepts `text` once its last 6 characters are the
    right checksum: the shape alone, which is all a regular expression can check."""
    if len(text) < 6 or not text[:-6].isascii():
        return False
    try:
        parse_key_of(text[:-6] + checksum(text[:-6]), "ak")
    except MalformedAPIKey:
        return False
    return True


def test_the_documented_key_pattern_matches_generated_keys() -> None:
    for _ in range(100):
        for environment in ("live", "test", None):
            assert KEY_PATTERN.fullmatch(generate_key(environment=environment).token)


@given(key_id=_ids, secret=_secrets, prefix=st.sampled_from(["ak", "ak_live", "ak_test"]))
def test_the_documented_key_pattern_matches_every_key_parse_key_accepts(
    key_id: str, secret: str, prefix: str
) -> None:
    token = ParsedKey(prefix, key_id, secret).token
    assert parse_key_of(token, "ak")
    assert KEY_PATTERN.fullmatch(token)


_NOT_BASE62 = st.sampled_from(["_", "-", " ", ".", "é", "\uff13", "\u0660", "\n", "\x00"])


@given(
    key_id=_ids,
    secret=_secrets,
    change=st.sampled_from(["delete", "insert", "replace", "prefix"]),
    position=st.integers(min_value=0),
    character=_NOT_BASE62,
    extra=st.sampled_from(BASE62),
    prefix=st.sampled_from(["AK", "a", "akk", "ak_prod", "ak_live_live", "bk", ""]),
)
def test_the_documented_key_pattern_refuses_near_misses(
    key_id: str,
    secret: str,
    change: str,
    position: int,
    character: str,
    extra: str,
    prefix: str,
) -> None:
    token = ParsedKey("ak", key_id, secret).token
    at = position % len(token)
    if change == "delete":
        near = token[:at] + token[at + 1 :]
    elif change == "insert":
        near = token[:at] + extra + token[at:]
    elif change == "replace":
        near = token[:at] + (character if token[at] != "_" else "-") + token[at + 1 :]
    else:
        near = prefix + token[2:]
    assert near != token
    assert KEY_PATTERN.fullmatch(near) is None
    with pytest.raises(MalformedAPIKey):
        parse_key_of(near, "ak")


@given(
    text=st.builds(
        "{}_{}_{}".format,
        st.sampled_from(["ak", "ak_live", "ak_test", "AK", "a", "ak_x", "ak_live_test", ""]),
        st.text(BASE62 + "_-é\uff13", min_size=10, max_size=14),
        st.text(BASE62 + "_-é\uff13", min_size=36, max_size=40),
    )
)
def test_the_documented_key_pattern_is_the_shape_parse_key_accepts(text: str) -> None:
    assert (KEY_PATTERN.fullmatch(text) is not None) == _shape_accepted(text)


# -- the site -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path: Path) -> None:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(
            module, reason="the docs extra is not installed: pip install -e '.[docs]'"
        )
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()


def _clean_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if not name.startswith("APIKEYS_")}


def test_the_suite_keeps_to_a_redis_database_of_its_own() -> None:
    from tests import services

    assert services.DEFAULT_REDIS_URL.rsplit("/", 1)[1] == "13"
    assert "redis://127.0.0.1:6379/13" in (ROOT / ".ci" / "run").read_text()
    assert "database 13" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize(
    "page", [*PAGES, ROOT / "README.md"], ids=lambda page: str(page.relative_to(ROOT))
)
def test_every_table_renders_as_a_table(page: Path) -> None:
    # mkdocs --strict does not notice a table broken by a stray line: its rows then render
    # as paragraphs of literal pipes.
    import markdown

    html = markdown.markdown(page.read_text(), extensions=["tables", "fenced_code"])
    html = re.sub(r"<pre>.*?</pre>", "", html, flags=re.S)  # code may hold pipes
    stray = [line for line in html.splitlines() if re.match(r"(<p>)?\s*\|", line)]
    assert not stray, f"{page.name}: table rows rendered as text: {stray[:3]}"


# -- claims that once contradicted the code ----------------------------------------------------

README = ROOT / "README.md"
_PIP_INSTALL = re.compile(r"pip install\s+(.*)")


def _shell_lines() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}:{block.line + offset}", line.removeprefix("$ ").strip())
        for page in [*PAGES, README]
        for block in blocks(page)
        if block.language in _SHELL
        for offset, line in enumerate(block.code.splitlines())
    ]


def test_install_commands_install_apikeys_from_where_it_is() -> None:
    # apikeys is not on PyPI: `pip install 'apikeys[sql]'` would fail, or install a
    # stranger's package of that name. A clone (`./apikeys[...]`) or a built wheel it is.
    wrong = [
        (where, line)
        for where, line in _shell_lines()
        for match in _PIP_INSTALL.finditer(line)
        for word in shlex.split(match.group(1), comments=True)
        if re.match(r"^apikeys(\[|$)", word)
    ]
    assert not wrong, wrong


def test_install_commands_install_the_clone_whatever_its_directory_is_named() -> None:
    # Run in the clone, whatever its name: `./apikeys[sql]` needed a clone named `apikeys`
    # and its parent as the working directory. Inline `pip install` lines too.
    wrong = []
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            for match in re.finditer(r"pip install\s+([^`#\n]*)", line):
                for word in shlex.split(match.group(1)):
                    path = word.split("[", 1)[0]
                    local = "[" in word and not path.startswith("apikeys")
                    if local and (ROOT / path).resolve() != ROOT:
                        wrong.append(f"{page.relative_to(ROOT)}:{number}: {word}")
    assert not wrong, wrong


def test_python_m_build_is_shown_with_the_install_of_build() -> None:
    # `build` is not in the standard library: `python -m build` alone fails in a fresh venv.
    for page in [*PAGES, README]:
        text = page.read_text()
        for match in re.finditer(r"python -m build", text):
            before = text[max(0, match.start() - 120) : match.start()]
            assert "pip install build" in before, f"{page.name}: {match.start()}"


def test_the_extras_table_lists_every_extra_and_what_all_brings() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    rows = {
        match.group(1): match.group(2)
        for match in re.finditer(
            r"^\| `apikeys\[(\w+)\]` \| ([^|]*) \|", (DOCS / "index.md").read_text(), re.M
        )
    }
    assert set(rows) == set(extras) - {"dev"}
    [inside_all] = re.findall(r"apikeys\[([\w,]+)\]", extras["all"][0])
    assert sorted(re.findall(r"`(\w+)`", rows["all"])) == sorted(inside_all.split(","))


def test_the_metrics_samples_say_they_need_the_opentelemetry_sdk() -> None:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert not any("sdk" in requirement for requirement in extras["otel"])
    page = (DOCS / "observability.md").read_text()
    assert "opentelemetry.sdk" in page
    assert "pip install opentelemetry-sdk" in page


@pytest.mark.parametrize(
    ("page", "wrong", "right"),
    [
        # A rolled key keeps the old one's lifetime (tests/test_cli.py's roll tests).
        (
            "concepts/states.md",
            "does not inherit the old one's expiry",
            "keeps the old one's lifetime",
        ),
        # The CLI reads APIKEYS_OLD_PEPPERS through Hasher() (test_cli.py, scan --revoke).
        ("concepts/hashing.md", "reads only `APIKEYS_PEPPER`", "APIKEYS_OLD_PEPPERS"),
        # `header=` reads a bare key from another header (test_middleware.py).
        ("migrating.md", "`Authorization: Bearer <key>` only", 'header="X-API-Key"'),
        # The middleware speaks lifespan for Django (integrations/test_other_frameworks.py).
        ("migrating.md", "close the manager at exit yourself", "speaks it in its place"),
    ],
)
def test_a_page_no_longer_says_what_the_code_contradicts(page: str, wrong: str, right: str) -> None:
    text = " ".join((DOCS / page).read_text().split())
    assert wrong not in text
    assert right in text
