"""The commands that issue and change keys: create, update, list, show, disable, enable,
revoke and roll."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import click

from apikeys.cli.common import (
    access_options,
    actor_of,
    actor_option,
    check_new_access,
    duration_callback,
    echo_json,
    format_time,
    key_id_of,
    main,
    policy_changes,
    policy_options,
    rate_limit_callback,
    run_with_manager,
    scopes_text,
    shorten,
    summary_lines,
    table_lines,
)
from apikeys.cli.identities import identity_option
from apikeys.durations import format_duration
from apikeys.listing import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE, STATUSES, KeyPage
from apikeys.manager import KeyManager
from apikeys.types import ENVIRONMENTS, LIVE, REVOKED, CreatedKey, Environment, KeyRecord, Status

"""`create` and `roll`: the key was made and printed, but its store's replicas did not
confirm it in time (a failover could lose it)."""

__all__: list[str] = []


@main.command()
@click.option("--name", required=True, help="A label for the key, e.g. the integration using it.")
@click.option("--workspace", default="default", show_default=True, help="The key's workspace.")
@access_options(
    "Grant a scope (resource:action or resource:*). Repeat it, or separate with commas."
)
@click.option(
    "--rate-limit",
    callback=rate_limit_callback,
    multiple=True,
    metavar="LIMIT",
    help="The key's own rate limit, e.g. '10/second' (default: the service's); several, "
    "named: --rate-limit burst=10/second --rate-limit daily=10000/day.",
)
@click.option(
    "--expires-in",
    callback=duration_callback(),
    metavar="DURATION",
    help="Expire the key after this long: 90s, 15m, 24h, 30d, 2w (default: never).",
)
@policy_options(editing=False)
@click.option(
    "--environment",
    type=click.Choice(list(ENVIRONMENTS)),
    default=LIVE,
    show_default=True,
    help="A live key (ak_live_…) or a test key (ak_test_…); it never changes.",
)
@identity_option("Make it a key of this identity of its workspace (apikeys identities).")
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: key and record.")
@click.pass_context
def create(
    ctx: click.Context,
    /,
    name: str,
    workspace: str,
    full_access: bool,
    scopes: tuple[str, ...],
    rate_limit: str | None,
    expires_in: timedelta | None,
    environment: Environment,
    identity: str | None,
    actor: str | None,
    as_json: bool,
    **policies: Any,
) -> None:
    """Create a key and print it, once.

    The key goes alone to stdout (KEY=$(apikeys create …) works); a summary goes to stderr.
    """
    check_new_access(ctx, full_access, scopes)

    policy = policy_changes(ctx, policies, editing=False)

    async def work(manager: KeyManager) -> CreatedKey:
        return await manager.create(
            name=name,
            workspace=workspace,
            scopes=scopes,
            full_access=full_access,
            rate_limit=rate_limit,
            expires_in=expires_in,
            environment=environment,
            identity=identity,
            actor=actor_of(actor),
            **policy,
        )

    created = run_with_manager(ctx, work, uses_secrets=True)
    if as_json:
        echo_json(created.to_dict())
        _warn_if_unconfirmed(created)
        return
    record = created.record
    click.echo(created.key)
    click.echo(
        f"Created {record.environment} API key {record.id} ({record.name!r}, "
        f"workspace {record.workspace!r}): "
        f"{'full access' if record.access == 'full' else 'scopes ' + scopes_text(record)}, "
        f"rate limit {record.rate_limit or 'default'}, expires {format_time(record.expires_at)}.",
        err=True,
    )
    click.echo(
        f"Copy the key now: it is shown only this once. Lists show it as {record.prefix}",
        err=True,
    )
    _warn_if_unconfirmed(created)


def _warn_if_unconfirmed(created: CreatedKey) -> None:
    """A new key its store's replicas did not confirm: printed all the same (it works, and
    cannot be shown again), then a warning on stderr; the exit status stays 0, since the
    key was made and shown (a script that stops on a non-zero status would lose it)."""
    if created.warning is None:
        return
    click.echo(
        f"Warning: {created.warning}. The key above works, but may not survive a failover: "
        f"check later that `apikeys show {created.record.id}` finds it, and create another if not.",
        err=True,
    )


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--name", default=None, help="A new label for the key.")
@access_options(
    "Restrict the key to these scopes (replacing its grants). Repeat it, or use commas."
)
@click.option(
    "--rate-limit",
    callback=rate_limit_callback,
    multiple=True,
    metavar="LIMIT",
    help="The key's own rate limit, e.g. '10/second'; repeat for several named limits.",
)
@click.option(
    "--default-rate-limit",
    is_flag=True,
    help="Drop the key's own rate limit: it gets the service's default.",
)
@click.option(
    "--expires-in",
    callback=duration_callback(),
    metavar="DURATION",
    help="Expire the key this long from now: 90s, 15m, 24h, 30d, 2w.",
)
@click.option("--no-expiry", is_flag=True, help="Make the key never expire.")
@policy_options(editing=True)
@identity_option("Move the key to this identity of its workspace.")
@click.option("--no-identity", is_flag=True, help="Take the key out of its identity.")
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@click.pass_context
def update(
    ctx: click.Context,
    /,
    key_id: str,
    name: str | None,
    full_access: bool,
    scopes: tuple[str, ...],
    rate_limit: str | None,
    default_rate_limit: bool,
    expires_in: timedelta | None,
    no_expiry: bool,
    identity: str | None,
    no_identity: bool,
    actor: str | None,
    as_json: bool,
    **policies: Any,
) -> None:
    """Edit a key: its name, scopes or full access, rate limit, expiry, and its policies:
    owner, metadata, allowed addresses, credits, identity.

    Only what is given changes. Narrowing a key (fewer scopes, a sooner expiry) holds for
    its very next request, in every process. A revoked key cannot be edited.
    """
    key_id = key_id_of(key_id)
    for first, second, a, b in (
        (full_access, scopes, "--full-access", "--scope"),
        (rate_limit, default_rate_limit, "--rate-limit", "--default-rate-limit"),
        (expires_in, no_expiry, "--expires-in", "--no-expiry"),
        (identity, no_identity, "--identity", "--no-identity"),
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
    if identity is not None or no_identity:
        options["identity"] = identity
    options.update(policy_changes(ctx, policies, editing=True))
    if not options:
        raise click.UsageError("say what to change: --name, --scope, --rate-limit, …", ctx)

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.update(key_id, actor=actor_of(actor), **options)

    record = run_with_manager(ctx, work)
    if as_json:
        echo_json(record.to_dict())
        return
    click.echo(f"Updated API key {record.id} ({record.name!r}).")
    for line in summary_lines(record):
        click.echo(line)


@main.command("list")
@click.option("--workspace", default=None, help="Only this workspace's keys (default: all).")
@click.option("--owner", default=None, help="Only keys with this owner.")
@click.option(
    "--status",
    type=click.Choice(list(STATUSES)),
    default=None,
    help="Only keys with this status (default: all).",
)
@click.option(
    "--environment",
    type=click.Choice(list(ENVIRONMENTS)),
    default=None,
    help="Only live keys, or only test keys (default: both).",
)
@identity_option("Only the keys of this identity.")
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_PAGE_SIZE),
    default=None,
    help=f"Print one page of at most this many keys (1 to {MAX_PAGE_SIZE}), and its cursor.",
)
@click.option(
    "--cursor",
    default=None,
    help="Print the page that starts here: the cursor a previous page printed.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print a JSON array of records; a page as {"data": [...], "next_cursor": ...}.',
)
@click.pass_context
def list_keys(
    ctx: click.Context,
    workspace: str | None,
    owner: str | None,
    status: Status | None,
    environment: Environment | None,
    identity: str | None,
    limit: int | None,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List keys, oldest first, with status and usage (never a secret).

    Every key that matches is printed, unless --limit or --cursor asks for one page.
    """
    paged = limit is not None or cursor is not None

    async def work(manager: KeyManager) -> KeyPage:
        if paged:
            return await manager.list_page(
                workspace,
                owner=owner,
                status=status,
                limit=limit or DEFAULT_PAGE_SIZE,
                cursor=cursor,
                environment=environment,
                identity=identity,
            )
        return KeyPage(
            await manager.list(
                workspace, owner=owner, status=status, environment=environment, identity=identity
            ),
            None,
        )

    page = run_with_manager(ctx, work)
    records = page.records
    if as_json:
        items = [record.to_dict() for record in records]
        echo_json({"data": items, "next_cursor": page.next_cursor} if paged else items)
        return
    if not records:
        where = f" in workspace {workspace!r}" if workspace is not None else ""
        whose = f" of owner {owner!r}" if owner is not None else ""
        whose += f" of identity {identity!r}" if identity is not None else ""
        which = "".join(f" {word}" for word in (status, environment) if word is not None)
        more = " on this page" if paged else ""
        click.echo(f"No{which} API keys{whose}{where}{more}.")
    else:
        _print_records(records)
    if page.next_cursor is not None:
        click.echo(f"Next page: --cursor {page.next_cursor}")


