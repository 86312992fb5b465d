"""A manager left unclosed: a ResourceWarning, its usage counts written at exit, no hang.

A script that used `KeyManager("sqlite:///…")` and never closed it hung at exit, and the
counts it had buffered were lost, both silently.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.stores.sql.store import SQLStore

PEPPER = "Hz1wRMr3zeK4OoaX3BFQ16fB_P5WLbvX3KPd79CWTnY"

# Issues a key, verifies it three times (three counts buffered) and ends without closing.
# "global": the manager lives until exit; "dropped": it is collected once asyncio.run ends.
SCRIPT = textwrap.dedent(
    f"""
    import asyncio
    import shutil
    import sys

    from apikeys import Hasher, KeyManager

    url, variant = sys.argv[1], sys.argv[2]


    async def use(manager):
        created = await manager.create(name="n", workspace="w", full_access=True)
        for _ in range(3):
            await manager.verify(created.key)
        print(created.record.id)


    if variant == "dropped":
        asyncio.run(use(KeyManager(url, hasher=Hasher(pepper={PEPPER!r}))))
    else:
        manager = KeyManager(url, hasher=Hasher(pepper={PEPPER!r}))
        asyncio.run(use(manager))
    if variant == "unreachable":
        shutil.rmtree(sys.argv[3])  # the database's folder is gone by exit
    """
)

pytestmark = pytest.mark.sqlite

UNCLOSED = "ResourceWarning: unclosed KeyManager("


def run_script(
    tmp_path: Path, variant: str, flags: list[str], *extra: str
) -> tuple[str, subprocess.CompletedProcess[str]]:
    """Run the script to its exit: one that hangs at exit fails at the timeout (a bound on
    a hang, not a timing: a slow machine only takes longer)."""
    folder = tmp_path / "db"
    folder.mkdir(exist_ok=True)
    url = f"sqlite:///{folder / 'keys.db'}"
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {name: value for name, value in os.environ.items() if name != "PYTHONWARNINGS"}
    result = subprocess.run(
        [sys.executable, *flags, str(script), url, variant, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    return url, result


async def request_count(url: str, key_id: str) -> int:
    store = SQLStore(url)
    try:
        stored = await store.get(key_id)
    finally:
        await store.aclose()
    assert stored is not None
    return stored.record.request_count


@pytest.mark.parametrize("variant", ["global", "dropped"])
@pytest.mark.parametrize(
    "flags", [[], ["-W", "always::ResourceWarning"]], ids=["default", "resource-warnings"]
)
async def test_if_a_script_never_closes_its_manager_then_it_exits_warns_and_writes_the_counts(
    tmp_path: Path, variant: str, flags: list[str]
) -> None:
    url, result = run_script(tmp_path, variant, flags)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    if flags:
        # Once per manager: at exit (or when collected), never again when collected later.
        assert result.stderr.count(UNCLOSED) == 1, result.stderr
        assert "await manager.aclose()" in result.stderr
        assert "async with KeyManager(...) as manager:" in result.stderr
    else:
        # Python hides ResourceWarning unless asked; writing the counts needs no warning.
        assert "ResourceWarning" not in result.stderr, result.stderr
    assert await request_count(url, result.stdout.strip()) == 3


def test_if_warnings_are_errors_then_exit_still_prints_no_traceback(tmp_path: Path) -> None:
    _, result = run_script(tmp_path, "global", ["-W", "error::ResourceWarning"])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "unclosed KeyManager(" in result.stderr


def test_if_the_counts_cannot_be_written_at_exit_then_it_says_how_many_were_lost(
    tmp_path: Path,
) -> None:
    _, result = run_script(tmp_path, "unreachable", [], str(tmp_path / "db"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "3 request count(s) buffered by an unclosed KeyManager could not be written" in (
        result.stderr
    )


# -- in process ---------------------------------------------------------------------------


def resource_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(warning.message)
        for warning in caught
        if issubclass(warning.category, ResourceWarning) and "KeyManager" in str(warning.message)
    ]


async def test_if_a_used_manager_is_collected_unclosed_then_it_warns_once() -> None:
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=PEPPER))
    created = await manager.create(name="n", workspace="w", full_access=True)
    await manager.verify(created.key, record_usage=False)
    with pytest.warns(ResourceWarning) as caught:
        del manager  # nothing else refers to it: collected at once
    [message] = resource_warnings(list(caught))
    assert message.startswith("unclosed KeyManager(store=MemoryStore(")
    assert "`await manager.aclose()`" in message
    assert "`async with KeyManager(...) as manager:`" in message


@pytest.mark.parametrize("closing", ["aclose", "async with"])
async def test_if_a_manager_is_closed_then_it_never_warns(closing: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if closing == "aclose":
            manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=PEPPER))
            created = await manager.create(name="n", workspace="w", full_access=True)
            await manager.verify(created.key)
            await manager.aclose()
        else:
            async with KeyManager(MemoryStore(), hasher=Hasher(pepper=PEPPER)) as manager:
                created = await manager.create(name="n", workspace="w", full_access=True)
                await manager.verify(created.key)
        del manager
        gc.collect()
    assert resource_warnings(caught) == []


def test_if_a_manager_did_nothing_then_it_never_warns(tmp_path: Path) -> None:
    # Nothing is opened before the first call: a manager built and dropped holds nothing.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        KeyManager(MemoryStore(), hasher=Hasher(pepper=PEPPER))
        KeyManager(f"sqlite:///{tmp_path / 'keys.db'}", hasher=Hasher(pepper=PEPPER))
        gc.collect()
    assert resource_warnings(caught) == []
