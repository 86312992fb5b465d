"""What several backends share: usage rows by day, audit events selected in order."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date, datetime

from apikeys.types import AuditEvent, DailyUsage

__all__ = ["ADMITTED", "LEGACY_SCHEME", "days_of", "select_events"]

ADMITTED = "admitted"
"""The outcome of a request that reached the application."""
LEGACY_SCHEME = "legacy_scheme"
"""Counted besides a request's outcome: the key was sent under a legacy scheme (`Api-Key`)."""


def days_of(rows: Iterable[tuple[str, str, int]]) -> list[DailyUsage]:
    """`DailyUsage` per day from `(day "YYYY-MM-DD", outcome, count)` rows, oldest first."""
    by_day: dict[str, dict[str, int]] = {}
    for day, outcome, count in rows:
        outcomes = by_day.setdefault(day, {})
        outcomes[outcome] = outcomes.get(outcome, 0) + count
    return [
        DailyUsage(
            day=date.fromisoformat(day),
            admitted=outcomes.pop(ADMITTED, 0),
            legacy_scheme=outcomes.pop(LEGACY_SCHEME, 0),
            refused=dict(sorted(outcomes.items())),
        )
        for day, outcomes in sorted(by_day.items())
    ]


def select_events(
    events: Iterable[AuditEvent],
    *,
    workspace: str | None,
    key_id: str | None,
    since: datetime | None,
    limit: int,
) -> list[AuditEvent]:
    """The newest `limit` of `events` (oldest first) that match: `audit` of a store that
    keeps its events in order and filters them itself."""
    found = [
        event
        for event in events
        if (workspace is None or event.workspace == workspace)
        and (key_id is None or event.key_id == key_id)
        and (since is None or event.time >= since)
    ]
    return found[-limit:] if limit > 0 else []
