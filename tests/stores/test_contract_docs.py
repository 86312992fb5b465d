"""The contract says what `KeyManager` really sends: every record field the manager passes
to `KeyStore.update` is named in that method's docstring (issue 32 found it naming 5 of 11).
Store-independent: a memory store that notes what it is sent."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from apikeys import Hasher, KeyManager
from apikeys.stores import KeyStore, MemoryStore
from apikeys.types import AuditEvent, KeyRecord
from tests.conftest import TEST_PEPPER


class _Noting(MemoryStore):
    """A memory store that keeps the field names of every `update` it is sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: set[str] = set()

    async def update(
        self,
        key_id: str,
        changes: Mapping[str, Any],
        *,
        notice: str | None = None,
        event: AuditEvent | None = None,
    ) -> KeyRecord:
        self.sent.update(changes)
        return await super().update(key_id, changes, notice=notice, event=event)


async def test_the_update_docstring_names_every_field_the_manager_sends() -> None:
    store = _Noting()
    async with KeyManager(store, hasher=Hasher(pepper=TEST_PEPPER)) as manager:
        created = await manager.create(name="a", scopes=["contacts:read"], credits=10)
        key_id = created.record.id
        await manager.update(
            key_id,
            name="b",
            full_access=True,
            rate_limit="10/minute",
            expires_in=None,
            expires_at=None,
            owner="someone",
            metadata={"plan": "pro"},
            allowed_ips=["10.0.0.0/8"],
            credits=5,
            credit_refill="100/day",
        )
        rolled = await manager.roll(key_id)  # the new key takes the old one's balance
        await manager.update(rolled.record.id, credits=7)  # shared with the key it replaces
    documented = set(re.findall(r"`([a-z_]+)`", KeyStore.update.__doc__ or ""))
    assert len(store.sent) == 11, sorted(store.sent)
    assert store.sent <= documented, sorted(store.sent - documented)
