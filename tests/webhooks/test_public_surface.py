"""The webhooks' modules: complete `__all__`s, each name there documented."""

from __future__ import annotations

import pytest

from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

MODULES = [
    "apikeys.webhooks",
    "apikeys.webhooks.admin",
    "apikeys.webhooks.model",
    "apikeys.webhooks.delivery",
    "apikeys.webhooks.events",
    "apikeys.stores.memory.webhooks",
    "apikeys.stores.redis.webhooks",
    "apikeys.webhooks.signing",
    "apikeys.stores.sql.webhooks",
    "apikeys.webhooks.thresholds",
]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_definition_is_in_all_and_documented(name: str) -> None:
    assert_all_is_complete(name)
    assert_exports_are_documented(name)