def _print_records(records: Sequence[KeyRecord]) -> None:
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
            shorten(record.name),
            shorten(record.workspace),
            record.prefix,
            record.access,
            scopes_text(record),
            record.status,
            format_time(record.created_at),
            format_time(record.last_used_at),
            str(record.request_count),
        )
        for record in records
    )
    for line in table_lines(headers, rows):
        click.echo(line)


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help="Print the record as one JSON object.")
@click.pass_context
def show(ctx: click.Context, key_id: str, as_json: bool) -> None:
    """Show one key's record (never its secret)."""
    key_id = key_id_of(key_id)

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.get(key_id)

    record = run_with_manager(ctx, work)
    if as_json:
        echo_json(record.to_dict())
        return
    for line in summary_lines(record):
        click.echo(line)


def _state_change(
    ctx: click.Context,
    key_id: str,
    change: Callable[..., Awaitable[KeyRecord]],
    past: str,
    target: str,
    actor: str | None,
) -> None:
    key_id = key_id_of(key_id)
    who = actor_of(actor)

    async def work(manager: KeyManager) -> tuple[KeyRecord, KeyRecord]:
        before = await manager.get(key_id)
        return before, await change(manager, key_id, actor=who)

    before, record = run_with_manager(ctx, work)
    status = record.status
    note = f" (it expired at {format_time(record.expires_at)})" if status == "expired" else ""
    if before.state == target:
        # Nothing changed: say so, as `revoke` does for a key revoked before.
        shown = "disabled" if target == "disabled" else "enabled"
        click.echo(f"API key {record.id} ({record.name!r}) was already {shown}{note}.")
        return
    click.echo(f"{past} API key {record.id} ({record.name!r}): it is now {status}{note}.")


