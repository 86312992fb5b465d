"""What the commands share: the `apikeys` group, option callbacks, running a command on a
store, and printing records."""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, TypeVar

import click

from apikeys.durations import parse_duration
from apikeys.errors import (
    APIKeyError,
    ConfigurationError,
    InvalidKeyParameters,
    InvalidTransition,
    KeyNotFound,
    MalformedAPIKey,
    StoreUnavailable,
)
from apikeys.fields import KEY_FIELDS
from apikeys.hashing import Hasher
from apikeys.keys import (
    BASE62,
    ID_LENGTH,
    parse_key,
    validate_prefix,
)
from apikeys.manager import STORE_URL_ENV, KeyManager
from apikeys.policies import POLICY_PARSERS
from apikeys.ratelimit import format_policies, parse_policies
from apikeys.redaction import failure_reason, redact, safe_url
from apikeys.scopes import validate_scope
from apikeys.stores.registry import store_from_url
from apikeys.types import KeyRecord, Kind

__all__ = [
    "Refused",
    "access_options",
    "actor_of",
    "actor_option",
    "check_new_access",
    "duration_callback",
    "echo_json",
    "format_time",
    "key_id_of",
    "main",
    "policy_changes",
    "policy_options",
    "prefixes_callback",
    "rate_limit_callback",
    "run_with_manager",
    "scopes_text",
    "shorten",
    "summary_lines",
    "table_lines",
]


STORE_ENV = STORE_URL_ENV
DEFAULT_STORE_URL = "sqlite:///apikeys.db"

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])
_KEY_ID_RE = re.compile(f"[{re.escape(BASE62)}]{{{ID_LENGTH}}}")
_SCOPE_SPLIT_RE = re.compile(r"[\s,]+")


class Refused(click.ClickException):
    """The command was understood but cannot be carried out: exit status 1, one line on stderr."""

    exit_code = 1


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment or the password database
        return "unknown"


def actor_option(command: _F) -> _F:
    """`--actor NAME`: who makes the change, for the audit trail (default: the OS user)."""
    return click.option(
        "--actor",
        default=None,
        metavar="NAME",
        help="Who makes the change, for the audit trail (default: your OS user name).",
    )(command)


def actor_of(actor: str | None) -> str:
    """The actor recorded: `--actor` as given, else `cli:<OS user>`."""
    if actor is not None:
        if not actor.strip() or len(actor) > 200 or not actor.isprintable():
            raise click.BadParameter("give a printable name", param_hint="'--actor'")
        return actor
    return f"cli:{_os_user()}"


@dataclass(frozen=True, slots=True)
class _PolicyOption:
    """How the command line spells one policy field of `POLICY_PARSERS`: its option, and
    (`update`) the flag that clears it."""

    flag: str
    help: str
    metavar: str | None = None
    clear: str | None = None
    clear_help: str = ""


# The spellings the CLI has always had; any other policy field is spelled after its name
# (`--allowed-origins`, cleared by `--no-allowed-origins`) with its description as help.
_SPELLED: Final[Mapping[str, _PolicyOption]] = {
    "owner": _PolicyOption(
        "--owner",
        "Who the key is for (a user id, an e-mail).",
        clear="--no-owner",
        clear_help="Clear the owner.",
    ),
    "metadata": _PolicyOption(
        "--metadata",
        "A JSON object for your application (at most 4 KiB). Never a secret.",
        metavar="JSON",
        clear="--no-metadata",
        clear_help="Clear the metadata.",
    ),
    "allowed_ips": _PolicyOption(
        "--allow-ip",
        "Accept the key only from these addresses (IPv4 or IPv6 CIDR); repeat it.",
        metavar="CIDR",
        clear="--any-ip",
        clear_help="Accept the key from any address.",
    ),
    "credits": _PolicyOption(
        "--credits",
        "Uses left: one is spent per admitted request (default: unlimited).",
        clear="--unlimited",
        clear_help="No credits: the key is not counted down.",
    ),
    "credit_refill": _PolicyOption(
        "--credit-refill",
        "Set credits back to N every UTC day or month: 1000/day, 5000/month.",
        metavar="N/PERIOD",
    ),
}
# What clearing a field clears with it: a key without credits has no refill.
_CLEARED_WITH: Final[Mapping[str, tuple[str, ...]]] = {"credits": ("credit_refill",)}


