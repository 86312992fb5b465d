"""The checks every public module passes (like httpx's `test_exported_members.py`): each
public class and function it defines is in its `__all__`, each name there exists, once, and
has a docstring."""

from __future__ import annotations

import importlib
import inspect


def assert_all_is_complete(name: str) -> None:
    """`name.__all__` lists each of its names once, each exists, and every public class
    and function the module defines is among them."""
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__), "a name is listed twice"
    assert all(hasattr(module, item) for item in exported)
    defined = {
        item
        for item, value in vars(module).items()
        if not item.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == name
    }
    assert defined <= exported, sorted(defined - exported)


def assert_exports_are_documented(name: str) -> None:
    """Every class and function in `name.__all__` has a docstring."""
    module = importlib.import_module(name)
    undocumented = [
        item
        for item in module.__all__
        if (inspect.isclass(value := getattr(module, item)) or inspect.isfunction(value))
        and not inspect.getdoc(value)
    ]
    assert not undocumented, f"{name}: {undocumented} have no docstring"
