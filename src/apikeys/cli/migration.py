"""`apikeys sync-revocations`: revocations written back to djangorestframework-api-key."""

from __future__ import annotations

import click

from apikeys.cli.common import echo_json, main, run_with_manager
from apikeys.importing.revocations import RevocationReport, write_revocations
from apikeys.importing.sources import DRF_TABLE
from apikeys.manager import KeyManager

__all__: list[str] = []


@main.command("sync-revocations")
@click.option(
    "--to",
    "target",
    type=click.Choice(["drf-api-key"]),
    required=True,
    help="drf-api-key: DATABASE_URL is the database of the djangorestframework-api-key "
    "project the keys were imported from.",
)
@click.argument("url", metavar="DATABASE_URL")
@click.option(
    "--workspace", default="default", show_default=True, help="The imported keys' workspace."
)
@click.option(
    "--table",
    default=DRF_TABLE,
    show_default=True,
    help="The keys' table (a custom AbstractAPIKey model's).",
)
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the report.")
@click.pass_context
def sync_revocations(
    ctx: click.Context,
    target: str,
    url: str,
    workspace: str,
    table: str,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Revoke in the old table every imported key revoked here, so the old service refuses it.

    While some clients still call the old service, run it after each revoke (or on a
    schedule). It sets revoked on the old rows of keys imported into WORKSPACE and revoked
    in apikeys, and changes nothing else. Prints the ids (apikeys') whose old rows it revoked.
    """

    async def work(manager: KeyManager) -> RevocationReport:
        return await write_revocations(
            manager, url, workspace=workspace, table=table, dry_run=dry_run
        )

    report = run_with_manager(ctx, work, uses_secrets=True)
    if as_json:
        echo_json(report.to_dict())
        return
    verb = "Would revoke" if dry_run else "Revoked"
    ids = f": {', '.join(report.revoked)}" if report.revoked else ""
    click.echo(
        f"{verb} {len(report.revoked)} of {report.checked} active row(s) of {table} "
        f"(keys revoked in apikeys){ids}"
    )
    if dry_run:
        click.echo("Dry run: nothing was changed.")