def _spelling(name: str) -> _PolicyOption:
    spelled = _SPELLED.get(name)
    if spelled is not None:
        return spelled
    field = KEY_FIELDS[name]
    flag = "--" + name.replace("_", "-")
    return _PolicyOption(
        flag,
        field.description[:1].upper() + field.description[1:] + ".",
        metavar={Kind.OBJECT: "JSON", Kind.TIME: "TIME"}.get(field.kind),
        clear="--no-" + name.replace("_", "-"),
        clear_help=f"Clear the {name.replace('_', ' ')}.",
    )


def _option(name: str, spelled: _PolicyOption) -> Callable[[_F], _F]:
    kind = KEY_FIELDS[name].kind
    if kind is Kind.NAMES:
        return click.option(
            spelled.flag, name, multiple=True, metavar=spelled.metavar, help=spelled.help
        )
    return click.option(
        spelled.flag,
        name,
        type=click.IntRange(min=0) if kind is Kind.COUNT else None,
        default=None,
        metavar=spelled.metavar,
        help=spelled.help,
    )


def policy_options(*, editing: bool) -> Callable[[_F], _F]:
    """An option per policy field (`apikeys.policies.POLICY_PARSERS`), as `create` and
    `update` take them: `--owner`, `--metadata`, `--allow-ip`, `--credits`,
    `--credit-refill`; `update` also takes the flag that clears each (`--no-owner`,
    `--no-metadata`, `--any-ip`, `--unlimited`)."""

    def decorate(command: _F) -> _F:
        spellings = {name: _spelling(name) for name in POLICY_PARSERS}
        options = [_option(name, spelled) for name, spelled in spellings.items()]
        if editing:
            options += [
                click.option(spelled.clear, f"clear_{name}", is_flag=True, help=spelled.clear_help)
                for name, spelled in spellings.items()
                if spelled.clear is not None
            ]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def policy_changes(ctx: click.Context, values: dict[str, Any], *, editing: bool) -> dict[str, Any]:
    """The `KeyManager.create`/`update` arguments the policy options ask for."""
    changes: dict[str, Any] = {}
    for name in POLICY_PARSERS:
        value = values.get(name)
        if value is None or value == ():
            continue
        if KEY_FIELDS[name].kind is Kind.OBJECT:
            # Measured and parsed by its parser (check_metadata), bounded before json.loads.
            try:
                value = POLICY_PARSERS[name](value)
            except InvalidKeyParameters as exc:
                flag = _spelling(name).flag
                raise click.BadParameter(str(exc), ctx, param_hint=f"'{flag}'") from None
        changes[name] = list(value) if isinstance(value, tuple) else value
    if editing:
        _clear(ctx, values, changes)
    return changes


def _clear(ctx: click.Context, values: dict[str, Any], changes: dict[str, Any]) -> None:
    for name in POLICY_PARSERS:
        if not values.get(f"clear_{name}"):
            continue
        spelled = _spelling(name)
        if name in changes:
            raise click.UsageError(f"{spelled.flag} and {spelled.clear} exclude each other", ctx)
        changes[name] = None
        for other in _CLEARED_WITH.get(name, ()):
            changes[other] = None


@dataclass(frozen=True, slots=True)
class _Settings:
    store_url: str


# -- option callbacks ------------------------------------------------------------------------
# Callbacks rather than `click.ParamType` subclasses: `ParamType` is generic only in recent
# click releases, and these keep to what every click >= 8.1 offers.


def duration_callback(allow_zero: bool = False) -> Callable[..., timedelta | None]:
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


def rate_limit_callback(
    ctx: click.Context, param: click.Parameter, values: Sequence[str]
) -> str | None:
    """The key's limits as one text: `--rate-limit 100/minute`, or named and repeated,
    `--rate-limit burst=10/second --rate-limit daily=10000/day` (or one comma-separated)."""
    if not values:
        return None
    text = ", ".join(value.strip() for value in values)
    try:
        return format_policies(parse_policies(text))
    except InvalidKeyParameters as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def prefixes_callback(
    ctx: click.Context, param: click.Parameter, values: Sequence[str]
) -> tuple[str, ...]:
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


_safe_url = safe_url
_redact = redact


def _unavailable_reason(exc: StoreUnavailable) -> str:
    original = exc.original
    if original is None:
        return str(exc)
    reason = failure_reason(original)
    return f"{reason}; {exc.hint}" if exc.hint else reason


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


