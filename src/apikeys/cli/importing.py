"""`apikeys import`: bring in keys from djangorestframework-api-key or a CSV file."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from apikeys.cli.common import (
    access_options,
    actor_of,
    actor_option,
    check_new_access,
    echo_json,
    main,
    run_with_manager,
    table_lines,
)
from apikeys.errors import ConfigurationError
from apikeys.importing import ImportReport, import_keys, read_csv, read_drf
from apikeys.importing.sources import (
    DRF_TABLE,
    ForeignKey,
    Refusal,
    check_column,
    check_table,
    check_workspace_column,
)
from apikeys.manager import KeyManager

__all__: list[str] = []

# Rows from which a terminal shows a progress bar.
_PROGRESS_FROM = 50


@main.command("import")
@click.option(
    "--from",
    "source",
    type=click.Choice(["drf-api-key", "csv"]),
    required=True,
    help="drf-api-key: SOURCE is the database URL of a djangorestframework-api-key project; "
    "csv: SOURCE is a CSV file (name,hash[,expires_at][,prefix][,environment][,identity]).",
)
@click.argument("location", metavar="SOURCE")
@click.option("--workspace", default="default", show_default=True, help="The keys' workspace.")
@click.option(
    "--workspace-column",
    metavar="COLUMN",
    help="Put each key in the workspace its row names in COLUMN (e.g. organization_id) "
    "instead of one --workspace; a row naming none is refused.",
)
@click.option(
    "--identity-column",
    metavar="COLUMN",
    help="Put each key in the identity whose id its row holds in COLUMN (e.g. customer_id; "
    "a CSV's identity column is read without it). The identity must exist in the key's "
    "workspace: a row naming another is refused. Empty: no identity.",
)
@click.option(
    "--table",
    default=DRF_TABLE,
    show_default=True,
    help="drf-api-key only: the table of a custom AbstractAPIKey model.",
)
@access_options("Grant the imported keys a scope. Repeat it, or separate with commas.")
@click.option("--dry-run", is_flag=True, help="Say what would happen; change nothing.")
@actor_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: the report.")
@click.pass_context
def import_(
    ctx: click.Context,
    /,
    source: str,
    location: str,
    workspace: str,
    workspace_column: str | None,
    identity_column: str | None,
    table: str,
    full_access: bool,
    scopes: tuple[str, ...],
    dry_run: bool,
    actor: str | None,
    as_json: bool,
) -> None:
    """Import keys with their existing hashes: each old key string keeps working.

    An old key is re-hashed with apikeys' own scheme on its first use. Importing twice is
    harmless: keys imported before are skipped, and revoked when their source now says they
    are. Prints how many keys were imported, skipped and refused (with why).
    """
    check_new_access(ctx, full_access, scopes)
    _check_source_options(ctx, source, workspace_column)
    _check_identity_column(ctx, source, identity_column)

    async def work(manager: KeyManager) -> ImportReport:
        rows: list[ForeignKey | Refusal] = list(
            await read_drf(
                location,
                table=table,
                workspace_column=workspace_column,
                identity_column=identity_column,
            )
            if source == "drf-api-key"
            else read_csv(
                location, workspace_column=workspace_column, identity_column=identity_column
            )
        )
        show = not as_json and len(rows) >= _PROGRESS_FROM and sys.stderr.isatty()
        with click.progressbar(
            length=len(rows), label="Importing", file=sys.stderr, hidden=not show
        ) as bar:
            update: Callable[[int], None] = bar.update
            return await import_keys(
                manager,
                rows,
                source=source,  # "drf-api-key" or "csv", as the audit trail names it
                workspace=workspace,
                scopes=scopes,
                full_access=full_access,
                dry_run=dry_run,
                actor=actor_of(actor),
                progress=update,
            )

    report = run_with_manager(ctx, work, uses_secrets=True)
    if as_json:
        echo_json(report.to_dict())
        return
    would = "Would import" if dry_run else "Imported"
    into = (
        f"the workspaces of column {workspace_column!r}"
        if workspace_column
        else f"workspace {workspace!r}"
    )
    click.echo(
        f"{would} {len(report.imported)} key(s) into {into}; "
        f"skipped {len(report.skipped)} (imported before); refused {len(report.refused)}."
    )
    # Which new id each old key now has: its old prefix (not secret) is kept on the record.
    mapped = [r for r in report.imported if r.imported_prefix is not None]
    if mapped:
        headers = ("old prefix", "new id", "name")
        rows = [(r.imported_prefix or "", r.id, r.name) for r in mapped]
        for line in table_lines(headers, rows):
            click.echo(f"  {line}")
    if report.revoked:
        verb = "Would revoke" if dry_run else "Revoked"
        click.echo(
            f"{verb} {len(report.revoked)} key(s) imported before and revoked at the source "
            f"since: {', '.join(report.revoked)}"
        )
    for refusal in report.refused:
        name = f" ({refusal.name!r})" if refusal.name else ""
        click.echo(f"refused row {refusal.row}{name}: {refusal.reason}")
    if dry_run:
        click.echo("Dry run: nothing was changed.")


def _check_source_options(ctx: click.Context, source: str, workspace_column: str | None) -> None:
    """Usage errors of `--table`, `--workspace` and `--workspace-column`."""
    given = ctx.get_parameter_source
    if source != "drf-api-key" and given("table") is not click.core.ParameterSource.DEFAULT:
        raise click.UsageError("--table is for --from drf-api-key only", ctx)
    if workspace_column is not None and given("workspace") is not (
        click.core.ParameterSource.DEFAULT
    ):
        raise click.UsageError(
            "give either --workspace (one for all keys) or --workspace-column, not both", ctx
        )
    try:
        check_table(ctx.params["table"])
        if workspace_column is not None:
            check_workspace_column(workspace_column)
            if source == "drf-api-key":
                check_column(workspace_column)
    except ConfigurationError as exc:
        raise click.UsageError(str(exc), ctx) from None


def _check_identity_column(ctx: click.Context, source: str, column: str | None) -> None:
    """A usage error for an `--identity-column` that cannot name a column of the source."""
    if column is None:
        return
    try:
        if source == "drf-api-key":
            check_column(column, "identity")
        else:
            check_workspace_column(column, "identity")
    except ConfigurationError as exc:
        raise click.UsageError(str(exc), ctx) from None
