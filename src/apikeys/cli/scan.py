"""`apikeys scan`: find keys in files, and revoke them."""

from __future__ import annotations

import click

from apikeys.cli.common import (
    actor_of,
    actor_option,
    main,
    prefixes_callback,
    run_with_manager,
)
from apikeys.keys import (
    DEFAULT_PREFIX,
    mask,
)
from apikeys.leaks.files import (
    Finding,
    ScanStats,
    find_keys,
    key_pattern,
    read_text_file,
    revoke_found,
    walk,
)
from apikeys.manager import KeyManager

__all__: list[str] = []


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
    callback=prefixes_callback,
    multiple=True,
    default=(DEFAULT_PREFIX,),
    show_default=True,
    help="The key prefix to look for; repeat for several.",
)
@actor_option
@click.pass_context
def scan(
    ctx: click.Context,
    paths: tuple[str, ...],
    revoke_keys: bool,
    prefixes: tuple[str, ...],
    actor: str | None,
) -> None:
    """Find API keys in files and folders (- reads stdin); exit 1 when any is found.

    Reports file:line and the masked key, never the secret. Only tokens with a valid
    checksum count; binary files, files over 10 MiB, symbolic links met while walking a
    folder and .git, .venv, node_modules and __pycache__ folders are skipped. --revoke
    revokes each key found whose secret matches the store.
    """
    pattern = key_pattern(prefixes)
    stats = ScanStats()
    findings: list[Finding] = []
    for root in paths:
        for file in walk(root, stats):
            data = read_text_file(file, stats)
            if data is None:
                continue
            shown = "<stdin>" if file.path == "-" else file.path
            findings.extend(Finding(shown, line, key) for line, key in find_keys(data, pattern))
    for finding in findings:
        click.echo(
            f"{click.format_filename(finding.path)}:{finding.line}: "
            f"{mask(finding.key.prefix, finding.key.id)}"
        )
    skipped = f", skipped {stats.skipped} binary or large" if stats.skipped else ""
    if stats.links:
        skipped += f", skipped {stats.links} symbolic link{'' if stats.links == 1 else 's'}"
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
        who = actor_of(actor)

        async def work(manager: KeyManager) -> dict[str, str]:
            return await revoke_found(manager, unique, actor=who)

        outcomes = run_with_manager(ctx, work, uses_secrets=True)
        # One verdict per finding, with its place: two findings of one id may be two keys.
        for finding in findings:
            click.echo(
                f"{click.format_filename(finding.path)}:{finding.line}: "
                f"{mask(finding.key.prefix, finding.key.id)}: {outcomes[finding.key.token]}"
            )
    ctx.exit(1)
