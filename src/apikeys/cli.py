"""The `apikeys` command line: create, list, show, disable, enable, revoke, roll and scan keys.

```
apikeys create --name Zapier --workspace acme --scope contacts:read --expires-in 90d
apikeys list --workspace acme
apikeys roll 3xK9pQ2mZ7aB --grace 24h
apikeys revoke 3xK9pQ2mZ7aB --yes
apikeys scan . --revoke
```

The store is `--store URL` or `APIKEYS_STORE_URL` (default `sqlite:///apikeys.db`, the one
the example service uses). Keys are hashed with `APIKEYS_PEPPER`: give the command line the
same pepper as the service, or the service will not recognise the keys created here.

Exit status: 0 done, 1 refused (unknown id, enabling a revoked key, store unreachable, a key
found by `scan`) with a one-line reason on stderr, 2 usage error. A full key is printed only
by `create` and `roll`, once; every other output shows the masked form `ak_<id>_…`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import click

from apikeys.durations import format_duration, parse_duration
from apikeys.errors import (
    APIKeyError,
    ConfigurationError,
    InvalidKeyParameters,
    InvalidTransition,
    KeyNotFound,
    MalformedAPIKey,
    StoreUnavailable,
)
from apikeys.hashing import Hasher
from apikeys.keys import (
    BASE62,
    DEFAULT_PREFIX,
    ID_LENGTH,
    mask,
    parse_key,
    validate_prefix,
)
from apikeys.manager import KeyManager
from apikeys.ratelimit import parse_rate_limit
from apikeys.scanning import (
    Finding,
    ScanStats,
    find_keys,
    key_pattern,
    read_text_file,
    revoke_found,
    walk,
)
from apikeys.scopes import validate_scope
from apikeys.stores.base import store_from_url
from apikeys.types import REVOKED, CreatedKey, KeyRecord, utcnow

__all__ = ["main"]

STORE_ENV = "APIKEYS_STORE_URL"
DEFAULT_STORE_URL = "sqlite:///apikeys.db"

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
_KEY_ID_RE = re.compile(f"[{re.escape(BASE62)}]{{{ID_LENGTH}}}")
_SCOPE_SPLIT_RE = re.compile(r"[\s,]+")


class Refused(click.ClickException):
    """The command was understood but cannot be carried out: exit status 1, one line on stderr."""

    exit_code = 1


@dataclass(frozen=True, slots=True)
class _Settings:
    store_url: str


# -- option callbacks ------------------------------------------------------------------------
# Callbacks rather than `click.ParamType` subclasses: `ParamType` is generic only in recent
# click releases, and these keep to what every click >= 8.1 offers.


def _duration(allow_zero: bool = False) -> Callable[..., timedelta | None]:
    """A callback reading a duration such as `90s`, `15m`, `24h`, `30d`, `2w` or `1d12h`."""

    def convert(ctx: click.Context, param: click.Parameter, value: str | None) -> timedelta | None:
        if value is None:
            return None
        # The user's own words, to say back to them ("--grace 24h" is "24h", not "1d").
        ctx.meta[f"apikeys.text.{param.name}"] = value.strip()
        try:
            return parse_duration(value, allow_zero=allow_zero)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx=ctx, param=param) from None

    return convert


def _rate_limit(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Check a rate limit in `limits` notation (`100/minute`, `3 per 2 seconds`)."""
    if value is None:
        return None
    text = value.strip()
    try:
        parse_rate_limit(text)
    except InvalidKeyParameters as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return text


def _prefixes(ctx: click.Context, param: click.Parameter, values: Sequence[str]) -> tuple[str, ...]:
    """Check key prefixes: lowercase letters, digits and `_`, starting with a letter."""
    try:
        return tuple(validate_prefix(value) for value in values)
    except InvalidKeyParameters as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def _split_scopes(
    ctx: click.Context, param: click.Parameter, values: Sequence[str]
) -> tuple[str, ...]:
    """`--scope a:read --scope b:write` or `--scope a:read,b:write`, validated and sorted."""
    scopes: set[str] = set()
    for value in values:
        for scope in _SCOPE_SPLIT_RE.split(value.strip()):
            if not scope:
                continue
            try:
                scopes.add(validate_scope(scope))
            except InvalidKeyParameters as exc:
                raise click.BadParameter(str(exc), ctx=ctx, param=param) from None
    return tuple(sorted(scopes))


