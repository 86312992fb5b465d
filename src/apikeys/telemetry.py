"""What apikeys reports about itself: OpenTelemetry metrics, and a plain-Python event hook.

```python
manager = KeyManager(store, metrics=True, on_event=print)
```

- `metrics=True` records on the global OpenTelemetry meter provider (or pass a
  `MeterProvider`); it needs `pip install 'apikeys[otel]'` (opentelemetry-api). Instruments,
  all with low-cardinality attributes (never a key id):

  | instrument | kind | attributes |
  |---|---|---|
  | `apikeys.verifications` | counter | `outcome` (`ok` or the error code), `store` |
  | `apikeys.verification.duration` | histogram, seconds | `outcome`, `store` |
  | `apikeys.cache.lookups` | counter | `result` (`hit` or `miss`), `store` |
  | `apikeys.limiter.decisions` | counter | `decision` (allowed, rate_limited, …) |
  | `apikeys.usage.flush_failures` | counter | `store` |
  | `apikeys.legacy_scheme` | counter | `store` |

- `on_event(event)` is called with a `TelemetryEvent` for each verification, limiter
  refusal, key change (with its `AuditEvent`) and failed usage flush: for your own logging
  or webhooks. It runs inline, so keep it quick (hand slow work to a queue); an exception
  in it is logged and otherwise ignored.

Unused (the default), each hook costs the hot path one attribute test.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apikeys.errors import ConfigurationError
from apikeys.types import AuditEvent

__all__ = ["EventHook", "Telemetry", "TelemetryEvent"]

logger = logging.getLogger("apikeys")


@dataclass(frozen=True, slots=True)
class TelemetryEvent:
    """What `on_event` receives.

    `kind` is `verification`, `limited`, `key_changed`, `usage_flush_failed` or
    `legacy_scheme` (an imported key sent under a migration's legacy scheme). `key_id` is
    the key concerned (None when there is none); `outcome` is `ok` or an error code;
    `audit` is the change, for `key_changed`.
    """

    kind: str
    key_id: str | None = None
    outcome: str | None = None
    audit: AuditEvent | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict, hash=False)


EventHook = Callable[[TelemetryEvent], None]


class Telemetry:
    """The hooks a `KeyManager` reports through; `active` is False when nobody listens."""

    def __init__(
        self, *, metrics: Any = False, on_event: EventHook | None = None, store: str = ""
    ) -> None:
        self.on_event = on_event
        self.store = store
        self._metrics = False
        if metrics:
            meter = _meter(metrics)
            self._verifications = meter.create_counter(
                "apikeys.verifications", unit="{verification}", description="Keys verified"
            )
            self._duration = meter.create_histogram(
                "apikeys.verification.duration",
                unit="s",
                description="Time to verify a key, store or cache included",
            )
            self._cache = meter.create_counter(
                "apikeys.cache.lookups", unit="{lookup}", description="Key cache lookups"
            )
            self._limiter = meter.create_counter(
                "apikeys.limiter.decisions",
                unit="{decision}",
                description="Rate limit and credit decisions",
            )
            self._flush_failures = meter.create_counter(
                "apikeys.usage.flush_failures",
                unit="{failure}",
                description="Usage batches the store did not take (they are retried)",
            )
            self._legacy = meter.create_counter(
                "apikeys.legacy_scheme",
                unit="{request}",
                description="Requests that sent an imported key under a legacy scheme",
            )
            self._metrics = True
        self.active = self._metrics or on_event is not None

    def __repr__(self) -> str:
        return f"Telemetry(metrics={self._metrics}, on_event={self.on_event is not None})"

    def _emit(self, event: TelemetryEvent) -> None:
        hook = self.on_event
        if hook is None:
            return
        try:
            hook(event)
        except Exception:
            logger.exception("apikeys: the on_event hook failed (ignored)")

    def verification(self, key_id: str | None, outcome: str, seconds: float) -> None:
        """A key was verified (`outcome` `ok`) or refused (its error code)."""
        if self._metrics:
            attributes = {"outcome": outcome, "store": self.store}
            self._verifications.add(1, attributes)
            self._duration.record(seconds, attributes)
        self._emit(TelemetryEvent("verification", key_id=key_id, outcome=outcome))

    def cache_lookup(self, hit: bool) -> None:
        if self._metrics:
            self._cache.add(1, {"result": "hit" if hit else "miss", "store": self.store})

    def limiter(self, key_id: str, decision: str, **attributes: Any) -> None:
        """A request was `allowed`, `rate_limited` or `credits_exhausted`."""
        if self._metrics:
            self._limiter.add(1, {"decision": decision})
        if decision != "allowed":
            self._emit(
                TelemetryEvent("limited", key_id=key_id, outcome=decision, attributes=attributes)
            )

    def legacy_scheme(self, key_id: str) -> None:
        """An imported key was sent under a migration's legacy scheme (`Api-Key`)."""
        if self._metrics:
            self._legacy.add(1, {"store": self.store})
        self._emit(TelemetryEvent("legacy_scheme", key_id=key_id))

    def key_changed(self, event: AuditEvent) -> None:
        self._emit(
            TelemetryEvent("key_changed", key_id=event.key_id, outcome=event.action, audit=event)
        )

    def usage_flush_failed(self, error: BaseException) -> None:
        if self._metrics:
            self._flush_failures.add(1, {"store": self.store})
        self._emit(
            TelemetryEvent(
                "usage_flush_failed", outcome=type(error).__name__, attributes={"retried": True}
            )
        )


def _meter(metrics: Any) -> Any:
    try:
        from opentelemetry import metrics as otel_metrics
    except ModuleNotFoundError:
        raise ConfigurationError(
            "metrics need opentelemetry-api. Install it with: pip install 'apikeys[otel]'"
        ) from None
    from apikeys import __version__

    if metrics is True:
        return otel_metrics.get_meter("apikeys", __version__)
    return metrics.get_meter("apikeys", __version__)
