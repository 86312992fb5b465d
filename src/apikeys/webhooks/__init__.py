"""Webhooks: signed events about keys, delivered at least once and in order per key.

Every change to a key is stored with its event in the same transaction or script as the
change (the store's change log is the outbox), and any running process with a `KeyManager`
delivers it (see docs/webhooks.md).
"""

from __future__ import annotations

from apikeys.stores.contract import WebhookStore
from apikeys.webhooks.delivery import DEFAULT_RETRY_DELAYS, Deliverer, DeliveryOptions
from apikeys.webhooks.events import EVENT_TYPES, event_body, record_from_snapshot
from apikeys.webhooks.model import Claimed, Delivery, DeliveryStatus, Endpoint
from apikeys.webhooks.signing import SECRET_PREFIX, new_secret, sign, signed_headers

__all__ = [
    "DEFAULT_RETRY_DELAYS",
    "EVENT_TYPES",
    "SECRET_PREFIX",
    "Claimed",
    "Deliverer",
    "Delivery",
    "DeliveryOptions",
    "DeliveryStatus",
    "Endpoint",
    "WebhookStore",
    "event_body",
    "new_secret",
    "record_from_snapshot",
    "sign",
    "signed_headers",
]
