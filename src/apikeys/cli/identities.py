"""`apikeys identities create|list|show|update|disable|enable|revoke`: the identities that
group one customer's keys (CONTRACT section 13).

The options of `create` and `update` are made from the identity's field table
(`apikeys.identities.IDENTITY_FIELDS`): one per field the operator sets, `--rate-limit`
repeated for named limits, and on `update` a `--no-<field>` that clears each. Bad text
exits 2 naming its option; an unknown id, or enabling a revoked identity, exits 1.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import click

from apikeys.cli.common import (
    actor_of,
    actor_option,
    echo_json,
    format_time,
    main,
    rate_limit_callback,
    run_with_manager,
    shorten,
    table_lines,
)
from apikeys.errors import InvalidKeyParameters
from apikeys.identities import (
    EDITABLE_FIELDS,
    IdentityRecord,
    check_identity_id,
    identity_changes,
)
from apikeys.manager import KeyManager
from apikeys.types import REVOKED, KeyField, Kind, utcnow

__all__ = ["identity_id_callback", "identity_lines", "identity_option"]


def identity_id_callback(
    ctx: click.Context, param: click.Parameter, value: str | None
) -> str | None:
    """An identity id argument or option, checked (`check_identity_id`): exit 2 naming it."""
    if value is None:
        return None
    try:
        return check_identity_id(value.strip())
    except InvalidKeyParameters as exc:
        raise click.BadParameter(str(exc), ctx=ctx, param=param) from None


def identity_option(help_text: str) -> Callable[[Any], Any]:
    """`--identity ID` of the key commands (`create`, `update`, `list`), checked."""
    return click.option(
        "--identity", default=None, metavar="ID", callback=identity_id_callback, help=help_text
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _field_option(field: KeyField) -> Callable[[Any], Any]:
    """The option that sets `field` of an identity, made from its entry in the table."""
    help_text = field.description[:1].upper() + field.description[1:] + "."
    if field.name == "rate_limit":
        return click.option(
            "--rate-limit",
            "rate_limit",
            callback=rate_limit_callback,
            multiple=True,
            metavar="LIMIT",
            help=f"{help_text} E.g. 1000/hour; repeat for named ones: burst=10/second.",
        )
    return click.option(
        _flag(field.name),
        field.name,
        type=click.IntRange(min=0) if field.kind is Kind.COUNT else None,
        default=None,
        metavar={Kind.OBJECT: "JSON", Kind.COUNT: "N"}.get(field.kind),
        help=help_text,
    )


def _field_options(*, editing: bool) -> Callable[[Any], Any]:
    def decorate(command: Any) -> Any:
        options = [_field_option(field) for field in EDITABLE_FIELDS.values()]
        if editing:
            options += [
                click.option(
                    "--no-" + name.replace("_", "-"),
                    f"clear_{name}",
                    is_flag=True,
                    help=f"Clear the {name.replace('_', ' ')}.",
                )
                for name in EDITABLE_FIELDS
            ]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def _changes(ctx: click.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The fields the options ask to set (and, on `update`, clear), each checked on its own
    so that a bad one exits 2 naming its option."""
    changes: dict[str, Any] = {}
    now = utcnow()
    for name in EDITABLE_FIELDS:
        value = values.get(name)
        cleared = values.get(f"clear_{name}", False)
        if value is not None and cleared:
            raise click.UsageError(f"{_flag(name)} and --no-{_flag(name)[2:]} exclude each other")
        if value is not None:
            try:
                identity_changes({name: value}, now)
            except InvalidKeyParameters as exc:
                raise click.BadParameter(str(exc), ctx, param_hint=f"'{_flag(name)}'") from None
            changes[name] = value
        elif cleared:
            changes[name] = None
    return changes


@main.group()
def identities() -> None:
    """Identities: one customer's keys, sharing limits and credits, turned off together."""


@identities.command("create")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@click.option("--workspace", default="default", show_default=True, help="Its workspace.")
@_field_options(editing=False)
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print the identity as one JSON object.")
@click.pass_context
def create_identity(
    ctx: click.Context,
    /,
    identity_id: str,
    workspace: str,
    actor: str | None,
    as_json: bool,
    **fields: Any,
) -> None:
    """Create an identity: ID is your application's id for the customer (1 to 64 letters,
    digits and . _ @ + -). Keys join it with `apikeys create --identity ID`."""
    changes = _changes(ctx, fields)
    who = actor_of(actor)

    async def work(manager: KeyManager) -> IdentityRecord:
        return await manager.create_identity(identity_id, workspace=workspace, actor=who, **changes)

    record = run_with_manager(ctx, work)
    if as_json:
        echo_json(record.to_dict())
        return
    click.echo(f"Created identity {record.id} (workspace {record.workspace!r}).")


@identities.command("list")
@click.option("--workspace", default=None, help="Only this workspace's identities.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of identities.")
@click.pass_context
def list_identities(ctx: click.Context, workspace: str | None, as_json: bool) -> None:
    """List identities, oldest first."""

    async def work(manager: KeyManager) -> list[IdentityRecord]:
        return await manager.list_identities(workspace)

    records = run_with_manager(ctx, work)
    if as_json:
        echo_json([record.to_dict() for record in records])
        return
    if not records:
        where = f" in workspace {workspace!r}" if workspace is not None else ""
        click.echo(f"No identities{where}.")
        return
    headers = ("ID", "NAME", "WORKSPACE", "STATUS", "RATE LIMIT", "CREDITS", "CREATED")
    rows = (
        (
            record.id,
            shorten(record.name or ""),
            shorten(record.workspace),
            record.status,
            record.rate_limit or "none",
            "unlimited" if record.credits is None else str(record.credits),
            format_time(record.created_at),
        )
        for record in records
    )
    for line in table_lines(headers, rows):
        click.echo(line)


