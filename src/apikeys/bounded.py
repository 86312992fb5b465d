"""Size-capped tables: how every in-memory cache of the package stays bounded.

A process remembers things per key id, per route, per stored hash, per counter. Anyone
with a request can add an entry (a new id, a new path), so every such table has a bound,
and what happens at the bound is one of two policies, each with its reason:

- `remember` clears the table when a new entry would pass the bound. For tables whose
  entries take microseconds to make again (a parsed hash, a decoded row, a key's prepared
  check, a rate limit's plan, a route's scopes): a hit is a plain `dict` lookup with no
  bookkeeping at all, which is what the request path is made of, and a full table costs
  one rebuild of each live entry, spread over the next requests.
- `remember_recent` drops the least recently used entry (an `OrderedDict`, whose readers
  call `move_to_end` on a hit). For tables whose entries cost a store read or a slow hash
  to make again (`KeyCache`'s records, hashing's cache of slow verifications), so that a
  flood of new ids pushes out only the cold ones; and for tables that are a defence
  (the failure counts of stored hashes), which a flood must never wipe all at once: that
  would give every guesser a fresh budget.

Readers use the table as the `dict` (or `OrderedDict`) it is: only adding goes through here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["remember", "remember_recent"]

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(table: dict[_K, _V], key: _K, value: _V, bound: int) -> _V:
    """Set `table[key] = value`, clearing `table` first if a new key would make it hold
    more than `bound` entries; returns `value`. (A key already there is replaced without
    clearing.)"""
    if len(table) >= bound and key not in table:
        table.clear()
    table[key] = value
    return value


def remember_recent(table: OrderedDict[_K, _V], key: _K, value: _V, bound: int) -> _V:
    """Set `table[key] = value` as its most recently used entry, dropping the least
    recently used ones beyond `bound`; returns `value`."""
    table[key] = value
    table.move_to_end(key)
    while len(table) > bound:
        table.popitem(last=False)
    return value
