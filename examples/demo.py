"""The demo: seed a workspace, print a fresh API key, and serve the contacts service.

```shell
python -m examples.demo              # what `make demo` runs, from the repository root
python -m examples.demo --port 8080  # `make demo PORT=8080`
python -m examples.demo --no-serve   # seed and print the key only
python -m examples.demo --forwarded-allow-ips 10.0.0.2   # behind the proxy at 10.0.0.2
```

It uses the service's settings (`APIKEYS_STORE_URL`, `EXAMPLE_DATABASE_URL`, …), whose
defaults are SQLite files in the current directory. Running it again is safe: the workspace
and its sample data are created once, and each run rolls the demo key: it prints a new one,
and the previous run's key stops working.

Keys are hashed with a pepper (`APIKEYS_PEPPER`). When it is not set, the demo makes one
once, keeps it in `.apikeys-demo-pepper` (readable by you only) and exports it before the
service starts, so demo keys keep working across restarts. Give the `apikeys` command line
the same pepper: `export APIKEYS_PEPPER="$(cat .apikeys-demo-pepper)"`.

The settings UI (`/settings/integrations/api-keys`) needs a login. Unless
`EXAMPLE_ADMIN_EMAIL` and `EXAMPLE_ADMIN_PASSWORD` are set, the demo logs you in as
`admin@acme.example` with a password it generates once and keeps in
`.example-admin-password` (readable by you only): a fixed, documented demo password would
let anyone in whenever the demo is reachable from elsewhere. The service signs its session
cookies with a secret it keeps in `.example-session-secret` (or `EXAMPLE_SESSION_SECRET`).

The demo trusts no proxy: the client address (which key allowlists check) is the
connection's, whatever `X-Forwarded-For` says. uvicorn alone would believe that header from
127.0.0.1, so any local process could choose its address. Behind a proxy, name it with
`--forwarded-allow-ips` (or `FORWARDED_ALLOW_IPS`, as uvicorn reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from datetime import timedelta
from pathlib import Path

from apikeys import KeyManager
from apikeys.hashing import PEPPER_ENV
from examples.contacts_service.api import MANAGEMENT_PATH
from examples.contacts_service.auth import ensure_user
from examples.contacts_service.db import DEMO_CAMPAIGNS, Database
from examples.contacts_service.payload import validate_contact
from examples.contacts_service.settings import Settings
from examples.contacts_service.web import LIST_URL

PEPPER_FILE = Path(".apikeys-demo-pepper")
ADMIN_PASSWORD_FILE = Path(".example-admin-password")
DEMO_ADMIN_EMAIL = "admin@acme.example"
DEMO_KEY_NAME = "demo key"
SAMPLE_CONTACTS = (
    {
        "name": "Ada Lovelace",
        "phone": "+442071838750",
        "email": "ada@example.com",
        "company": "Analytical Engines Ltd",
    },
    {
        "name": "Grace Hopper",
        "phone": "+12025550143",
        "email": "grace@example.org",
        "company": "Compiler Corp",
    },
)


def _secret_file(path: Path, length: int) -> str:
    """The secret kept in `path`, made (readable by the owner only) the first time."""
    if path.exists():
        return path.read_text().strip()
    secret = secrets.token_urlsafe(length)
    # Created readable by the owner only; O_EXCL never overwrites a secret in use.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret + "\n")
    return secret


def ensure_pepper(path: Path = PEPPER_FILE) -> str:
    """Export a pepper unless one is set; return where it came from."""
    if os.environ.get(PEPPER_ENV):
        return f"${PEPPER_ENV}"
    os.environ[PEPPER_ENV] = _secret_file(path, 32)
    return str(path)


def ensure_admin(path: Path = ADMIN_PASSWORD_FILE) -> str | None:
    """Export the demo login unless one is set; return its password, or None if not ours."""
    if os.environ.get("EXAMPLE_ADMIN_EMAIL") or os.environ.get("EXAMPLE_ADMIN_PASSWORD"):
        return None
    password = _secret_file(path, 12)
    os.environ["EXAMPLE_ADMIN_EMAIL"] = DEMO_ADMIN_EMAIL
    os.environ["EXAMPLE_ADMIN_PASSWORD"] = password
    return password


async def seed(settings: Settings) -> str:
    """Prepare the workspace, its sample contacts and its login; return a new full-access key."""
    database = Database(settings.database_url)
    try:
        await database.create_tables()
        await database.ensure_workspace(settings.workspace)
        for sample in SAMPLE_CONTACTS:
            if await database.find_contact_by_email(settings.workspace, sample["email"]) is None:
                await database.add_contact(settings.workspace, validate_contact(sample))
        if settings.admin_email is not None and settings.admin_password is not None:
            await ensure_user(
                database, settings.workspace, settings.admin_email, settings.admin_password
            )
    finally:
        await database.aclose()
    async with KeyManager(settings.store_url) as manager:
        # One demo key at a time: a run rolls the last run's key (which stops working at
        # once) instead of adding another full-access key to the list.
        previous = [
            record
            for record in await manager.list(settings.workspace)
            if record.name == DEMO_KEY_NAME and record.status in ("active", "disabled")
        ]
        if previous:
            created = await manager.roll(previous[-1].id, grace=timedelta(0))
            for older in previous[:-1]:
                await manager.revoke(older.id)
        else:
            created = await manager.create(
                name=DEMO_KEY_NAME, workspace=settings.workspace, full_access=True
            )
    return created.key


def _help_text(doc: str) -> str:
    """The module doc for --help: its shell block indented, without Markdown fences."""
    lines: list[str] = []
    in_block = False
    for line in doc.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        lines.append(f"    {line}" if in_block else line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description=_help_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--no-serve", action="store_true", help="seed and print the key only")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--forwarded-allow-ips",
        default=os.environ.get("FORWARDED_ALLOW_IPS") or None,
        metavar="ADDRESSES",
        help="trust X-Forwarded-For from these proxies (comma-separated); default: none",
    )
    args = parser.parse_args(argv)

    pepper_source = ensure_pepper()
    generated_password = ensure_admin()
    settings = Settings.from_env()
    key = asyncio.run(seed(settings))
    base = f"http://{args.host}:{args.port}"
    campaigns = ", ".join(name for name, _ in DEMO_CAMPAIGNS)
    print(
        f"Workspace {settings.workspace!r} is ready, with sample contacts and the campaigns "
        f"{campaigns}.\n"
        f"Keys: {settings.store_url} (pepper from {pepper_source}); "
        f"data: {settings.database_url}.\n\n"
        f"A new full-access API key {DEMO_KEY_NAME!r}, shown this once (the previous "
        "run's demo key, if any, no longer works):\n\n"
        f"    {key}\n\n"
        "Try it:\n\n"
        f'    curl -H "Authorization: Bearer {key}" {base}/api/v1/contacts\n\n'
        f"The API's OpenAPI document: {base}/api/v1/openapi.json\n\n"
        "The key holds apikeys:read and apikeys:write, so it also manages the workspace's "
        f"keys through the management API at {base}{MANAGEMENT_PATH} (docs/management-api.md); "
        "make a key that may only read contacts:\n\n"
        f'    curl -H "Authorization: Bearer {key}" -H "Content-Type: application/json" '
        f'-d \'{{"name": "zapier", "scopes": ["contacts:read"]}}\' '
        f"{base}{MANAGEMENT_PATH}/keys\n\n"
        f"Manage keys in the browser: {base}{LIST_URL}\n"
        f"    e-mail:   {settings.admin_email}\n"
        + (
            f"    password: {generated_password}   (kept in {ADMIN_PASSWORD_FILE})"
            if generated_password is not None
            else "    password: the one in $EXAMPLE_ADMIN_PASSWORD"
        ),
        flush=True,
    )
    if args.no_serve:
        return

    import uvicorn

    # No proxy is trusted unless one is named: uvicorn's own default trusts 127.0.0.1.
    trusted = args.forwarded_allow_ips
    uvicorn.run(
        "examples.contacts_service.app:app",
        host=args.host,
        port=args.port,
        proxy_headers=trusted is not None,
        forwarded_allow_ips=trusted,
    )


if __name__ == "__main__":
    main()
