"""Bounds on the text that clients and workspace users send, checked before any parser.

Every parser of such text (rate limits, credit refills, durations, scopes, metadata, IP
ranges, cursors, webhook URLs, …) checks its size here, inside the parser, so the settings
page, the command line, the Python API and any HTTP API are bounded alike. The regexes
those parsers run are anchored and have no two quantifiers that can take the same
character (or are possessive where they could), so parsing costs time linear in the size.

JSON recurses once per level of nesting in `json.loads` and `json.dumps`: a text or value
nested thousands deep raises `RecursionError`. `check_json_text` and `check_json_value`
measure the depth with one loop, without recursion, before either runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from apikeys.errors import InvalidKeyParameters

__all__ = ["MAX_JSON_DEPTH", "check_json_text", "check_json_value", "check_length"]

MAX_JSON_DEPTH: Final = 32
"""The deepest nesting of arrays and objects accepted in JSON that a user sends."""

# A JSON string (closed or not: an unclosed one runs to the end, so nothing is scanned
# twice) or one bracket. Both quantifiers are possessive: one pass over the text.
_JSON_TOKEN: Final = re.compile(r'"(?:[^"\\]++|\\.)*+"?|[\[{]|[\]}]', re.DOTALL)


def check_length(text: object, limit: int, what: str) -> str:
    """`text` if it is a str of at most `limit` characters; else `InvalidKeyParameters`
    saying that `what` is too long (or not text)."""
    if not isinstance(text, str):
        raise InvalidKeyParameters(f"{what} must be text")
    if len(text) > limit:
        raise InvalidKeyParameters(f"{what} is {len(text)} characters; at most {limit} are allowed")
    return text


def _too_deep(what: str, limit: int) -> InvalidKeyParameters:
    return InvalidKeyParameters(f"{what} is nested more than {limit} levels deep")


def check_json_text(text: str, what: str, limit: int = MAX_JSON_DEPTH) -> str:
    """`text` if its arrays and objects nest at most `limit` deep; else
    `InvalidKeyParameters`. Brackets inside strings do not count. Linear, no recursion;
    whether `text` is valid JSON is left to `json.loads`."""
    if text.count("[") + text.count("{") <= limit:
        return text
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        char = token[0][0]
        if char in "[{":
            depth += 1
            if depth > limit:
                raise _too_deep(what, limit)
        elif char in "]}":
            depth -= 1
    return text


def check_json_value(
    value: object, what: str, limit: int = MAX_JSON_DEPTH, max_items: int = 65_536
) -> object:
    """`value` if its lists, tuples and mappings nest at most `limit` deep and it holds at
    most `max_items` values in all; else `InvalidKeyParameters`. Walked with a stack, no
    recursion, and never more than `max_items` steps: a value that holds itself, or the
    same list many times over, is refused rather than expanded."""
    stack: list[tuple[object, int]] = [(value, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > max_items:
            raise InvalidKeyParameters(f"{what} holds more than {max_items} values")
        if isinstance(item, Mapping):
            children: list[object] = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            children = list(item)
        else:
            continue
        if depth >= limit:
            raise _too_deep(what, limit)
        if len(children) > max_items:
            raise InvalidKeyParameters(f"{what} holds more than {max_items} values")
        stack.extend((child, depth + 1) for child in children)
    return value
