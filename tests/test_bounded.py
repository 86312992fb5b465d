"""`apikeys.bounded`: the two policies of the package's size-capped tables, checked against
plain models for all sequences of additions (and reads, for the least recently used), and
a scan of the source that no table caps itself by hand."""

from __future__ import annotations

import ast
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import apikeys
from apikeys import Hasher, KeyManager, MemoryStore
from apikeys.bounded import remember, remember_recent
from apikeys.manager.verification import _PLAIN_LIMIT
from tests.conftest import TEST_PEPPER
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


# Tables capped another way on purpose: a lease keeps every lease of one script when it
# resets (a reset between two of them would drop one with its units), and
# the SQLite channel forgets the sequence numbers of a whole batch once it is read.
_CAPPED_BY_HAND = {("ratelimit/leases.py", "lease"), ("stores/sql/sqlite_channel.py", "probe")}


def _caps_by_hand(node: ast.If) -> bool:
    """An `if len(...) >= n` / `> n` (or a `while`) whose body clears or pops a table."""
    test = node.test
    if not (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Call)
        and isinstance(test.left.func, ast.Name)
        and test.left.func.id == "len"
        and isinstance(test.ops[0], ast.Gt | ast.GtE)
    ):
        return False
    for part in ast.walk(ast.Module(body=node.body, type_ignores=[])):
        if (
            isinstance(part, ast.Call)
            and isinstance(part.func, ast.Attribute)
            and part.func.attr in {"clear", "popitem"}
        ):
            return True
        if isinstance(part, ast.Assign) and isinstance(part.value, ast.DictComp | ast.Dict):
            return True
    return False


def test_no_table_in_the_package_caps_itself_by_hand() -> None:
    """Every size-capped table goes through `apikeys.bounded` (a `len` check before a
    `clear`, a `popitem` or a fresh dict is the shape written by hand)."""
    root = Path(apikeys.__file__).parent
    found = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "bounded.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.If | ast.While) and _caps_by_hand(node):  # type: ignore[arg-type]
                    found.add((path.relative_to(root).as_posix(), function.name))
    assert found == _CAPPED_BY_HAND


@pytest.mark.parametrize("bound", [1, 3])
def test_remember_replaces_a_held_key_without_clearing(bound: int) -> None:
    table = {index: index for index in range(bound)}
    remember(table, 0, -1, bound)
    assert table == {index: -1 if index == 0 else index for index in range(bound)}


async def test_a_new_version_of_a_key_leaves_a_full_table_of_prepared_checks_whole() -> None:
    # The manager prepares each version of a key once; a key's new version replaces its
    # entry, and must not empty the table of every other key's (each would then cost a
    # preparation again).
    manager = KeyManager(MemoryStore(), hasher=Hasher(pepper=TEST_PEPPER))
    try:
        created = await manager.create(name="first", scopes=["contacts:read"])
        key_id = created.record.id
        assert manager.verify_now(created.key, count=False) is not None
        prepared = manager._plain[key_id]
        for index in range(_PLAIN_LIMIT - 1):
            manager._plain[f"other{index}"] = prepared
        await manager.update(key_id, name="second")
        record = manager.verify_now(created.key, count=False)
        assert record is not None
        assert record.name == "second"
        assert len(manager._plain) == _PLAIN_LIMIT
        assert manager._plain[key_id] is not prepared
    finally:
        await manager.aclose()
