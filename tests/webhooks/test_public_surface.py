"""The webhooks' modules: complete `__all__`s, each name there documented."""

from __future__ import annotations

import importlib
import inspect

import pytest

MODULES = [
    "apikeys.webhooks",
    "apikeys.webhooks.admin",
    "apikeys.webhooks.base",
    "apikeys.webhooks.delivery",
    "apikeys.webhooks.events",
    "apikeys.webhooks.memory",
    "apikeys.webhooks.redis",
    "apikeys.webhooks.signing",
    "apikeys.webhooks.sql",
]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_definition_is_in_all_and_documented(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    assert len(exported) == len(module.__all__)
    assert all(hasattr(module, item) for item in exported)
    defined = {
        item
        for item, value in vars(module).items()
        if not item.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == name
    }
    assert defined <= exported, sorted(defined - exported)
    undocumented = [
        item
        for item in module.__all__
        if (inspect.isclass(value := getattr(module, item)) or inspect.isfunction(value))
        and not inspect.getdoc(value)
    ]
    assert not undocumented
