"""Backends: where keys, webhooks and change notices live. One folder per backend.

- `contract`: what a backend implements (`KeyStore`, `WebhookStore`, `Channel`);
- `memory/`, `sql/` (SQLite, PostgreSQL), `redis/` (single node, Sentinel, Cluster): each
  holds its key store, webhook store, change channel and scripts;
- `registry`: which store a URL builds (`store_from_url`, `register_store`).
"""

from __future__ import annotations

from apikeys.stores.contract import Channel, ChannelError, KeyStore, WebhookStore
from apikeys.stores.memory.store import MemoryStore
from apikeys.stores.registry import register_store, store_from_url

__all__ = [
    "Channel",
    "ChannelError",
    "KeyStore",
    "MemoryStore",
    "WebhookStore",
    "register_store",
    "store_from_url",
]
