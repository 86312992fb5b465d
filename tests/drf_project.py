"""A djangorestframework-api-key project's database, made by that package itself.

Run as `python tests/drf_project.py DATABASE_URL` (`sqlite:///path` or `postgresql://…`): it
configures Django for that database, runs the package's migrations, issues keys through
its own model and key generator, and prints JSON: each key string by label, and the labels
of the keys it revoked or let expire. `python tests/drf_project.py DATABASE_URL --check`
reads key strings on stdin (a JSON list) and prints, as the old service would answer them,
whether each is valid (`APIKey.objects.is_valid`), as a JSON list. A process of its own,
since Django is configured once per process and other tests configure it otherwise.

Besides keys of today's release (`sha512$$…`), it makes keys as older releases did, hashed
by Django's password hashers (made cheap here: fewer rounds, same formats).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from urllib.parse import urlsplit

import django
from django.conf import settings
from django.contrib.auth.hashers import (
    Argon2PasswordHasher,
    BCryptSHA256PasswordHasher,
    PBKDF2PasswordHasher,
)


class CheapPBKDF2(PBKDF2PasswordHasher):
    iterations = 1000


class CheapArgon2(Argon2PasswordHasher):
    time_cost = 1
    memory_cost = 1024
    parallelism = 1


class CheapBCryptSHA256(BCryptSHA256PasswordHasher):
    rounds = 4


def database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": parts.path[1:]}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parts.path.lstrip("/"),
        "USER": parts.username or "",
        "PASSWORD": parts.password or "",
        "HOST": parts.hostname or "",
        "PORT": str(parts.port or ""),
    }


def main(url: str, check: bool = False) -> None:
    settings.configure(
        DATABASES={"default": database(url)},
        INSTALLED_APPS=[
            "django.contrib.contenttypes",
            "django.contrib.auth",
            "rest_framework",
            "rest_framework_api_key",
        ],
        PASSWORD_HASHERS=[
            f"{__name__}.CheapPBKDF2",
            f"{__name__}.CheapArgon2",
            f"{__name__}.CheapBCryptSHA256",
        ],
        USE_TZ=True,
    )
    django.setup()
    from django.contrib.auth.hashers import make_password
    from django.core.management import call_command
    from django.utils import timezone
    from rest_framework_api_key.models import APIKey

    if check:
        asked = json.load(sys.stdin)
        json.dump([APIKey.objects.is_valid(key) for key in asked], sys.stdout)
        return
    call_command("migrate", verbosity=0)
    keys: dict[str, str] = {}
    now = timezone.now()
    for label, fields in {
        "active": {"name": "Zapier"},
        "expiring": {"name": "Make.com", "expiry_date": now + timedelta(days=30)},
        "revoked": {"name": "old laptop", "revoked": True},
        "expired": {"name": "trial", "expiry_date": now - timedelta(days=1)},
    }.items():
        _api_key, key = APIKey.objects.create_key(**fields)
        keys[label] = key
    # Releases before 2.0 hashed keys with Django's password hashers.
    for hasher in ("pbkdf2_sha256", "argon2", "bcrypt_sha256"):
        api_key, key = APIKey.objects.create_key(name=f"legacy {hasher}")
        api_key.hashed_key = make_password(key, hasher=hasher)
        api_key.save()
        keys[hasher] = key
    json.dump({"keys": keys, "revoked": ["revoked"], "expired": ["expired"]}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1], check="--check" in sys.argv[2:])
