"""The deliverer: a task in every process with a `KeyManager` that sends what is due.

Each round it hands new events of the change log to their deliveries (`take`), makes the
`key.usage_threshold` deliveries of the rate limit thresholds this process's limiters
reached (`ThresholdWatch`; `identity.usage_threshold` for an identity's policies),
leases the deliveries that are due and first in line for their endpoint and key
(`claim`), and starts sending them, signed, each in a task of its own.
Each endpoint has at most `per_endpoint` deliveries in flight, and a claim takes the
endpoints round robin within that room, so one endpoint's slow or silent receiver holds up
only its own deliveries: the next round does not wait for it. A 2xx answer delivers one; anything
else (or no answer within `timeout`) schedules the next attempt after a growing delay,
until `give_up_after` has passed since the event was taken: it is then marked `failed`,
and the next event for that key goes.
Every `check_interval` it also looks for keys about to expire or past a usage threshold,
and deletes the deliveries delivered or failed more than `retention` ago, a batch at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from apikeys.errors import ConfigurationError, WebhookTargetRefused
from apikeys.hashing import UNPEPPERED, Hasher
from apikeys.stores.contract import WebhookStore
from apikeys.types import identity_subject, utcnow
from apikeys.webhooks.events import Subject
from apikeys.webhooks.model import Claimed, Endpoint, Timed, rate_threshold_deliveries
from apikeys.webhooks.signing import (
    UNSEALABLE,
    is_sealed,
    sealed_pepper_id,
    signed_headers,
    unseal_secret,
)
from apikeys.webhooks.targets import REFUSED_INTERNAL, allow_private_from_env, resolve_target
from apikeys.webhooks.thresholds import ThresholdWatch

__all__ = ["DEFAULT_RETRY_DELAYS", "PRUNE_BATCH", "PRUNE_BATCHES", "Deliverer", "DeliveryOptions"]

logger = logging.getLogger("apikeys.webhooks")

DEFAULT_RETRY_DELAYS: tuple[float, ...] = (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800)
"""Seconds before each retry; the last repeats until `give_up_after`."""

PRUNE_BATCH = 1000
"""Deliveries deleted per statement (or script) when old ones are pruned: each is short,
so the writes of other processes wait little behind it."""

CLOSE_WAIT = 5.0
"""Seconds `Deliverer.aclose` waits at most for the cancelled round and sends to unwind."""

PRUNE_BATCHES = 10
"""Batches pruned at most per `check_interval`, by each process: up to 10,000 old
deliveries a minute, enough for a backlog of millions to go within a day or two."""


@dataclass(frozen=True, slots=True)
class DeliveryOptions:
    """How a process delivers webhooks.

    - `poll_interval`: seconds between rounds when nothing was due (1);
    - `retry_delays`: seconds before each retry, growing; the last repeats;
    - `give_up_after`: how long an event is retried before it is marked failed (24 h);
    - `timeout`: seconds an endpoint has to answer, the whole exchange (10; the answer's
      body is never read);
    - `lease`: seconds a process holds a delivery it sends (60; more than `timeout`);
    - `batch`: deliveries leased per round (20);
    - `per_endpoint`: deliveries in flight at most per endpoint, in each process (4): a
      slow receiver holds up no more than these, and never another endpoint's;
    - `check_interval`: seconds between looks for keys about to expire or past a usage
      threshold, and prunings of old deliveries (60);
    - `retention`: how long a delivery is kept after it was delivered or failed (its last
      attempt; 30 days), then deleted; None keeps every delivery. A pending one is never
      deleted;
    - `allow_private_targets`: send to endpoints whose host is, or resolves to, a loopback,
      private, link-local or other internal address (default: `APIKEYS_WEBHOOKS_ALLOW_PRIVATE`,
      off). Off, such a delivery is not sent: each attempt fails with `REFUSED_INTERNAL`
      as its error (`apikeys.webhooks.targets`).
    """

    poll_interval: float = 1.0
    retry_delays: Sequence[float] = DEFAULT_RETRY_DELAYS
    give_up_after: timedelta = timedelta(hours=24)
    timeout: float = 10.0
    lease: float = 60.0
    batch: int = 20
    per_endpoint: int = 4
    check_interval: float = 60.0
    retention: timedelta | None = timedelta(days=30)
    allow_private_targets: bool = field(default_factory=allow_private_from_env)

    def next_attempt(self, attempts: int, created_at: datetime, now: datetime) -> datetime | None:
        """When to try again after `attempts` failed attempts; None: give up."""
        delays = list(self.retry_delays) or [60.0]
        delay = delays[min(attempts - 1, len(delays) - 1)]
        at = now + timedelta(seconds=delay)
        return None if at > created_at + self.give_up_after else at


class Deliverer:
    """Runs delivery rounds on `store` until stopped (see the module doc).

    `records` reads a key's record by its id, or an identity's by `i:<id>` (None when there
    is none): with it, the rate limit thresholds queued in `thresholds` (a `ThresholdWatch`,
    which a `KeyManager` attaches its limiters to) become `key.usage_threshold` deliveries,
    or `identity.usage_threshold` ones for an identity's policies; each round turns the
    watch on while an endpoint wants one of those events, and off otherwise.

    `hasher` makes the endpoints' sealed secrets again from its pepper or old peppers
    (`apikeys.webhooks.signing`); a `KeyManager` gives its own. Without one, `Hasher()`
    reads `APIKEYS_PEPPER` and `APIKEYS_OLD_PEPPERS` when a sealed secret is first met. An
    endpoint whose secret was sealed with a pepper it does not have is not sent to: each
    attempt fails as an unreachable endpoint's does, with `UNSEALABLE` as its error.
    """

    def __init__(
        self,
        store: WebhookStore,
        options: DeliveryOptions | None = None,
        *,
        records: Callable[[str], Awaitable[Subject | None]] | None = None,
        hasher: Hasher | None = None,
    ) -> None:
        self.store = store
        self.options = options or DeliveryOptions()
        self.records = records
        self._hasher = hasher
        # Endpoints already logged about (a pepper missing, a secret kept in clear): once.
        self._told: set[tuple[str, str]] = set()
        self.thresholds = ThresholdWatch()
        self.holder = secrets.token_hex(8)
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._checked = float("-inf")
        self._warned = False
        # The sends in flight, per endpoint id; each wakes the loop when it ends.
        self._flying: dict[str, set[asyncio.Task[None]]] = {}
        self._wake: asyncio.Event | None = None

    def start(self) -> None:
        """Start the task on the running loop, unless it runs there already, or on another
        loop that still runs (in another thread): one task delivers for the process. A
        manager moved to another loop, its first one closed, starts it anew there."""
        loop = asyncio.get_running_loop()
        task = self._task
        if task is not None and not task.done():
            if self._loop is loop or (self._loop is not None and self._loop.is_running()):
                return
            with contextlib.suppress(RuntimeError):  # its loop is closed
                task.cancel()
        self._drop_flying()
        self._loop = loop
        self._wake = asyncio.Event()
        self._client = None  # bound to the loop it was made on
        self._task = loop.create_task(self._run(), name="apikeys-webhooks")

    async def aclose(self) -> None:
        """Stop the task (a delivery in flight is dropped; its lease runs out), stop
        watching the limiters, and close the HTTP client."""
        self.thresholds.switch(False)
        task, self._task = self._task, None
        here = self._loop in (None, asyncio.get_running_loop())
        stopping = self._drop_flying()
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed
                task.cancel()
            stopping.append(task)
        if here and stopping:
            # Bounded: a client library's call that does not unwind when cancelled
            # (seen with redis-py on Python 3.11) must not hold the process's shutdown.
            await asyncio.wait(stopping, timeout=CLOSE_WAIT)
        client, self._client = self._client, None
        if client is not None and here:
            await client.aclose()

    def _drop_flying(self) -> list[asyncio.Task[None]]:
        """Cancel the sends in flight (their leases run out); those cancelled."""
        flying = [task for tasks in self._flying.values() for task in tasks]
        self._flying = {}
        for task in flying:
            with contextlib.suppress(RuntimeError):  # its loop is closed
                task.cancel()
        return flying

    async def _run(self) -> None:
        failures = 0
        # The first round waits a poll interval: a short script's manager (an asyncio.run
        # that issues a key and ends) is gone before it would touch the store.
        await asyncio.sleep(self.options.poll_interval)
        wake = self._wake or asyncio.Event()
        # Which task is this process's is checked as well as the cancellation `aclose`
        # sends: on Python 3.11 a cancellation can be swallowed (by a client library, in a
        # command answered as it is cancelled), and a round after `aclose` would open
        # connections on a store being closed, left open.
        this = asyncio.current_task()
        while self._task is this:
            wake.clear()
            try:
                started = len(await self._round())
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                logger.warning("webhooks: a delivery round failed: %s", type(exc).__name__)
                started = 0
            if not started:
                # A send that ends makes room, or lets its key's next delivery go: the
                # next round starts then, or after the pause.
                pause = self.options.poll_interval * min(2**failures, 30)
                if failures:
                    await asyncio.sleep(pause)
                else:
                    # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a
                    # cancellation that arrives as the wait ends (a send landing).
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(pause):
                            await wake.wait()

    async def run_once(self) -> int:
        """One round (take new events, lease what is due, send it), and wait for the sends
        it started (not for those of earlier rounds still in flight). The number started."""
        started = await self._round()
        if started:
            await asyncio.wait(started)
        return len(started)

    async def _round(self) -> list[asyncio.Task[None]]:
        """Take new events, lease what is due within each endpoint's room, and start
        sending it; the sends started."""
        endpoints = {endpoint.id: endpoint for endpoint in await self.store.endpoints()}
        if not endpoints:
            self.thresholds.switch(False)
            self.thresholds.take()  # for nobody
            return []
        if importlib.util.find_spec("httpx") is None:
            self.thresholds.switch(False)
            self.thresholds.take()
            if not self._warned:
                self._warned = True
                logger.warning(
                    "webhooks are not sent: they need httpx (pip install 'apikeys[webhooks]')"
                )
            return []
        wanted = [
            endpoint
            for endpoint in endpoints.values()
            if endpoint.wants_any(("key.usage_threshold", "identity.usage_threshold"))
        ]
        self.thresholds.switch(bool(wanted) and self.records is not None)
        now = utcnow()
        if any(_overlap_ended(endpoint, now) for endpoint in endpoints.values()):
            await self.store.forget_previous_secrets(now)
        await self.store.take(now)
        await self.rate_thresholds(wanted, now)
        if time.monotonic() - self._checked >= self.options.check_interval:
            await self.store.expiring(now)
            await self.store.usage_thresholds(now)
            await self.prune(now)
            self._checked = time.monotonic()
        room = {
            endpoint_id: self.options.per_endpoint - len(self._flying.get(endpoint_id, ()))
            for endpoint_id in endpoints
        }
        room = {endpoint_id: left for endpoint_id, left in room.items() if left > 0}
        if not room:
            return []
        claimed = await self.store.claim(
            self.holder,
            now,
            now + timedelta(seconds=self.options.lease),
            self.options.batch,
            room=room,
        )
        return [self._launch(item, endpoints.get(item.webhook_id)) for item in claimed]

    def _launch(self, item: Claimed, endpoint: Endpoint | None) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._send(item, endpoint), name="apikeys-webhook-send"
        )
        self._flying.setdefault(item.webhook_id, set()).add(task)
        task.add_done_callback(functools.partial(self._landed, item.webhook_id))
        return task

    def _landed(self, endpoint_id: str, task: asyncio.Task[None]) -> None:
        flying = self._flying.get(endpoint_id)
        if flying is not None:
            flying.discard(task)
            if not flying:
                del self._flying[endpoint_id]
        if self._wake is not None:
            self._wake.set()
        if not task.cancelled() and (error := task.exception()) is not None:
            # The attempt was made but not recorded (the store failed): the lease runs
            # out and the delivery is sent again.
            logger.warning("webhooks: a delivery was not recorded: %s", type(error).__name__)

    async def rate_thresholds(self, endpoints: Iterable[Endpoint], now: datetime) -> int:
        """Make the `key.usage_threshold` (and `identity.usage_threshold`) deliveries of the
        thresholds queued in `thresholds` for `endpoints` (`rate_threshold_deliveries`); the
        number made. What cannot be stored (the store fails) is queued again for the next
        round."""
        crossings = self.thresholds.take()
        records = self.records
        if not crossings or records is None:
            return 0
        endpoints = list(endpoints)
        try:
            found: dict[str, Subject | None] = {}
            made: list[Timed] = []
            for crossing in crossings:
                # An identity's policy names no key: the identity's record is read.
                subject = (
                    crossing.key_id
                    if crossing.identity is None
                    else identity_subject(crossing.identity)
                )
                if subject not in found:
                    found[subject] = await records(subject)
                record = found[subject]
                if record is not None:
                    made += rate_threshold_deliveries(endpoints, record, crossing)
            return await self.store.make_deliveries(made, now) if made else 0
        except BaseException:
            self.thresholds.give_back(crossings)
            raise

    async def prune(self, now: datetime) -> int:
        """Delete the deliveries delivered or failed more than `retention` before `now`, at
        most `PRUNE_BATCHES` batches of `PRUNE_BATCH`; the number deleted."""
        retention = self.options.retention
        if retention is None:
            return 0
        deleted = 0
        for _ in range(PRUNE_BATCHES):
            batch = await self.store.prune(now - retention, PRUNE_BATCH)
            deleted += batch
            if batch < PRUNE_BATCH:
                break
        return deleted

    def _http(self) -> Any:
        if self._client is None:
            import httpx

            self._client = httpx.AsyncClient(timeout=self.options.timeout, follow_redirects=False)
        return self._client

    def _secrets(self, endpoint: Endpoint, now: datetime) -> list[str]:
        """The secrets to sign a delivery to `endpoint` with at `now`, made again from what
        the store keeps. `ConfigurationError` (`UNSEALABLE`) when the current one was
        sealed with a pepper this process does not have; a previous one in its overlap
        that cannot be made is left out (the new one signs)."""
        hasher = self._hasher
        if hasher is None:
            hasher = self._hasher = Hasher()
        current, *previous = endpoint.secrets(now)
        try:
            made = [unseal_secret(hasher, current)]
        except ConfigurationError:
            self._tell(
                endpoint,
                current,
                logging.ERROR,
                "webhooks: endpoint %s is not sent to: %s (it was sealed with the pepper of "
                "id %s: list that pepper in APIKEYS_OLD_PEPPERS, or give the endpoint a new "
                "secret with apikeys webhooks roll %s)",
                endpoint.id,
                UNSEALABLE,
                sealed_pepper_id(current),
                endpoint.id,
            )
            raise
        if not is_sealed(current) and hasher.pepper_fingerprint != UNPEPPERED:
            self._tell(
                endpoint,
                current,
                logging.WARNING,
                "webhooks: endpoint %s keeps its signing secret in clear in the store (it "
                "was added by an earlier version, or without a pepper): apikeys webhooks "
                "roll %s gives it a sealed one",
                endpoint.id,
                endpoint.id,
            )
        for stored in previous:
            try:
                made.append(unseal_secret(hasher, stored))
            except ConfigurationError:
                self._tell(
                    endpoint,
                    stored,
                    logging.WARNING,
                    "webhooks: endpoint %s: its previous secret, sealed with the pepper of id "
                    "%s, which is not configured, does not sign during its overlap",
                    endpoint.id,
                    sealed_pepper_id(stored),
                )
        return made

    def _tell(self, endpoint: Endpoint, stored: str, level: int, *message: Any) -> None:
        """Log `message` once per endpoint and stored secret (it is never in the message)."""
        if (endpoint.id, stored) not in self._told:
            self._told.add((endpoint.id, stored))
            logger.log(level, *message)

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """POST `body` to `url`, connected to the address its host resolves to now, once
        checked (`resolve_target`); the answer's status. Only the status is read: a body,
        however long or slow, is left unread."""
        target = await resolve_target(url, allow_private=self.options.allow_private_targets)
        if target is None:
            raise _Unresolved
        # To the checked address, never a second resolution (DNS rebinding); the name in
        # the Host header and as the TLS server name, whose certificate is verified. The
        # URL is rebuilt from the parts `validate_url` checked: the HTTP client never
        # parses the host (it would read `0177.0.0.1` otherwise than the resolver does).
        parts = urlsplit(url)
        address = f"[{target.address}]" if ":" in target.address else target.address
        pinned = urlunsplit(
            (parts.scheme, f"{address}:{target.port}", parts.path or "/", parts.query, "")
        )
        extensions = {"sni_hostname": target.host} if parts.scheme == "https" else {}
        async with self._http().stream(
            "POST",
            pinned,
            content=body,
            headers={**headers, "host": parts.netloc},
            extensions=extensions,
        ) as reply:
            return int(reply.status_code)

    async def _send(self, item: Claimed, endpoint: Endpoint | None) -> None:
        response: int | None = None
        error: str | None = None
        if endpoint is None:
            error = "the endpoint was removed"
        else:
            now = utcnow()
            try:
                secrets_ = self._secrets(endpoint, now)
            except ConfigurationError:
                error = UNSEALABLE
            else:
                headers = signed_headers(secrets_, item.id, int(now.timestamp()), item.body)
                try:
                    # The whole exchange within `timeout` (httpx's bounds each read alone: a
                    # receiver sending a byte at a time would outlast the lease).
                    async with asyncio.timeout(self.options.timeout):
                        response = await self._post(endpoint.url, item.body, headers)
                except WebhookTargetRefused:
                    error = REFUSED_INTERNAL
                except _Unresolved:
                    error = "unresolved host"
                except Exception as exc:
                    error = type(exc).__name__
        now = utcnow()
        if response is not None and 200 <= response < 300:
            await self.store.finish(
                item.id,
                self.holder,
                now=now,
                status="delivered",
                next_attempt_at=now,
                response=response,
                error=None,
            )
            return
        then = self.options.next_attempt(item.attempts + 1, item.created_at, now)
        await self.store.finish(
            item.id,
            self.holder,
            now=now,
            status="failed" if then is None else "pending",
            next_attempt_at=now if then is None else then,
            response=response,
            error=error if error is not None else f"HTTP {response}",
        )


class _Unresolved(Exception):
    """An endpoint's host resolved to no address at this attempt."""


def _overlap_ended(endpoint: Endpoint, now: datetime) -> bool:
    """Whether `endpoint` still keeps a previous secret that no longer signs."""
    until = endpoint.previous_until
    return endpoint.previous_secret is not None and (until is None or until <= now)
