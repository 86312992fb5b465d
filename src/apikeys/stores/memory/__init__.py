"""The memory backend: keys, webhooks and their deliveries in this process's dicts.

- `store`: `MemoryStore`, the key store (and the default `memory://`).
- `identities`: `MemoryIdentities`, its identities.
- `webhooks`: `MemoryWebhooks`, its webhook endpoints and deliveries.

No change channel: a memory store is its own process's, so there is nothing to tell.
"""

from __future__ import annotations

from apikeys.stores.memory.identities import MemoryIdentities
from apikeys.stores.memory.store import MemoryStore
from apikeys.stores.memory.webhooks import MemoryWebhooks

__all__ = ["MemoryIdentities", "MemoryStore", "MemoryWebhooks"]
