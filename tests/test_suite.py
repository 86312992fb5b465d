"""The suite itself: it cannot fail because the machine is slow, and it cleans up after itself.

A property test is about inputs, not speed: on a loaded machine one example may take a
second, and hypothesis's default 200 ms deadline would then fail a test that is right. The
suite loads a profile without deadlines (tests/conftest.py) and no test sets one of its own.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _test_modules() -> list[str]:
    return sorted(
        ".".join(path.relative_to(ROOT).with_suffix("").parts) for path in TESTS.rglob("test_*.py")
    )


def test_the_suite_runs_hypothesis_without_deadlines() -> None:
    assert settings.default.deadline is None
    assert settings.get_profile("ci").deadline is None


def test_the_profile_can_be_chosen_with_hypothesis_profile() -> None:
    conftest = (TESTS / "conftest.py").read_text()
    assert 'os.environ.get("HYPOTHESIS_PROFILE", "ci")' in conftest
    assert os.environ.get("HYPOTHESIS_PROFILE", "ci") in {"ci", "dev"}
    assert settings.get_profile("dev").deadline is None


def test_no_test_sets_a_deadline_of_its_own() -> None:
    # `deadline=None` is allowed (and redundant); any other value can fail on a slow machine.
    offending = []
    for path in [*TESTS.rglob("*.py"), *(ROOT / "src" / "apikeys" / "testing").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.keyword)
                and node.arg == "deadline"
                and not (isinstance(node.value, ast.Constant) and node.value.value is None)
            ):
                offending.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
    assert not offending, offending


def test_every_property_test_runs_without_a_deadline() -> None:
    # The settings each `@given` test really runs with: its own `@settings` on top of the
    # profile, as hypothesis resolves them.
    checked = 0
    late = []
    for name in _test_modules():
        module = importlib.import_module(name)
        candidates = list(vars(module).values())
        for value in list(candidates):
            if isinstance(value, type):
                candidates.extend(vars(value).values())
        for value in candidates:
            inner = getattr(value, "hypothesis", None)
            if inner is None or not hasattr(inner, "inner_test"):
                continue
            chosen = getattr(value, "_hypothesis_internal_use_settings", settings.default)
            checked += 1
            if chosen.deadline is not None:
                late.append(f"{name}.{value.__qualname__}: deadline={chosen.deadline}")
    assert checked >= 20
    assert not late, late
