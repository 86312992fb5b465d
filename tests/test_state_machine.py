"""A hypothesis state machine over KeyManager, checked against a plain model, on every store.

Rules create, disable, enable, revoke, roll and verify keys, and spend and set their credits,
in any order; whenever it is looked at (all records listed, or one read), the store's view
(statuses, counts, credits) must equal the model's, and every verification and spend must
give exactly the outcome the model predicts. A rolled key and its successors share one
balance in the model (CONTRACT §3): a spend by any of them is a spend of all.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    rule,
    run_state_machine_as_test,
)

from apikeys import (
    InvalidAPIKey,
    InvalidTransition,
    KeyDisabled,
    KeyExpired,
    KeyManager,
    KeyRecord,
    KeyRevoked,
    store_from_url,
)
from apikeys.errors import APIKeyError
from apikeys.hashing import Hasher
from apikeys.stores import KeyStore
from tests.conftest import delete_redis_keys, redis_prefix
from tests.test_manager import wrong_secret

T = TypeVar("T")
HASHER = Hasher(pepper="wzoCebzqnuLooVrQHcXiRm_dhbiO7AGB9zmkk2EytaQ")
WORKSPACE = "machine"
CREDITS = st.integers(0, 30) | st.none()


@dataclass
class Balance:
    """The credits of a key and of every key that replaced it: one count for all."""

    credits: int | None = None


@dataclass
class ModelKey:
    balance: Balance
    state: str = "active"
    expired: bool = False
    uses: int = 0
    rolled: bool = False

    @property
    def credits(self) -> int | None:
        return self.balance.credits

    @credits.setter
    def credits(self, credits: int | None) -> None:
        self.balance.credits = credits

    @property
    def status(self) -> str:
        if self.state != "active":
            return self.state
        return "expired" if self.expired else "active"


EXPECTED_ERROR: dict[str, type[APIKeyError]] = {
    "disabled": KeyDisabled,
    "revoked": KeyRevoked,
    "expired": KeyExpired,
}


def build_machine(make_store: Callable[[], Awaitable[KeyStore]]) -> type[RuleBasedStateMachine]:
    class ManagerMachine(RuleBasedStateMachine):
        keys = Bundle("keys")
        tokens = Bundle("tokens")

        def __init__(self) -> None:
            super().__init__()
            self.runner = asyncio.Runner()
            self.store = self.run(make_store())
            self.manager = KeyManager(self.store, hasher=HASHER, usage_flush_interval=3600)
            self.model: dict[str, ModelKey] = {}
            self.records: dict[str, KeyRecord] = {}  # as created: spending needs only the id
            self.cleanup: Callable[[], Awaitable[None]] | None = getattr(
                self.store, "test_cleanup", None
            )

        def run(self, awaitable: Awaitable[T]) -> T:
            async def wrapper() -> T:
                return await awaitable

            return self.runner.run(wrapper())

        def teardown(self) -> None:
            try:
                self.run(self.manager.aclose())
                if self.cleanup is not None:
                    self.run(self.cleanup())
            finally:
                self.runner.close()

        def _add(self, created: Any, balance: Balance) -> tuple[str, str]:
            self.model[created.record.id] = ModelKey(balance=balance)
            self.records[created.record.id] = created.record
            return created.record.id, created.key

        @rule(target=tokens, full=st.booleans(), credits=CREDITS)
        def create(self, full: bool, credits: int | None) -> tuple[str, str]:
            if full:
                created = self.run(
                    self.manager.create(
                        name="k", workspace=WORKSPACE, full_access=True, credits=credits
                    )
                )
            else:
                created = self.run(
                    self.manager.create(
                        name="k", workspace=WORKSPACE, scopes=["contacts:read"], credits=credits
                    )
                )
            return self._add(created, Balance(credits))

        def _transition(self, action: str, key: tuple[str, str], target: str) -> None:
            key_id = key[0]
            entry = self.model[key_id]
            refused = entry.state == "revoked" and action != "revoke"
            # A rolled key working through its grace period is revoked, not disabled.
            refused |= action == "disable" and entry.rolled and entry.status == "active"
            if refused:
                with pytest.raises(InvalidTransition):
                    self.run(getattr(self.manager, action)(key_id))
                return
            record = self.run(getattr(self.manager, action)(key_id))
            entry.state = target
            assert record.status == entry.status

        @rule(key=tokens)
        def disable(self, key: tuple[str, str]) -> None:
            self._transition("disable", key, "disabled")

        @rule(key=tokens)
        def enable(self, key: tuple[str, str]) -> None:
            self._transition("enable", key, "active")

        @rule(key=tokens)
        def revoke(self, key: tuple[str, str]) -> None:
            self._transition("revoke", key, "revoked")

        @rule(target=tokens, key=tokens, immediate=st.booleans())
        def roll(self, key: tuple[str, str], immediate: bool) -> tuple[str, str]:
            key_id = key[0]
            entry = self.model[key_id]
            grace = timedelta(0) if immediate else timedelta(hours=1)
            if entry.state != "active" or entry.rolled:
                # Revoked, disabled (enable it first) or rolled already (one successor).
                with pytest.raises(InvalidTransition):
                    self.run(self.manager.roll(key_id, grace=grace))
                return key  # the bundle gets the old key again: nothing new exists
            created = self.run(self.manager.roll(key_id, grace=grace))
            entry.rolled = True
            if immediate:
                entry.expired = True
            # The new key holds the balance both spend from now: one count for the pair.
            return self._add(created, entry.balance)

        @rule(key=tokens, cost=st.integers(1, 3))
        def spend(self, key: tuple[str, str], cost: int) -> None:
            key_id = key[0]
            entry = self.model[key_id]
            left = self.run(self.manager.spend_credits(self.records[key_id], cost))
            if entry.state == "revoked" or entry.credits is None or entry.credits < cost:
                assert left is None
            else:
                entry.credits -= cost
                assert left == entry.credits

        @rule(key=tokens, credits=CREDITS, direct=st.booleans())
        def set_credits(self, key: tuple[str, str], credits: int | None, direct: bool) -> None:
            key_id = key[0]
            entry = self.model[key_id]
            if direct:  # the store's own contract, without the reads the manager makes first
                record = self.run(self.store.update(key_id, {"credits": credits}))
                if entry.state != "revoked":
                    assert record.credits == credits
                    if not entry.rolled:  # a rolled key's own count is no longer spent
                        entry.credits = credits
                return
            if entry.state == "revoked" or (entry.rolled and credits != entry.credits):
                # A rolled key's credits are its successor's: changed there (given as they
                # are, they change nothing and are not refused).
                with pytest.raises(InvalidTransition):
                    self.run(self.manager.update(key_id, credits=credits))
                return
            assert self.run(self.manager.update(key_id, credits=credits)).credits == credits
            entry.credits = credits

        @rule(key=tokens)
        def get(self, key: tuple[str, str]) -> None:
            key_id = key[0]
            record = self.run(self.manager.get(key_id))
            assert record.credits == self.model[key_id].credits

        @rule(key=tokens, tamper=st.booleans())
        def verify(self, key: tuple[str, str], tamper: bool) -> None:
            key_id, token = key
            entry = self.model[key_id]
            if tamper:
                with pytest.raises(InvalidAPIKey):
                    self.run(self.manager.verify(wrong_secret(token)))
                return
            expected = EXPECTED_ERROR.get(entry.status)
            if expected is None:
                assert self.run(self.manager.verify(token)).id == key_id
                entry.uses += 1
            else:
                with pytest.raises(expected):
                    self.run(self.manager.verify(token))

        @rule()
        def flush(self) -> None:
            self.run(self.manager.flush())

        # A rule, not an invariant: reading every record after every step would hide a
        # store that folds changes into its records lazily (the memory store's credits).
        @rule()
        def store_matches_model(self) -> None:
            records = {record.id: record for record in self.run(self.manager.list(WORKSPACE))}
            assert set(records) == set(self.model)
            for key_id, entry in self.model.items():
                assert records[key_id].status == entry.status, key_id
                assert records[key_id].request_count == entry.uses, key_id
                assert records[key_id].credits == entry.credits, key_id

    return ManagerMachine


@pytest.mark.parametrize("store_kind", ["memory", "sqlite", "postgres", "redis"], indirect=False)
def test_manager_state_machine_matches_model(
    store_kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if store_kind == "memory":

        async def make_store() -> KeyStore:
            return store_from_url("memory://")

        examples = 150
    else:
        if store_kind == "sqlite":
            pytest.importorskip("sqlalchemy")
            url, options = "", {}
        elif store_kind == "postgres":
            url, options = request.getfixturevalue("postgres_url"), {}
        else:
            url, options = request.getfixturevalue("redis_url"), {}

        async def make_store() -> KeyStore:
            unique = uuid.uuid4().hex[:10]
            if store_kind == "sqlite":
                store = store_from_url(f"sqlite:///{tmp_path / f'{unique}.db'}")
            elif store_kind == "postgres":
                store = store_from_url(url, table_name=f"machine_{unique}", **options)
            else:
                prefix = redis_prefix("machine")
                store = store_from_url(url, key_prefix=f"{prefix}:", **options)
                store.test_cleanup = functools.partial(  # type: ignore[attr-defined]
                    delete_redis_keys, url, f"*{prefix}*"
                )
            await store.setup()
            return store

        examples = 20
    machine = build_machine(make_store)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