# -- shared plumbing ------------------------------------------------------------------------


def _safe_url(url: str) -> str:
    """`url` with its password, if any, replaced by `***`."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<the key store URL>"
    if not password:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _redact(text: str, url: str) -> str:
    """`text` with any password of `url` replaced by `***`."""
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    if password:
        for form in {password, unquote(password)}:
            text = text.replace(form, "***")
    return text


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _unavailable_reason(exc: StoreUnavailable) -> str:
    original = exc.original
    if original is None:
        return str(exc)
    detail = _first_line(str(original))
    name = type(original).__name__
    return f"{name}: {detail}" if detail else name


class _Mute(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return False


def _make_hasher(*, quiet: bool) -> Hasher:
    """`Hasher()` from the environment; `quiet` hides the missing-pepper warning.

    Commands that neither hash nor check a secret (list, show, disable …) have no use for
    that warning, and it would break their promise of one line on stderr.
    """
    if not quiet:
        return Hasher()
    logger = logging.getLogger("apikeys")
    mute = _Mute()
    logger.addFilter(mute)
    try:
        return Hasher()
    finally:
        logger.removeFilter(mute)


def _run(
    ctx: click.Context,
    work: Callable[[KeyManager], Awaitable[_T]],
    *,
    uses_secrets: bool = False,
) -> _T:
    """Open the store, run `work` with a `KeyManager` on it, and always close the manager.

    apikeys errors become exit status 1 (refusals) or 2 (bad arguments), one line each.
    """
    settings = ctx.find_object(_Settings)
    url = settings.store_url if settings is not None else DEFAULT_STORE_URL
    try:
        store = store_from_url(url)
    except Exception as exc:
        raise click.BadParameter(
            _redact(str(exc), url) or type(exc).__name__,
            ctx=ctx,
            param_hint="'--store' / APIKEYS_STORE_URL",
        ) from None
    try:
        manager = KeyManager(store, hasher=_make_hasher(quiet=not uses_secrets))
    except ConfigurationError as exc:
        raise Refused(_redact(str(exc), url)) from None

    async def session() -> _T:
        try:
            await store.setup()
            return await work(manager)
        finally:
            await manager.aclose()

    try:
        return asyncio.run(session())
    except StoreUnavailable as exc:
        reason = _redact(_unavailable_reason(exc), url)
        raise Refused(f"key store unavailable: {_safe_url(url)}: {reason}") from None
    except InvalidKeyParameters as exc:
        raise click.UsageError(str(exc), ctx) from None
    except (KeyNotFound, InvalidTransition, ConfigurationError) as exc:
        raise Refused(_redact(str(exc), url)) from None
    except APIKeyError as exc:
        raise Refused(_redact(str(exc), url) or type(exc).__name__) from None
    except Exception as exc:
        # A store error apikeys does not classify (no such database, bad credentials, …):
        # still one line, never a traceback, never the password.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        reason = _redact(f"{type(exc).__name__}: {first_line}", url)
        raise Refused(f"key store error: {_safe_url(url)}: {reason}") from None


def _key_id(value: str) -> str:
    """The key id named by an argument: an id, or a full key (whose id is used).

    Anything else is refused as an unknown id, and only echoed when it cannot be a key.
    """
    value = value.strip()
    if _KEY_ID_RE.fullmatch(value):
        return value
    try:
        return parse_key(value).id
    except MalformedAPIKey:
        pass
    if len(value) <= 2 * ID_LENGTH and value.isprintable():
        raise Refused(f"no API key with id {value!r}")
    raise Refused(f"no API key with that id: key ids are {ID_LENGTH} letters and digits")


def _when(moment: datetime | None, never: str = "never") -> str:
    """A time as UTC ISO 8601 to the second, ending in `Z`."""
    if moment is None:
        return never
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def _scopes_text(record: KeyRecord) -> str:
    return "(all)" if record.access == "full" else ", ".join(record.scopes)


def _summary(record: KeyRecord) -> list[str]:
    """The human description of a record, one `label: value` per line."""
    rows = [
        ("id", record.id),
        ("name", record.name),
        ("workspace", record.workspace),
        ("key", record.prefix),
        ("access", record.access),
        ("scopes", _scopes_text(record)),
        ("status", record.status),
        ("rate limit", record.rate_limit or "default"),
        ("created", _when(record.created_at)),
        ("expires", _when(record.expires_at)),
        ("last used", _when(record.last_used_at)),
        ("requests", str(record.request_count)),
    ]
    if record.revoked_at is not None:
        rows.append(("revoked", _when(record.revoked_at)))
    if record.replaces is not None:
        rows.append(("replaces", record.replaces))
    if record.replaced_by is not None:
        rows.append(("replaced by", record.replaced_by))
    width = max(len(label) for label, _ in rows) + 2
    return [f"{label + ':':<{width}}{value}" for label, value in rows]


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    body = [list(row) for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *body, strict=False)]
    lines = []
    for row in [list(headers), *body]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def _short(text: str, limit: int = 32) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- the commands ---------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--store",
    "store_url",
    envvar=STORE_ENV,
    default=DEFAULT_STORE_URL,
    show_default=True,
    show_envvar=True,
    metavar="URL",
    help="Key store: sqlite:///path, postgresql://…, redis://host:port/db or memory://.",
)
@click.version_option(package_name="apikeys", prog_name="apikeys")
@click.pass_context
def main(ctx: click.Context, store_url: str) -> None:
    """Manage API keys: create, list, show, disable, enable, revoke, roll, and scan for leaks.

    Keys are hashed with APIKEYS_PEPPER: use the same pepper as the service that checks
    them. A full key is printed once, by create and roll; everything else shows ak_<id>_….
    """
    ctx.obj = _Settings(store_url)


def _access_options(scope_help: str) -> Callable[[_F], _F]:
    """`--full-access` and `--scope`, as `create` and `update` take them."""

    def decorate(command: _F) -> _F:
        command = click.option(
            "--scope",
            "scopes",
            multiple=True,
            metavar="SCOPE",
            callback=_split_scopes,
            help=scope_help,
        )(command)
        return click.option(
            "--full-access", is_flag=True, help="Grant every scope, including scopes added later."
        )(command)

    return decorate


@main.command()
@click.option("--name", required=True, help="A label for the key, e.g. the integration using it.")
@click.option("--workspace", default="default", show_default=True, help="The key's workspace.")
@_access_options(
    "Grant a scope (resource:action or resource:*). Repeat it, or separate with commas."
)
@click.option(
    "--rate-limit",
    callback=_rate_limit,
    help="The key's own rate limit, e.g. '10/second' (default: the service's).",
)
@click.option(
    "--expires-in",
    callback=_duration(),
    metavar="DURATION",
    help="Expire the key after this long: 90s, 15m, 24h, 30d, 2w (default: never).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: key and record.")
@click.pass_context
def create(
    ctx: click.Context,
    name: str,
    workspace: str,
    full_access: bool,
    scopes: tuple[str, ...],
    rate_limit: str | None,
    expires_in: timedelta | None,
    as_json: bool,
) -> None:
    """Create a key and print it, once.

    The key goes alone to stdout (KEY=$(apikeys create …) works); a summary goes to stderr.
    """
    if full_access and scopes:
        raise click.UsageError(
            "--full-access and --scope exclude each other: a full-access key has every scope",
            ctx,
        )
    if not full_access and not scopes:
        raise click.UsageError(
            "pass --full-access or at least one --scope (e.g. --scope contacts:read)", ctx
        )

    async def work(manager: KeyManager) -> CreatedKey:
        return await manager.create(
            name=name,
            workspace=workspace,
            scopes=scopes,
            full_access=full_access,
            rate_limit=rate_limit,
            expires_in=expires_in,
        )

    created = _run(ctx, work, uses_secrets=True)
    if as_json:
        _echo_json(created.to_dict())
        return
    record = created.record
    click.echo(created.key)
    click.echo(
        f"Created API key {record.id} ({record.name!r}, workspace {record.workspace!r}): "
        f"{'full access' if record.access == 'full' else 'scopes ' + _scopes_text(record)}, "
        f"rate limit {record.rate_limit or 'default'}, expires {_when(record.expires_at)}.",
        err=True,
    )
    click.echo(
        f"Copy the key now: it is shown only this once. Lists show it as {record.prefix}",
        err=True,
    )


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--name", default=None, help="A new label for the key.")
@_access_options(
    "Restrict the key to these scopes (replacing its grants). Repeat it, or use commas."
)
@click.option(
    "--rate-limit",
    callback=_rate_limit,
    help="The key's own rate limit, e.g. '10/second'.",
)
@click.option(
    "--default-rate-limit",
    is_flag=True,
    help="Drop the key's own rate limit: it gets the service's default.",
)
@click.option(
    "--expires-in",
    callback=_duration(),
    metavar="DURATION",
    help="Expire the key this long from now: 90s, 15m, 24h, 30d, 2w.",
)
@click.option("--no-expiry", is_flag=True, help="Make the key never expire.")
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@click.pass_context
def update(
    ctx: click.Context,
    key_id: str,
    name: str | None,
    full_access: bool,
    scopes: tuple[str, ...],
    rate_limit: str | None,
    default_rate_limit: bool,
    expires_in: timedelta | None,
    no_expiry: bool,
    as_json: bool,
) -> None:
    """Edit a key: its name, scopes or full access, rate limit, expiry.

    Only what is given changes. Narrowing a key (fewer scopes, a sooner expiry) holds for
    its very next request, in every process. A revoked key cannot be edited.
    """
    key_id = _key_id(key_id)
    for first, second, a, b in (
        (full_access, scopes, "--full-access", "--scope"),
        (rate_limit, default_rate_limit, "--rate-limit", "--default-rate-limit"),
        (expires_in, no_expiry, "--expires-in", "--no-expiry"),
    ):
        if first and second:
            raise click.UsageError(f"{a} and {b} exclude each other", ctx)
    options: dict[str, Any] = {}
    if name is not None:
        options["name"] = name
    if full_access:
        options["full_access"] = True
    if scopes:
        options["scopes"] = scopes
    if rate_limit is not None or default_rate_limit:
        options["rate_limit"] = rate_limit
    if expires_in is not None:
        options["expires_in"] = expires_in
    if no_expiry:
        options["expires_at"] = None
    if not options:
        raise click.UsageError("say what to change: --name, --scope, --rate-limit, …", ctx)

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.update(key_id, **options)

    record = _run(ctx, work)
    if as_json:
        _echo_json(record.to_dict())
        return
    click.echo(f"Updated API key {record.id} ({record.name!r}).")
    for line in _summary(record):
        click.echo(line)


@main.command("list")
@click.option("--workspace", default=None, help="Only this workspace's keys (default: all).")
@click.option(
    "--status",
    type=click.Choice(["active", "disabled", "revoked", "expired"]),
    default=None,
    help="Only keys with this status (default: all).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of records.")
@click.pass_context
def list_keys(ctx: click.Context, workspace: str | None, status: str | None, as_json: bool) -> None:
    """List keys, oldest first, with status and usage (never a secret)."""

    async def work(manager: KeyManager) -> list[KeyRecord]:
        return await manager.list(workspace)

    records = _run(ctx, work)
    if status is not None:
        now = utcnow()
        records = [record for record in records if record.status_at(now) == status]
    if as_json:
        _echo_json([record.to_dict() for record in records])
        return
    if not records:
        where = f" in workspace {workspace!r}" if workspace is not None else ""
        which = f" {status}" if status is not None else ""
        click.echo(f"No{which} API keys{where}.")
        return
    headers = (
        "ID",
        "NAME",
        "WORKSPACE",
        "KEY",
        "ACCESS",
        "SCOPES",
        "STATUS",
        "CREATED",
        "LAST USED",
        "REQUESTS",
    )
    rows = (
        (
            record.id,
            _short(record.name),
            _short(record.workspace),
            record.prefix,
            record.access,
            _scopes_text(record),
            record.status,
            _when(record.created_at),
            _when(record.last_used_at),
            str(record.request_count),
        )
        for record in records
    )
    for line in _table(headers, rows):
        click.echo(line)


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@click.pass_context
def show(ctx: click.Context, key_id: str, as_json: bool) -> None:
    """Show one key's record (never its secret)."""
    key_id = _key_id(key_id)

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.get(key_id)

    record = _run(ctx, work)
    if as_json:
        _echo_json(record.to_dict())
        return
    for line in _summary(record):
        click.echo(line)


