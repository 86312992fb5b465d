"""`apikeys webhooks`: endpoints that are sent signed events about keys, and deliveries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import TypeVar

import click

from apikeys.cli.common import (
    Refused,
    duration_callback,
    echo_json,
    format_time,
    main,
    run_with_manager,
    table_lines,
)
from apikeys.hashing import UNPEPPERED, Hasher
from apikeys.manager import KeyManager
from apikeys.stores.contract import WebhookStore
from apikeys.types import utcnow
from apikeys.webhooks.admin import DEFAULT_OVERLAP, add_endpoint, roll_endpoint_secret
from apikeys.webhooks.events import EVENT_TYPES
from apikeys.webhooks.model import Delivery, Endpoint

__all__: list[str] = []

_T = TypeVar("_T")


def _hooks(manager: KeyManager) -> WebhookStore:
    hooks = manager.store.webhooks()
    if hooks is None:
        raise Refused("this store keeps no webhooks (a shared SQL or Redis store does)")
    return hooks


def _with_hooks(ctx: click.Context, work: Callable[[WebhookStore], Awaitable[_T]]) -> _T:
    async def run(manager: KeyManager) -> _T:
        return await work(_hooks(manager))

    return run_with_manager(ctx, run)


def _sealing(ctx: click.Context, work: Callable[[WebhookStore, Hasher], Awaitable[_T]]) -> _T:
    """`_with_hooks` for a command that makes a secret, sealed with `APIKEYS_PEPPER`.

    With a pepper, the store's recorded pepper is checked first, as the key commands check
    it: a secret sealed with a pepper the services do not have could sign nothing. Without
    one, nothing is recorded (the secret is kept as it is, with a warning), so that a
    webhook added in development does not decide how keys are hashed.
    """

    async def run(manager: KeyManager) -> _T:
        hooks = _hooks(manager)
        if manager.hasher.pepper_fingerprint != UNPEPPERED:
            await manager.setup()
        return await work(hooks, manager.hasher)

    return run_with_manager(ctx, run)


@main.group()
def webhooks() -> None:
    """Endpoints sent signed events about keys (Standard Webhooks), and their deliveries."""


@webhooks.command("add")
@click.argument("url")
@click.option(
    "--event",
    "events",
    multiple=True,
    type=click.Choice(EVENT_TYPES),
    help="Send only this event; repeat for several (default: every event).",
)
@click.option("--workspace", default=None, help="Only this workspace's keys (default: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the endpoint and secret as JSON.")
@click.pass_context
def add(
    ctx: click.Context, url: str, events: tuple[str, ...], workspace: str | None, as_json: bool
) -> None:
    """Add an endpoint; its signing secret is printed once, here."""

    async def work(hooks: WebhookStore, hasher: Hasher) -> Endpoint:
        return await add_endpoint(hooks, url, events=events, workspace=workspace, hasher=hasher)

    endpoint = _sealing(ctx, work)
    if as_json:
        echo_json({**endpoint.to_dict(), "secret": endpoint.secret})
        return
    click.echo(f"Added {endpoint.id} for {endpoint.url}")
    click.echo(f"Signing secret (shown once): {endpoint.secret}")


@webhooks.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of endpoints.")
@click.pass_context
def list_endpoints(ctx: click.Context, as_json: bool) -> None:
    """List the endpoints (never their secrets)."""
    endpoints = _with_hooks(ctx, lambda hooks: hooks.endpoints())
    if as_json:
        echo_json([endpoint.to_dict() for endpoint in endpoints])
        return
    if not endpoints:
        click.echo("No webhooks.", err=True)
        return
    rows = [
        (e.id, e.url, ",".join(e.events) or "all", e.workspace or "all", format_time(e.created_at))
        for e in endpoints
    ]
    for line in table_lines(("id", "url", "events", "workspace", "created"), rows):
        click.echo(line)


@webhooks.command("remove")
@click.argument("endpoint_id", metavar="ID")
@click.pass_context
def remove(ctx: click.Context, endpoint_id: str) -> None:
    """Remove an endpoint and its deliveries."""
    if not _with_hooks(ctx, lambda hooks: hooks.remove_endpoint(endpoint_id)):
        raise Refused(f"no webhook {endpoint_id!r}")
    click.echo(f"Removed {endpoint_id}")


@webhooks.command("roll")
@click.argument("endpoint_id", metavar="ID")
@click.option(
    "--overlap",
    callback=duration_callback(allow_zero=True),
    metavar="DURATION",
    help="How long the old secret still signs beside the new one (default 24h).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the new secret as JSON.")
@click.pass_context
def roll(ctx: click.Context, endpoint_id: str, overlap: timedelta | None, as_json: bool) -> None:
    """Give an endpoint a new signing secret (printed once); both sign during the overlap.

    The new secret is sealed with APIKEYS_PEPPER, as add's is: rolling is also how a secret
    kept in clear (added by an earlier version, or without a pepper) leaves the store.
    """
    span = overlap if overlap is not None else DEFAULT_OVERLAP

    async def work(hooks: WebhookStore, hasher: Hasher) -> str | None:
        return await roll_endpoint_secret(hooks, endpoint_id, span, hasher=hasher)

    secret = _sealing(ctx, work)
    if secret is None:
        raise Refused(f"no webhook {endpoint_id!r}")
    if as_json:
        echo_json({"id": endpoint_id, "secret": secret})
        return
    click.echo(f"New signing secret of {endpoint_id} (shown once): {secret}")


@webhooks.command("deliveries")
@click.option("--failed", is_flag=True, help="Only the deliveries that failed.")
@click.option(
    "--workspace", default=None, help="Only those about this workspace's keys (default: all)."
)
@click.option(
    "--limit",
    type=click.IntRange(min=1, max=100_000),
    default=100,
    show_default=True,
    help="At most this many, the newest.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of deliveries.")
@click.pass_context
def deliveries(
    ctx: click.Context, failed: bool, workspace: str | None, limit: int, as_json: bool
) -> None:
    """List deliveries, newest first: event, status, attempts and the last response."""

    async def work(hooks: WebhookStore) -> list[Delivery]:
        return await hooks.deliveries(
            status="failed" if failed else None, workspace=workspace, limit=limit
        )

    found = _with_hooks(ctx, work)
    if as_json:
        echo_json([delivery.to_dict() for delivery in found])
        return
    if not found:
        click.echo("No deliveries.", err=True)
        return
    rows = [
        (
            d.id,
            d.webhook_id,
            d.event,
            d.key_id,
            d.status,
            str(d.attempts),
            str(d.last_status or d.last_error or "-"),
            format_time(d.last_attempt_at),
        )
        for d in found
    ]
    headers = ("id", "webhook", "event", "key", "status", "attempts", "last", "last attempt")
    for line in table_lines(headers, rows):
        click.echo(line)


@webhooks.command("replay")
@click.argument("delivery_id", metavar="DELIVERY_ID")
@click.pass_context
def replay(ctx: click.Context, delivery_id: str) -> None:
    """Send a delivery again (same id and body), after any earlier one for its key."""
    if not _with_hooks(ctx, lambda hooks: hooks.replay(delivery_id, utcnow())):
        raise Refused(f"no delivery {delivery_id!r}")
    click.echo(f"Replaying {delivery_id}")
