"""Key stores: where keys live. Pick one with `store_from_url`."""

from __future__ import annotations

from apikeys.stores.base import KeyStore, register_store, store_from_url
from apikeys.stores.memory import MemoryStore

__all__ = ["KeyStore", "MemoryStore", "register_store", "store_from_url"]