def _state_change(
    ctx: click.Context,
    key_id: str,
    change: Callable[[KeyManager, str], Awaitable[KeyRecord]],
    past: str,
    target: str,
) -> None:
    key_id = _key_id(key_id)

    async def work(manager: KeyManager) -> tuple[KeyRecord, KeyRecord]:
        before = await manager.get(key_id)
        return before, await change(manager, key_id)

    before, record = _run(ctx, work)
    status = record.status
    note = f" (it expired at {_when(record.expires_at)})" if status == "expired" else ""
    if before.state == target:
        # Nothing changed: say so, as `revoke` does for a key revoked before.
        shown = "disabled" if target == "disabled" else "enabled"
        click.echo(f"API key {record.id} ({record.name!r}) was already {shown}{note}.")
        return
    click.echo(f"{past} API key {record.id} ({record.name!r}): it is now {status}{note}.")


@main.command()
@click.argument("key_id", metavar="ID")
@click.pass_context
def disable(ctx: click.Context, key_id: str) -> None:
    """Stop a key from authenticating until it is enabled again."""
    _state_change(ctx, key_id, KeyManager.disable, "Disabled", "disabled")


@main.command()
@click.argument("key_id", metavar="ID")
@click.pass_context
def enable(ctx: click.Context, key_id: str) -> None:
    """Let a disabled key authenticate again (a revoked key cannot be enabled)."""
    _state_change(ctx, key_id, KeyManager.enable, "Enabled", "active")