def identity_lines(record: IdentityRecord, keys: int) -> list[str]:
    """The human description of an identity, one `label: value` per line."""
    rows = [
        ("id", record.id),
        ("name", record.name or ""),
        ("workspace", record.workspace),
        ("status", record.status),
        ("rate limit", record.rate_limit or "none"),
        ("credits", "unlimited" if record.credits is None else str(record.credits)),
        ("created", format_time(record.created_at)),
        ("keys", str(keys)),
    ]
    if record.credit_refill is not None:
        rows.append(("refill", record.credit_refill))
    if record.metadata:
        rows.append(("metadata", json.dumps(dict(record.metadata), ensure_ascii=False)))
    if record.revoked_at is not None:
        rows.append(("revoked", format_time(record.revoked_at)))
    width = max(len(label) for label, _ in rows) + 2
    return [f"{label + ':':<{width}}{value}" for label, value in rows]


@identities.command("show")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@click.option("--json", "as_json", is_flag=True, help="Print the identity as one JSON object.")
@click.pass_context
def show_identity(ctx: click.Context, identity_id: str, as_json: bool) -> None:
    """Show one identity, and how many keys belong to it."""

    async def work(manager: KeyManager) -> tuple[IdentityRecord, int]:
        record = await manager.get_identity(identity_id)
        keys = await manager.list(record.workspace, identity=identity_id)
        return record, len(keys)

    record, keys = run_with_manager(ctx, work)
    if as_json:
        echo_json({**record.to_dict(), "keys": keys})
        return
    for line in identity_lines(record, keys):
        click.echo(line)


@identities.command("update")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@_field_options(editing=True)
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print the identity as one JSON object.")
@click.pass_context
def update_identity(
    ctx: click.Context,
    /,
    identity_id: str,
    actor: str | None,
    as_json: bool,
    **fields: Any,
) -> None:
    """Edit an identity: only what is given changes. A revoked identity cannot be edited."""
    changes = _changes(ctx, fields)
    if not changes:
        raise click.UsageError("say what to change: --name, --rate-limit, --credits, …", ctx)
    who = actor_of(actor)

    async def work(manager: KeyManager) -> IdentityRecord:
        return await manager.update_identity(identity_id, actor=who, **changes)

    record = run_with_manager(ctx, work)
    if as_json:
        echo_json(record.to_dict())
        return
    click.echo(f"Updated identity {record.id}.")


def _state_change(
    ctx: click.Context,
    identity_id: str,
    change: Callable[..., Awaitable[IdentityRecord]],
    past: str,
    target: str,
    actor: str | None,
) -> None:
    who = actor_of(actor)

    async def work(manager: KeyManager) -> tuple[IdentityRecord, IdentityRecord]:
        before = await manager.get_identity(identity_id)
        return before, await change(manager, identity_id, actor=who)

    before, record = run_with_manager(ctx, work)
    if before.state == target:
        click.echo(f"Identity {record.id} was already {record.status}.")
        return
    click.echo(f"{past} identity {record.id}: it is now {record.status}.")


@identities.command("disable")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@actor_option
@click.pass_context
def disable_identity(ctx: click.Context, identity_id: str, actor: str | None) -> None:
    """Turn an identity off: its keys are refused until it is enabled again."""
    _state_change(ctx, identity_id, KeyManager.disable_identity, "Disabled", "disabled", actor)


@identities.command("enable")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@actor_option
@click.pass_context
def enable_identity(ctx: click.Context, identity_id: str, actor: str | None) -> None:
    """Turn a disabled identity on again (a revoked one cannot be)."""
    _state_change(ctx, identity_id, KeyManager.enable_identity, "Enabled", "active", actor)


@identities.command("revoke")
@click.argument("identity_id", metavar="ID", callback=identity_id_callback)
@click.option("--yes", "-y", is_flag=True, help="Revoke without asking for confirmation.")
@actor_option
@click.pass_context
def revoke_identity(ctx: click.Context, identity_id: str, yes: bool, actor: str | None) -> None:
    """Revoke an identity for good: its keys are refused, and it cannot be enabled again.

    Asks for confirmation unless --yes; without a terminal to ask on, --yes is required.
    """
    if not yes and not (sys.stdin is not None and sys.stdin.isatty()):
        raise click.UsageError(
            "revoking an identity cannot be undone: pass --yes to confirm (no terminal to ask on)",
            ctx,
        )
    if not yes:
        click.confirm(
            f"Revoke identity {identity_id}? Every key of it will be refused; this cannot be "
            "undone.",
            abort=True,
            err=True,
        )
    who = actor_of(actor)

    async def work(manager: KeyManager) -> tuple[IdentityRecord, IdentityRecord]:
        before = await manager.get_identity(identity_id)
        if before.state == REVOKED:
            return before, before
        return before, await manager.revoke_identity(identity_id, actor=who)

    before, record = run_with_manager(ctx, work)
    if before.state == REVOKED:
        click.echo(f"Identity {record.id} was already revoked.")
        return
    click.echo(f"Revoked identity {record.id} at {format_time(record.revoked_at, 'now')}.")