@main.command()
@click.argument("key_id", metavar="ID")
@actor_option
@click.pass_context
def disable(ctx: click.Context, key_id: str, actor: str | None) -> None:
    """Stop a key from authenticating until it is enabled again."""
    _state_change(ctx, key_id, KeyManager.disable, "Disabled", "disabled", actor)


@main.command()
@click.argument("key_id", metavar="ID")
@actor_option
@click.pass_context
def enable(ctx: click.Context, key_id: str, actor: str | None) -> None:
    """Let a disabled key authenticate again (a revoked key cannot be enabled)."""
    _state_change(ctx, key_id, KeyManager.enable, "Enabled", "active", actor)


def _interactive() -> bool:
    """Whether a person can answer a confirmation prompt on stdin."""
    stdin = sys.stdin
    return stdin is not None and stdin.isatty()


@main.command()
@click.argument("key_id", metavar="ID")
@click.option("--yes", "-y", is_flag=True, help="Revoke without asking for confirmation.")
@actor_option
@click.pass_context
def revoke(ctx: click.Context, key_id: str, yes: bool, actor: str | None) -> None:
    """Revoke a key for good: every later request with it is refused.

    The key stays in the list, with status revoked. Asks for confirmation unless --yes;
    without a terminal to ask on, --yes is required.
    """
    if not yes and not _interactive():
        raise click.UsageError(
            "revoking a key cannot be undone: pass --yes to confirm (no terminal to ask on)",
            ctx,
        )
    key_id = key_id_of(key_id)

    async def lookup(manager: KeyManager) -> KeyRecord:
        return await manager.get(key_id)

    record = run_with_manager(ctx, lookup)
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

    who = actor_of(actor)

    async def work(manager: KeyManager) -> KeyRecord:
        return await manager.revoke(key_id, actor=who)

    record = run_with_manager(ctx, work)
    click.echo(
        f"Revoked API key {record.id} ({record.name!r}) at {format_time(record.revoked_at, 'now')}."
    )


@main.command()
@click.argument("key_id", metavar="ID")
@click.option(
    "--grace",
    callback=duration_callback(allow_zero=True),
    default="24h",
    show_default=True,
    metavar="DURATION",
    help="How long the old key keeps working; 0 cuts it off now.",
)
@click.option(
    "--expires-in",
    callback=duration_callback(),
    metavar="DURATION",
    help="Expire the new key after this long (default: the old key's lifetime, from now).",
)
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: key and record.")
@click.pass_context
def roll(
    ctx: click.Context,
    key_id: str,
    grace: timedelta,
    expires_in: timedelta | None,
    actor: str | None,
    as_json: bool,
) -> None:
    """Replace a key with a new one of the same name, workspace, access, scopes and limit.

    The new key is printed once; the old one keeps working for the grace period, then
    expires. The new key lives as long as the old one did (a 30-day key gives a 30-day
    key, from now), unless --expires-in says otherwise. With --json, `replaces` is the
    old key's id and `replaced` its record.
    """
    key_id = key_id_of(key_id)
    who = actor_of(actor)

    async def work(manager: KeyManager) -> tuple[CreatedKey, KeyRecord]:
        created = await manager.roll(key_id, grace, expires_in=expires_in, actor=who)
        return created, await manager.get(key_id)

    created, old = run_with_manager(ctx, work, uses_secrets=True)
    if as_json:
        echo_json({**created.to_dict(), "replaced": old.to_dict()})
        _warn_if_unconfirmed(created)
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
        lifetime = f"The new key expires at {format_time(record.expires_at)} (in {given})."
    else:
        lifetime = (
            f"The new key expires at {format_time(record.expires_at)}: the same lifetime as the "
            "key it replaces."
        )
    click.echo(lifetime, err=True)
    status = old.status
    if status == "active":
        grace_text = ctx.meta.get("apikeys.text.grace") or format_duration(grace)
        click.echo(
            f"The old key {old.prefix} keeps working until {format_time(old.expires_at)} "
            f"(grace {grace_text}), then expires.",
            err=True,
        )
    else:
        click.echo(f"The old key {old.prefix} is {status} and no longer works.", err=True)
    _warn_if_unconfirmed(created)
