"""Fixtures the webhook tests share."""

from __future__ import annotations

import pytest

from apikeys.webhooks.targets import ALLOW_PRIVATE_ENV


@pytest.fixture(autouse=True)
def allow_private_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receivers here listen on 127.0.0.1, an internal address a webhook is not sent
    to by default: these tests opt in, as an operator would (tests/webhooks/test_targets.py
    overrides this fixture to show the default)."""
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
