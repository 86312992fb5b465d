"""`apikeys audit`: who changed which key, and when."""

from __future__ import annotations

from datetime import timedelta

import click

from apikeys.cli.common import (
    duration_callback,
    echo_json,
    format_time,
    key_id_of,
    main,
    run_with_manager,
    table_lines,
)
from apikeys.cli.identities import identity_id_callback
from apikeys.manager import KeyManager
from apikeys.types import AuditEvent, identity_subject, utcnow

__all__: list[str] = []


def _changes_text(event: AuditEvent, limit: int = 60) -> str:
    text = ", ".join(f"{name}={value}" for name, value in event.changes.items())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@main.command()
@click.option("--workspace", default=None, help="Only this workspace's keys (default: all).")
@click.option("--key", "key_id", default=None, metavar="ID", help="Only this key's events.")
@click.option(
    "--identity",
    default=None,
    metavar="ID",
    callback=identity_id_callback,
    help="Only this identity's events (identity.created, identity.disabled, …).",
)
@click.option(
    "--since",
    callback=duration_callback(),
    metavar="DURATION",
    help="Only events of the last DURATION: 24h, 7d, 2w (default: all).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=100_000),
    default=1000,
    show_default=True,
    help="At most this many events, the newest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of events.")
@click.pass_context
def audit(
    ctx: click.Context,
    workspace: str | None,
    key_id: str | None,
    identity: str | None,
    since: timedelta | None,
    limit: int,
    as_json: bool,
) -> None:
    """Show the audit trail: every change to a key or an identity, oldest first, with who
    made it.

    Events of keys are created, imported, updated, disabled, enabled, rolled, revoked,
    rehashed and leak_revoked; of identities (key i:<id>), identity.created, .updated,
    .disabled, .enabled and .revoked. They never hold a secret or a hash.
    """
    if key_id is not None and identity is not None:
        raise click.UsageError("--key and --identity exclude each other", ctx)
    wanted = key_id_of(key_id) if key_id is not None else None
    if identity is not None:
        wanted = identity_subject(identity)
    start = utcnow() - since if since is not None else None

    async def work(manager: KeyManager) -> list[AuditEvent]:
        return await manager.audit(workspace=workspace, key_id=wanted, since=start, limit=limit)

    events = run_with_manager(ctx, work)
    if as_json:
        echo_json([event.to_dict() for event in events])
        return
    if not events:
        click.echo("No events.", err=True)
        return
    rows = [
        (format_time(e.time), e.key_id, e.workspace, e.action, e.actor or "-", _changes_text(e))
        for e in events
    ]
    for line in table_lines(("time", "key", "workspace", "action", "actor", "changes"), rows):
        click.echo(line)
