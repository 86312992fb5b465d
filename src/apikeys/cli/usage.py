"""`apikeys usage`: how much a key (or an identity's keys together) was used, per UTC day."""

from __future__ import annotations

import click

from apikeys.cli.common import echo_json, key_id_of, main, run_with_manager, table_lines
from apikeys.cli.identities import identity_id_callback
from apikeys.identities import IdentityRecord
from apikeys.manager import KeyManager
from apikeys.types import DailyUsage, KeyRecord

__all__: list[str] = []


@main.command()
@click.argument("key_id", metavar="ID", required=False)
@click.option(
    "--identity",
    "identity_id",
    metavar="IDENTITY",
    callback=identity_id_callback,
    help="Instead of a key: the keys of this identity together, per day.",
)
@click.option(
    "--days",
    type=click.IntRange(min=1, max=3660),
    default=30,
    show_default=True,
    help="How many UTC days, today included.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def usage(
    ctx: click.Context, key_id: str | None, identity_id: str | None, days: int, as_json: bool
) -> None:
    """Show a key's requests per UTC day: admitted, and refused by reason. With
    --identity IDENTITY instead of ID: the requests of all the identity's keys together.

    Refusals are counted by code: insufficient_scope, rate_limited, credits_exhausted,
    ip_not_allowed. Requests with a wrong secret are not the key's and are not counted.
    legacy_scheme counts the requests (of either kind) that sent an imported key under a
    migration's legacy scheme (Authorization: Api-Key).
    """
    if (key_id is None) == (identity_id is None):
        raise click.UsageError("give a key's ID, or --identity IDENTITY (not both)", ctx)
    if key_id is None:
        assert identity_id is not None
        _identity_usage(ctx, identity_id, days, as_json)
        return
    key_id = key_id_of(key_id)

    async def work(manager: KeyManager) -> tuple[KeyRecord, list[DailyUsage]]:
        record = await manager.get(key_id)
        return record, await manager.usage(key_id, days=days)

    record, history = run_with_manager(ctx, work)
    title = (
        f"{record.environment.capitalize()} API key {record.id} ({record.name!r}), "
        f"the last {days} UTC days:"
    )
    _show(history, {"key_id": record.id, "environment": record.environment}, title, as_json)


def _identity_usage(ctx: click.Context, identity_id: str, days: int, as_json: bool) -> None:
    async def work(manager: KeyManager) -> tuple[IdentityRecord, list[DailyUsage]]:
        record = await manager.get_identity(identity_id)
        return record, await manager.identity_usage(identity_id, days=days)

    record, history = run_with_manager(ctx, work)
    named = f" ({record.name!r})" if record.name else ""
    title = f"Identity {record.id}{named}, all its keys, the last {days} UTC days:"
    _show(history, {"identity": record.id}, title, as_json)


def _show(history: list[DailyUsage], whose: dict[str, str], title: str, as_json: bool) -> None:
    """Print `history` as a table after `title`, or as one JSON object with `whose`."""
    if as_json:
        echo_json(
            {
                **whose,
                "days": [day.to_dict() for day in history],
                "admitted": sum(day.admitted for day in history),
                "refused": sum(day.total - day.admitted for day in history),
                "legacy_scheme": sum(day.legacy_scheme for day in history),
            }
        )
        return
    codes = sorted({code for day in history for code in day.refused})
    legacy = sum(day.legacy_scheme for day in history)
    extra = ("legacy_scheme",) if legacy else ()
    rows = [
        (
            day.day.isoformat(),
            str(day.admitted),
            *(str(day.refused.get(code, 0)) for code in codes),
            *((str(day.legacy_scheme),) if legacy else ()),
        )
        for day in history
    ]
    click.echo(title)
    for line in table_lines(("day", "admitted", *codes, *extra), rows):
        click.echo(line)
    admitted = sum(day.admitted for day in history)
    refused = sum(day.total - day.admitted for day in history)
    click.echo(f"Total: {admitted} admitted, {refused} refused.")
    if legacy:
        click.echo(f"{legacy} sent under a legacy Authorization scheme (Api-Key): not yet moved.")
