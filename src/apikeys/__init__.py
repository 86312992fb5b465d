"""apikeys: production-grade API keys for any ASGI application."""

from __future__ import annotations

from apikeys.stores import KeyStore, MemoryStore, store_from_url

__all__ = ["KeyStore", "MemoryStore", "store_from_url"]
