"""`apikeys.integrations.django` in `INSTALLED_APPS`: the app, whose `ready()` registers the
system checks (`apikeys.integrations.django.checks`)."""

from __future__ import annotations

from django.apps import AppConfig

__all__ = ["APIKeysConfig"]


class APIKeysConfig(AppConfig):  # type: ignore[misc]
    """The `apikeys` app: system checks, the `apikeys` management command, and a migration
    that sets up the key store's tables at `manage.py migrate`."""

    name = "apikeys.integrations.django"
    label = "apikeys"
    verbose_name = "API keys"
    default = True

    def ready(self) -> None:
        from apikeys.integrations.django import checks

        checks.register()
