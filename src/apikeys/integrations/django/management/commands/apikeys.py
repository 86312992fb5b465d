"""`manage.py apikeys …`: the `apikeys` command line on the store and pepper of
`settings.APIKEYS`.

Every command of `apikeys` (create, list, show, revoke, roll, import, webhooks …) with the
same options and output: `python manage.py apikeys create --name Zapier --scope
contacts:read`. The store is `APIKEYS["STORE_URL"]` (else `APIKEYS_STORE_URL`, as for the
middleware) unless `--store` is given first; the pepper is `APIKEYS["PEPPER"]` when set,
else `APIKEYS_PEPPER` and `APIKEYS_OLD_PEPPERS`, as for the middleware.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandError

__all__ = ["Command", "run"]


@contextmanager
def _environment() -> Iterator[None]:
    """`APIKEYS_STORE_URL` and `APIKEYS_PEPPER` from the settings, for the command's
    duration (the command line reads them there)."""
    from apikeys.integrations.django import apikeys_settings

    config = apikeys_settings()
    given = {"APIKEYS_STORE_URL": config["STORE_URL"]}
    if config["PEPPER"] is not None:
        given["APIKEYS_PEPPER"] = config["PEPPER"]
    before = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run(args: Sequence[str], prog_name: str = "manage.py apikeys") -> int:
    """Run the `apikeys` command line with `args` on the settings' store and pepper; its
    exit status."""
    try:
        import click

        from apikeys.cli import main
    except ModuleNotFoundError as exc:
        if exc.name != "click":
            raise
        from apikeys.__main__ import CLI_EXTRA_HINT

        raise CommandError(CLI_EXTRA_HINT, returncode=2) from None
    with _environment():
        try:
            main.main(args=list(args), prog_name=prog_name, standalone_mode=False)
        except click.exceptions.Exit as exc:
            return exc.exit_code
        except click.ClickException as exc:
            exc.show()
            return exc.exit_code
        except click.exceptions.Abort:
            click.echo("Aborted!", err=True)
            return 1
    return 0


class Command(BaseCommand):  # type: ignore[misc]
    """`manage.py apikeys ARGS`: the `apikeys` command line (see the module)."""

    help = "The apikeys command line on settings.APIKEYS's store: manage.py apikeys --help"
    # The store is not Django's database, and the command line checks what it needs.
    requires_system_checks: ClassVar[list[str]] = []

    def run_from_argv(self, argv: list[str]) -> None:
        """`manage.py apikeys ARGS`: every argument goes to the `apikeys` command line."""
        program = f"{os.path.basename(argv[0])} {argv[1]}"
        status = run(argv[2:], prog_name=program)
        if status:
            sys.exit(status)

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("args", nargs="*", help="the apikeys command and its options")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> Any:
        """A parser that hands every argument to the `apikeys` command line, options too
        (`call_command("apikeys", "list", "--json")`)."""
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        defaults = parser.parse_args([])

        def everything(args: Sequence[str] | None = None, namespace: Any = None) -> Any:
            parsed = copy.copy(defaults)
            parsed.args = [str(arg) for arg in args or ()]
            return parsed

        parser.parse_args = everything
        return parser

    def handle(self, *args: str, **options: Any) -> None:
        """`call_command("apikeys", "list", "--json")`."""
        status = run(args)
        if status:
            raise CommandError(
                f"apikeys {' '.join(args)} exited with status {status}", returncode=status
            )
