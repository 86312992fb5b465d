"""The test kit's identities: the `make_identity` fixture and `IdentityFactory`,
`make_key(identity=…)`, and the hypothesis strategies for identity ids and records."""

from __future__ import annotations

import textwrap
from dataclasses import asdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apikeys import MemoryStore
from apikeys.errors import InvalidKeyParameters
from apikeys.identities import EDITABLE_FIELDS, IdentityRecord, check_identity_id, identity_changes
from apikeys.ratelimit import parse_policies
from apikeys.testing import IdentityFactory, KeyFactory, in_memory_manager
from apikeys.testing import strategies as ak
from apikeys.testing.factory import close_manager, run_sync
from apikeys.types import utcnow

pytest_plugins = ["pytester"]

USER_TESTS = """
import pytest


async def test_a_key_of_an_identity(make_identity, make_key, apikeys_manager):
    shared = await make_identity(rate_limit="10/minute", credits=100, workspace="acme")
    created = await make_key(identity=shared.id, workspace="acme")
    assert created.record.identity == shared.id
    assert [key.id for key in await apikeys_manager.list(identity=shared.id)] == [
        created.record.id
    ]


def test_in_a_sync_test(make_identity, make_key):
    gone = make_identity.sync("cust_1", status="disabled")
    assert (gone.id, gone.state) == ("cust_1", "disabled")
    assert make_key.sync(identity="cust_1").record.identity == "cust_1"
"""


def test_a_users_suite_gets_make_identity_from_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makefile(
        ".ini",
        pytest="[pytest]\nfilterwarnings =\n    error\nasyncio_mode = auto\n"
        "asyncio_default_fixture_loop_scope = function\n",
    )
    pytester.makepyfile(test_identities=textwrap.dedent(USER_TESTS))
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=2)


async def test_the_factory_makes_identities_in_each_state_with_ids_of_their_own() -> None:
    manager = in_memory_manager()
    try:
        make_identity = IdentityFactory(manager)
        first, second = await make_identity(), await make_identity(name="second")
        assert (first.id, second.id) == ("test-identity-1", "test-identity-2")
        assert (first.state, second.name) == ("active", "second")
        disabled = await make_identity(status="disabled")
        revoked = await make_identity("cust_gone", status="revoked")
        assert (disabled.state, revoked.state) == ("disabled", "revoked")
        assert revoked.revoked_at is not None
        assert await manager.get_identity("cust_gone") == revoked
        with pytest.raises(ValueError, match="status must be one of active, disabled, revoked"):
            await make_identity(status="expired")  # type: ignore[arg-type]
        created = await KeyFactory(manager)(identity=first.id, status="disabled")
        assert (created.record.identity, created.record.state) == (first.id, "disabled")
    finally:
        close_manager(manager)


@given(ak.identity_ids())
def test_every_identity_id_drawn_is_accepted(identity_id: str) -> None:
    assert check_identity_id(identity_id) == identity_id


@given(ak.invalid_identity_ids())
def test_every_invalid_identity_id_drawn_is_refused(text: str) -> None:
    with pytest.raises(InvalidKeyParameters):
        check_identity_id(text)


@given(ak.identity_records(), st.data())
@settings(max_examples=60)
def test_an_identity_record_drawn_is_one_a_store_keeps_and_its_fields_are_valid(
    record: IdentityRecord, data: st.DataObject
) -> None:
    assert record.state in ("active", "disabled", "revoked")
    assert (record.revoked_at is not None) == (record.state == "revoked")
    if record.rate_limit is not None:
        assert parse_policies(record.rate_limit)
    # Every field the operator sets passes `update`'s checks as it is.
    given_fields = {name: getattr(record, name) for name in EDITABLE_FIELDS}
    identity_changes({k: v for k, v in given_fields.items() if v is not None}, utcnow())
    identities = MemoryStore().identities()
    run_sync(identities.insert(record))
    stored = run_sync(identities.get(record.id))
    assert stored == record
    assert stored is not None
    assert asdict(stored) == asdict(record)  # metadata too, which `==` leaves out
    in_acme = data.draw(ak.identity_records(workspace="acme"))
    assert in_acme.workspace == "acme"