def run_with_manager(
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
        # A command's process exits at once: the long-running processes deliver webhooks.
        manager = KeyManager(store, hasher=_make_hasher(quiet=not uses_secrets), webhooks=False)
    except ConfigurationError as exc:
        raise Refused(_redact(str(exc), url)) from None

    async def session() -> _T:
        try:
            if uses_secrets:
                await manager.setup()  # also refuses a pepper other than the store's
            else:
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


def key_id_of(value: str) -> str:
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


def format_time(moment: datetime | None, never: str = "never") -> str:
    """A time as UTC ISO 8601 to the second, ending in `Z`."""
    if moment is None:
        return never
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def echo_json(data: Any) -> None:
    """Print `data` to stdout as indented JSON (what `--json` prints)."""
    click.echo(json.dumps(data, indent=2))


def scopes_text(record: KeyRecord) -> str:
    """A key's scopes for a person: comma-separated, or `(all)` for a full-access key."""
    return "(all)" if record.access == "full" else ", ".join(record.scopes)


def summary_lines(record: KeyRecord) -> list[str]:
    """The human description of a record, one `label: value` per line."""
    rows = [
        ("id", record.id),
        ("name", record.name),
        ("workspace", record.workspace),
        ("key", record.prefix),
        ("environment", record.environment),
        ("access", record.access),
        ("scopes", scopes_text(record)),
        ("status", record.status),
        ("rate limit", record.rate_limit or "default"),
        ("created", format_time(record.created_at)),
        ("expires", format_time(record.expires_at)),
        ("last used", format_time(record.last_used_at)),
        ("requests", str(record.request_count)),
    ]
    if record.revoked_at is not None:
        rows.append(("revoked", format_time(record.revoked_at)))
    if record.replaces is not None:
        rows.append(("replaces", record.replaces))
    if record.replaced_by is not None:
        rows.append(("replaced by", record.replaced_by))
    if record.owner is not None:
        rows.append(("owner", record.owner))
    if record.metadata:
        rows.append(("metadata", json.dumps(dict(record.metadata), ensure_ascii=False)))
    if record.allowed_ips:
        rows.append(("allowed IPs", ", ".join(record.allowed_ips)))
    if record.credits is not None:
        refill = f" (refilled to {record.credit_refill})" if record.credit_refill else ""
        rows.append(("credits", f"{record.credits}{refill}"))
    if record.imported_prefix is not None:
        rows.append(("old prefix", record.imported_prefix))
    if record.identity is not None:
        rows.append(("identity", record.identity))
    width = max(len(label) for label, _ in rows) + 2
    return [f"{label + ':':<{width}}{value}" for label, value in rows]


def table_lines(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """`rows` under `headers` as lines of left-aligned columns, two spaces apart."""
    body = [list(row) for row in rows]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *body, strict=False)]
    lines = []
    for row in [list(headers), *body]:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def shorten(text: str, limit: int = 32) -> str:
    """`text` cut to `limit` characters, ending in `…` when it was cut (for table cells)."""
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
    help=(
        "Key store: sqlite:///path, postgresql://…, redis://host:port/db, "
        "redis+sentinel://host:port[,…]/service, redis+cluster://host:port[,…] or memory://."
    ),
)
@click.version_option(package_name="apikeys", prog_name="apikeys")
@click.pass_context
def main(ctx: click.Context, store_url: str) -> None:
    """Manage API keys: create, list, show, disable, enable, revoke, roll, and scan for leaks.

    Keys are hashed with APIKEYS_PEPPER: use the same pepper as the service that checks
    them. A full key is printed once, by create and roll; everything else shows ak_<id>_….
    """
    ctx.obj = _Settings(store_url)


def access_options(scope_help: str) -> Callable[[_F], _F]:
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


def check_new_access(ctx: click.Context, full_access: bool, scopes: Sequence[str]) -> None:
    """The access of a key being made (`create`, `import`): full, or at least one scope."""
    if full_access and scopes:
        raise click.UsageError(
            "--full-access and --scope exclude each other: a full-access key has every scope",
            ctx,
        )
    if not full_access and not scopes:
        raise click.UsageError(
            "pass --full-access or at least one --scope (e.g. --scope contacts:read)", ctx
        )
