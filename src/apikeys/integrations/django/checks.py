"""System checks (`manage.py check`, and before `runserver` and `migrate`), registered by
the app's `ready()` under the tag `apikeys`:

- `apikeys.E001`: `settings.APIKEYS` cannot be used (an unknown entry, a rule that cannot be
  understood, such as one in Django's `<int:pk>` syntax: the message spells it right).
- `apikeys.E002`: the store's keys are hashed with another pepper than this process's (the
  store's fingerprint message), or the store cannot be made (`STORE_OPTIONS` it does not
  take, say).
- `apikeys.W001`: the store is out of reach, so the pepper was not checked.
- `apikeys.W002`: a `SCOPES` or `COSTS` rule that no route of the URLconf answers.
- `apikeys.W003`: the same, where the route differs only by its trailing slash (the
  message gives the rule Django's route needs).

The store checks open the store, as the server will; `manage.py check --tag apikeys` runs
only these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core import checks

from apikeys.errors import APIKeyError, ConfigurationError, StoreUnavailable
from apikeys.integrations.django.routing import answered
from apikeys.redaction import failure_reason, redact, safe_url
from apikeys.routes import CostTable, ScopeTable

__all__ = ["check_routes", "check_store", "register"]

TAG = "apikeys"
W002_HINT = (
    "spell the path as the URLconf does, with {name:converter} for its parameters "
    "(see apikeys.routes)"
)


def register() -> None:
    """Register the checks (the app's `ready()` does)."""
    checks.register(check_store, TAG)
    checks.register(check_routes, TAG)


def check_store(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """The settings, the store and the pepper, as the middleware will find them at start."""
    from apikeys.integrations.django import apikeys_settings, get_manager

    try:
        config = apikeys_settings()
        ScopeTable(config["SCOPES"])
        CostTable(config["COSTS"])
    except ConfigurationError as exc:
        return [checks.Error(str(exc), id="apikeys.E001", obj="settings.APIKEYS")]
    try:
        get_manager().setup()
    except StoreUnavailable as exc:
        text = exc.operator_text or str(exc)
        return [
            checks.Warning(
                f"{text}: the pepper was not checked against the store's",
                hint="make the store reachable from this process, then run the check again",
                id="apikeys.W001",
                obj="settings.APIKEYS",
            )
        ]
    except APIKeyError as exc:
        return [checks.Error(str(exc), id="apikeys.E002", obj="settings.APIKEYS")]
    except Exception as exc:  # the store cannot be made: the server will not start
        url = config["STORE_URL"]
        text = f"key store error: {safe_url(url)}: {redact(failure_reason(exc), url)}"
        return [checks.Error(text, id="apikeys.E002", obj="settings.APIKEYS")]
    return []


def check_routes(app_configs: Any = None, **_: Any) -> list[checks.CheckMessage]:
    """Each `SCOPES` and `COSTS` rule matches a route of the URLconf."""
    from apikeys.integrations.django import apikeys_settings

    try:
        config = apikeys_settings()
    except ConfigurationError:
        return []  # check_store reports it
    found: list[checks.CheckMessage] = []
    for setting in ("SCOPES", "COSTS"):
        rules = config[setting]
        if isinstance(rules, Mapping):
            found.extend(_unmatched(setting, rules))
    return found


def _unmatched(setting: str, rules: Mapping[str, Any]) -> list[checks.CheckMessage]:
    found: list[checks.CheckMessage] = []
    for rule in rules:
        method, _, path = str(rule).strip().partition(" ")
        path = path.strip()
        if answered(path):
            continue
        other = path[:-1] if path.endswith("/") else path + "/"
        if len(other) > 1 and answered(other):
            found.append(
                checks.Warning(
                    f"APIKEYS[{setting!r}] rule {rule!r} matches no route: Django's route "
                    f"{'has no' if path.endswith('/') else 'ends with a'} trailing slash",
                    hint=f"write it {method} {other}",
                    id="apikeys.W003",
                    obj="settings.APIKEYS",
                )
            )
            continue
        found.append(
            checks.Warning(
                f"APIKEYS[{setting!r}] rule {rule!r} matches no route of the URLconf",
                hint=W002_HINT,
                id="apikeys.W002",
                obj="settings.APIKEYS",
            )
        )
    return found
