"""The leak-response surface users import: complete `__all__`s, each name documented.

Like httpx's `test_exported_members.py`: every public name a module defines is in its
`__all__`, every name there exists and has a docstring, the docs import nothing else from
these modules, and every error class is in the tree `apikeys.errors` draws.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import apikeys
from apikeys import errors
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

ROOT = Path(__file__).resolve().parents[2]
MODULES = [
    "apikeys.leaks",
    "apikeys.leaks.bulk",
    "apikeys.leaks.github",
    "apikeys.leaks.http",
    "apikeys.leaks.verdicts",
    "apikeys.errors",
    "apikeys.problems",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist_and_every_public_definition_is_in_all(name: str) -> None:
    assert_all_is_complete(name)


@pytest.mark.parametrize("name", MODULES)
def test_every_exported_class_and_function_has_a_docstring(name: str) -> None:
    assert_exports_are_documented(name)


def test_every_error_is_in_the_tree_and_importable_from_apikeys() -> None:
    tree = errors.__doc__ or ""
    for item in errors.__all__:
        assert re.search(rf"(^|[─ ]){item}\b", tree, re.M), f"{item} is not in the tree"
        assert getattr(apikeys, item) is getattr(errors, item)
        assert issubclass(getattr(errors, item), errors.APIKeyError)


def test_the_endpoints_refusals_are_request_refusals_not_authentication_errors() -> None:
    for refusal in (
        errors.MissingSignature,
        errors.InvalidSignature,
        errors.MethodNotAllowed,
        errors.PayloadTooLarge,
        errors.UnsupportedMediaType,
        errors.MalformedJSON,
        errors.InvalidPayload,
        errors.SigningKeysUnavailable,
    ):
        assert issubclass(refusal, errors.RequestRefused)
        assert not issubclass(refusal, errors.AuthenticationError)
    assert issubclass(errors.AuthenticationError, errors.RequestRefused)


def test_the_docs_import_only_exported_names_from_the_leak_modules() -> None:
    imports = re.compile(r"from (apikeys\.leaks(?:\.\w+)?) import (\([^)]*\)|[\w, ]+)")
    seen = 0
    for page in (ROOT / "docs").rglob("*.md"):
        for module_name, names in imports.findall(page.read_text()):
            module = importlib.import_module(module_name)
            for item in re.findall(r"\w+", names):
                seen += 1
                assert item in module.__all__, f"{page.name}: {module_name}.{item}"
    assert seen > 0


@pytest.mark.parametrize("missing", ["cryptography", "httpx"])
def test_without_the_github_extra_the_receiver_names_it_and_bulk_revoke_still_imports(
    missing: str,
) -> None:
    block = f"import sys; sys.modules[{missing!r}] = None\n"
    bulk = subprocess.run(
        [sys.executable, "-c", block + "from apikeys.leaks import BulkRevoke\n"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bulk.returncode == 0, bulk.stderr
    receiver = subprocess.run(
        [sys.executable, "-c", block + "from apikeys.leaks import SecretScanningReceiver\n"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert receiver.returncode != 0
    assert "pip install 'apikeys[github]'" in receiver.stderr
