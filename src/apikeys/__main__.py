"""`python -m apikeys` and the `apikeys` command: the command line, if its extra is installed."""

from __future__ import annotations

import sys

__all__ = ["main"]

CLI_EXTRA_HINT = "the apikeys command needs click. Install it with: pip install 'apikeys[cli]'"


def main() -> None:
    """Run the command line; without `click`, say which extra to install (exit status 2)."""
    try:
        from apikeys.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if exc.name != "click":
            raise
        print(f"Error: {CLI_EXTRA_HINT}", file=sys.stderr)
        raise SystemExit(2) from None
    cli_main(prog_name="apikeys")


if __name__ == "__main__":
    main()