def _interactive() -> bool:
    """Whether a person can answer a confirmation prompt on stdin."""
    stdin = sys.stdin
    return stdin is not None and stdin.isatty()


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--yes", "-y", is_flag=True, help="Revoke without asking for confirmation.")
@click.pass_context
def revoke(ctx: click.Context, key_id: str, yes: bool) -> None:
    """Revoke a key for good: every later request with it is refused.

    The key stays in the list, with status revoked. Asks for confirmation unless --yes;
    without a terminal to ask on, --yes is required.
    """
    if not yes and not _interactive():
        raise click.UsageError(
            "revoking a key cannot be undone: pass --yes to confirm (no terminal to ask on)",
            ctx,
        )
    key_id = _key_id(key_id)

    async def lookup(manager: KeyManager) -> KeyRecord:
        return await manager.get(key_id)

    record = _run(ctx, lookup)
    if record.state == REVOKED:
        click.echo(f"API key {record.id} ({record.name!r}) was already revoked.")
        return
    if not yes:
        click.confirm(
            f"Revoke API key {record.id} ({record.name!r}, workspace {record.workspace!r})? "
            "Every request with it will be refused; this cannot be undone.",
            abort=True,
            err=True,
        )

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.revoke(key_id)

    record = _run(ctx, work)
    click.echo(
        f"Revoked API key {record.id} ({record.name!r}) at {_when(record.revoked_at, 'now')}."
    )


