"""A Django project with `apikeys.integrations.django` in `INSTALLED_APPS`, driven through
its own `manage.py`, each command in a process of its own: the system checks, `migrate`
setting up the store, and `manage.py apikeys …` on the store and pepper of the settings."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_PEPPER

pytestmark = pytest.mark.sqlite

OTHER_PEPPER = "q7Jd0o3u0w8mF2Zc9yX5kVtH1aLrN6sPeBgUi4WQ-zE"

SETTINGS = """
import os
SECRET_KEY = "not-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver"]
ROOT_URLCONF = "urls"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "apikeys.integrations.django",
]
MIDDLEWARE = ["apikeys.integrations.django.APIKeyMiddleware"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "django.db"}}
APIKEYS = {
    "STORE_URL": "sqlite:///keys.db",
    "PEPPER": os.environ["PROJECT_PEPPER"],
    "PROTECT": "/api/",
    "SCOPES": SCOPES,
}
"""

URLS = """
from django.http import JsonResponse
from django.urls import path

def contact(request, pk):
    return JsonResponse({"id": pk, "key": request.apikey.id})

urlpatterns = [path("api/v1/contacts/<int:pk>/", contact)]
"""

MANAGE = """
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "settings")
from django.core.management import execute_from_command_line
execute_from_command_line(sys.argv)
"""


def project(root: Path, scopes: dict[str, str]) -> Path:
    root.mkdir(exist_ok=True)
    (root / "settings.py").write_text(f"SCOPES = {scopes!r}\n{SETTINGS}")
    (root / "urls.py").write_text(URLS)
    (root / "manage.py").write_text(MANAGE)
    return root


def manage(root: Path, *args: str, pepper: str = TEST_PEPPER) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("APIKEYS_")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env["PROJECT_PEPPER"] = pepper
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


GOOD_RULES = {"GET /api/v1/contacts/{pk:int}/": "contacts:read"}


def test_migrate_sets_up_the_store_and_manage_py_apikeys_uses_the_settings(
    tmp_path: Path,
) -> None:
    root = project(tmp_path / "site", GOOD_RULES)
    # Without the checks, which open the store too: the migration alone makes the tables.
    migrated = manage(root, "migrate", "--no-input", "--skip-checks")
    assert migrated.returncode == 0, migrated.stderr
    assert "Applying apikeys.0001_store... OK" in migrated.stdout
    tables = {
        name
        for (name,) in sqlite3.connect(root / "keys.db").execute(
            "SELECT name FROM sqlite_master WHERE type = 'table'"
        )
    }
    assert "apikeys_keys" in tables

    # The command line, on the settings' store and pepper: no environment variable.
    created = manage(root, "apikeys", "create", "--name", "Zapier", "--scope", "contacts:read")
    assert created.returncode == 0, created.stderr
    key = next(word for word in created.stdout.split() if word.startswith("ak_"))
    listed = manage(root, "apikeys", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [row["name"] for row in json.loads(listed.stdout)] == ["Zapier"]
    assert not (root / "apikeys.db").exists()  # not the command line's default store

    helped = manage(root, "apikeys", "--help")
    assert helped.returncode == 0
    assert "Usage: manage.py apikeys" in helped.stdout
    unknown = manage(root, "apikeys", "show", "3xK9pQ2mZ7aB")
    assert unknown.returncode == 1
    assert unknown.stderr.count("\n") == 1

    # The key works in the project, and `check` finds nothing wrong.
    checked = manage(root, "check")
    assert checked.returncode == 0, checked.stderr
    assert "no issues" in checked.stdout
    served = manage(root, "shell", "-c", SERVE.format(key=key))
    assert served.returncode == 0, served.stderr
    assert served.stdout.split()[-1] == "200"

    # Started with another pepper: `check` says so with the store's message, and the
    # server does not start (Django loads the middleware), rather than 401 every key.
    for command in (["check"], ["check", "--tag", "apikeys"], ["migrate", "--no-input"]):
        wrong = manage(root, *command, pepper=OTHER_PEPPER)
        assert wrong.returncode != 0, command
        assert "apikeys.E002" in wrong.stderr
        assert "hashed with a pepper of fingerprint" in wrong.stderr
    refused = manage(root, "shell", "-c", SERVE.format(key=key), pepper=OTHER_PEPPER)
    assert refused.returncode != 0
    assert "ConfigurationError" in refused.stderr
    assert "hashed with a pepper of fingerprint" in refused.stderr


SERVE = """
from django.core.handlers.wsgi import WSGIHandler
from django.test import Client
WSGIHandler()  # what the WSGI server does at start
answer = Client().get("/api/v1/contacts/7/", headers={{"Authorization": "Bearer {key}"}})
print(answer.status_code)
"""


@pytest.mark.parametrize(
    ("rules", "code", "says"),
    [
        pytest.param(
            {"GET /api/v1/contacts/<int:pk>/": "contacts:read"},
            "apikeys.E001",
            "'GET /api/v1/contacts/{pk:int}/'",
            id="django-syntax",
        ),
        pytest.param(
            {"GET /api/v1/contacts/{pk:int}": "contacts:read"},
            "apikeys.W003",
            "write it GET /api/v1/contacts/{pk:int}/",
            id="trailing-slash",
        ),
        pytest.param(
            {"GET /api/v1/contact/{pk:int}/": "contacts:read"},
            "apikeys.W002",
            "matches no route of the URLconf",
            id="no-route",
        ),
    ],
)
def test_check_finds_rules_no_route_answers(
    tmp_path: Path, rules: dict[str, Any], code: str, says: str
) -> None:
    checked = manage(project(tmp_path / "site", rules), "check")
    assert code in checked.stderr, checked.stderr
    assert says in checked.stderr
    assert (checked.returncode != 0) == code.startswith("apikeys.E")
