"""Hypothesis strategies for identities: their ids (accepted and refused) and their
records, as `apikeys.testing.strategies` gives them (`ak.identity_ids()`, …).

This module needs the `testing` extra (`pip install "apikeys[testing]"`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import get_args

from hypothesis import strategies as st

from apikeys.errors import InvalidKeyParameters
from apikeys.identities import (
    IDENTITY_ID_PATTERN,
    MAX_IDENTITY_ID_LENGTH,
    IdentityRecord,
    check_identity_id,
)
from apikeys.ratelimit import format_policies
from apikeys.types import StoredState

__all__ = ["identity_ids", "identity_records", "invalid_identity_ids"]


def identity_ids() -> st.SearchStrategy[str]:
    """Identity ids that `check_identity_id` accepts: 1 to 64 letters, digits and
    `. _ @ + -`, starting with a letter or a digit (`cust_42`, `user@example.com`)."""
    return st.from_regex(IDENTITY_ID_PATTERN, fullmatch=True)


def _refused(text: str) -> bool:
    try:
        check_identity_id(text)
    except InvalidKeyParameters:
        return True
    return False


def invalid_identity_ids() -> st.SearchStrategy[str]:
    """Text that `check_identity_id` refuses: empty, too long, a first character that is
    not a letter or digit, or a character an id never holds (`/ { } :`, spaces, others)."""
    return st.one_of(
        st.just(""),
        st.text(st.sampled_from("ab1"), min_size=MAX_IDENTITY_ID_LENGTH + 1, max_size=80),
        st.builds(str.__add__, st.sampled_from("._@+-/:{} "), identity_ids()),
        st.builds(
            lambda head, bad, tail: head + bad + tail,
            identity_ids(),
            st.sampled_from(["/", "{", "}", ":", " ", "\n", "\u00e9", "*"]),
            st.text(st.sampled_from("abc"), max_size=3),
        ),
    ).filter(_refused)


_STATES: tuple[StoredState, ...] = get_args(StoredState)
_POLICY_NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,15}", fullmatch=True)
_LIMIT = st.builds(
    "{}/{}".format, st.integers(1, 10_000), st.sampled_from(("second", "minute", "hour", "day"))
)


def _limits() -> st.SearchStrategy[str]:
    """One limit (`100/minute`) or named policies (`burst=10/second, daily=1000/day`)."""
    named = st.dictionaries(_POLICY_NAMES, _LIMIT, min_size=1, max_size=3).map(format_policies)
    return st.one_of(_LIMIT, named)


@st.composite
def _identity_record(draw: st.DrawFn, workspace: str | None) -> IdentityRecord:
    moments = st.datetimes(
        min_value=datetime(2020, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
    )
    state = draw(st.sampled_from(_STATES))
    refill = draw(
        st.one_of(
            st.none(),
            st.builds("{}/{}".format, st.integers(1, 10**6), st.sampled_from(("day", "month"))),
        )
    )
    return IdentityRecord(
        id=draw(identity_ids()),
        workspace=workspace
        if workspace is not None
        else draw(st.from_regex(r"[a-z][a-z0-9-]{0,20}", fullmatch=True)),
        state=state,
        created_at=draw(moments),
        name=draw(
            st.one_of(
                st.none(),
                st.text(
                    st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")),
                    min_size=1,
                    max_size=40,
                ),
            )
        ),
        metadata=draw(
            st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), max_size=3)
        ),
        rate_limit=draw(st.one_of(st.none(), _limits())),
        credits=draw(st.one_of(st.none(), st.integers(0, 10**9))),
        credit_refill=refill,
        credits_refilled_at=draw(moments) if refill is not None else None,
        revoked_at=draw(moments) if state == "revoked" else None,
    )


def identity_records(workspace: str | None = None) -> st.SearchStrategy[IdentityRecord]:
    """Identities as a store keeps them: any valid id, in `workspace` (else a random
    one), `active`, `disabled` or `revoked` (with `revoked_at`), with or without a name,
    metadata, a rate limit, credits and a refill (with the period it was refilled for)."""
    return _identity_record(workspace)