@main.command()
@click.argument("key_id", metavar="ID")
@click.option(
    "--grace",
    callback=_duration(allow_zero=True),
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="How long the old key keeps working; 0 cuts it off now.",
)
@click.option(
    "--expires-in",
    callback=_duration(),
    metavar="DURATION",
    help="Expire the new key after this long (default: the old key's lifetime, from now).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: key and record.")
@click.pass_context
def roll(
    ctx: click.Context,
    key_id: str,
    grace: timedelta,
    expires_in: timedelta | None,
    as_json: bool,
) -> None:
    """Replace a key with a new one of the same name, workspace, access, scopes and limit.

    The new key is printed once; the old one keeps working for the grace period, then
    expires. The new key lives as long as the old one did (a 30-day key gives a 30-day
    key, from now), unless --expires-in says otherwise. With --json, `replaces` is the
    old key's id and `replaced` its record.
    """
    key_id = _key_id(key_id)

    async def work(manager: KeyManager) -> tuple[CreatedKey, KeyRecord]:
        created = await manager.roll(key_id, grace, expires_in=expires_in)
        return created, await manager.get(key_id)

    created, old = _run(ctx, work, uses_secrets=True)
    if as_json:
        _echo_json({**created.to_dict(), "replaced": old.to_dict()})
        return
    record = created.record
    click.echo(created.key)
    click.echo(
        f"Rolled API key {old.id} ({old.name!r}): the new key is {record.id}, "
        f"shown only this once. Lists show it as {record.prefix}",
        err=True,
    )
    if record.expires_at is None:
        lifetime = "The new key does not expire."
    elif expires_in is not None:
        given = ctx.meta.get("apikeys.text.expires_in") or format_duration(expires_in)
        lifetime = f"The new key expires at {_when(record.expires_at)} (in {given})."
    else:
        lifetime = (
            f"The new key expires at {_when(record.expires_at)}: the same lifetime as the "
            "key it replaces."
        )
    click.echo(lifetime, err=True)
    status = old.status
    if status == "active":
        grace_text = ctx.meta.get("apikeys.text.grace") or format_duration(grace)
        click.echo(
            f"The old key {old.prefix} keeps working until {_when(old.expires_at)} "
            f"(grace {grace_text}), then expires.",
            err=True,
        )
    else:
        click.echo(f"The old key {old.prefix} is {status} and no longer works.", err=True)


