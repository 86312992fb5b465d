"""`apikeys usage`: how much a key was used, per UTC day."""

from __future__ import annotations

import click

from apikeys.cli.common import echo_json, key_id_of, main, run_with_manager, table_lines
from apikeys.manager import KeyManager
from apikeys.types import DailyUsage, KeyRecord

__all__: list[str] = []


@main.command()
@click.argument("key_id", metavar="ID")
@click.option(
    "--days",
    type=click.IntRange(min=1, max=3660),
    default=30,
    show_default=True,
    help="How many UTC days, today included.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def usage(ctx: click.Context, key_id: str, days: int, as_json: bool) -> None:
    """Show a key's requests per UTC day: admitted, and refused by reason.

    Refusals are counted by code: insufficient_scope, rate_limited, credits_exhausted,
    ip_not_allowed. Requests with a wrong secret are not the key's and are not counted.
    legacy_scheme counts the requests (of either kind) that sent an imported key under a
    migration's legacy scheme (Authorization: Api-Key).
    """
    key_id = key_id_of(key_id)

    async def work(manager: KeyManager) -> tuple[KeyRecord, list[DailyUsage]]:
        record = await manager.get(key_id)
        return record, await manager.usage(key_id, days=days)

    record, history = run_with_manager(ctx, work)
    if as_json:
        echo_json(
            {
                "key_id": record.id,
                "environment": record.environment,
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
    click.echo(
        f"{record.environment.capitalize()} API key {record.id} ({record.name!r}), "
        f"the last {days} UTC days:"
    )
    for line in table_lines(("day", "admitted", *codes, *extra), rows):
        click.echo(line)
    admitted = sum(day.admitted for day in history)
    refused = sum(day.total - day.admitted for day in history)
    click.echo(f"Total: {admitted} admitted, {refused} refused.")
    if legacy:
        click.echo(f"{legacy} sent under a legacy Authorization scheme (Api-Key): not yet moved.")
