"""`apikeys.bounded`: the two policies of the package's size-capped tables, checked against
plain models for all sequences of additions (and reads, for the least recently used)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apikeys.bounded import remember, remember_recent
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

_KEYS = st.integers(min_value=0, max_value=12)
_BOUNDS = st.integers(min_value=1, max_value=6)


@given(bound=_BOUNDS, additions=st.lists(st.tuples(_KEYS, st.integers()), max_size=60))
def test_remember_clears_only_when_a_new_key_finds_the_table_full(
    bound: int, additions: list[tuple[int, int]]
) -> None:
    table: dict[int, int] = {}
    model: dict[int, int] = {}
    for key, value in additions:
        assert remember(table, key, value, bound) == value
        if key not in model and len(model) >= bound:
            model = {}
        model[key] = value
        assert table == model
        assert len(table) <= bound


@given(
    bound=_BOUNDS,
    steps=st.lists(st.tuples(st.booleans(), _KEYS, st.integers()), max_size=60),
)
def test_remember_recent_keeps_the_most_recently_used(
    bound: int, steps: list[tuple[bool, int, int]]
) -> None:
    table: OrderedDict[int, int] = OrderedDict()
    order: list[tuple[int, int]] = []  # least recently used first
    for is_read, key, value in steps:
        held = dict(order)
        if is_read:
            # How readers use the table: a hit moves the entry last.
            if key in table:
                table.move_to_end(key)
                order = [item for item in order if item[0] != key] + [(key, held[key])]
            continue
        assert remember_recent(table, key, value, bound) == value
        order = [item for item in order if item[0] != key] + [(key, value)]
        order = order[-bound:]
        assert list(table.items()) == order


def test_the_bounded_module_exports_and_documents_its_names() -> None:
    assert_all_is_complete("apikeys.bounded")
    assert_exports_are_documented("apikeys.bounded")


@pytest.mark.parametrize("bound", [1, 3])
def test_remember_replaces_a_held_key_without_clearing(bound: int) -> None:
    table = {index: index for index in range(bound)}
    remember(table, 0, -1, bound)
    assert table == {index: -1 if index == 0 else index for index in range(bound)}