# -- scan -----------------------------------------------------------------------------------


@main.command()
@click.argument(
    "paths",
    nargs=-1,
    required=True,
    type=click.Path(exists=True, allow_dash=True, path_type=str),
)
@click.option("--revoke", "revoke_keys", is_flag=True, help="Revoke every key found in the store.")
@click.option(
    "--prefix",
    "prefixes",
    callback=_prefixes,
    multiple=True,
    default=(DEFAULT_PREFIX,),
    show_default=True,
    help="The key prefix to look for; repeat for several.",
)
@click.pass_context
def scan(
    ctx: click.Context, paths: tuple[str, ...], revoke_keys: bool, prefixes: tuple[str, ...]
) -> None:
    """Find API keys in files and folders (- reads stdin); exit 1 when any is found.

    Reports file:line and the masked key, never the secret. Only tokens with a valid
    checksum count; binary files, files over 10 MiB and .git, .venv, node_modules and
    __pycache__ folders are skipped. --revoke revokes each key found whose secret matches
    the store.
    """
    pattern = key_pattern(prefixes)
    stats = ScanStats()
    findings: list[Finding] = []
    for root in paths:
        for path in walk(root):
            data = read_text_file(path, stats)
            if data is None:
                continue
            shown = "<stdin>" if path == "-" else path
            findings.extend(Finding(shown, line, key) for line, key in find_keys(data, pattern))
    for finding in findings:
        click.echo(
            f"{click.format_filename(finding.path)}:{finding.line}: "
            f"{mask(finding.key.prefix, finding.key.id)}"
        )
    skipped = f", skipped {stats.skipped} binary or large" if stats.skipped else ""
    files = f"scanned {stats.files} file{'' if stats.files == 1 else 's'}{skipped}"
    if not findings:
        click.echo(f"No API keys found ({files}).", err=True)
        return
    unique = list({finding.key.token: finding.key for finding in findings}.values())
    click.echo(
        f"Found {len(findings)} API key{'' if len(findings) == 1 else 's'} "
        f"({len(unique)} distinct; {files}).",
        err=True,
    )
    if revoke_keys:

        async def work(manager: KeyManager) -> dict[str, str]:
            return await revoke_found(manager, unique)

        outcomes = _run(ctx, work, uses_secrets=True)
        # One verdict per finding, with its place: two findings of one id may be two keys.
        for finding in findings:
            click.echo(
                f"{click.format_filename(finding.path)}:{finding.line}: "
                f"{mask(finding.key.prefix, finding.key.id)}: {outcomes[finding.key.token]}"
            )
    ctx.exit(1)


if __name__ == "__main__":  # pragma: no cover - `python -m apikeys.cli`
    main(prog_name="apikeys")
