"""Every parser of text a client or workspace user sends is bounded and linear (CONTRACT §12).

The timing test holds no wall-clock limit: it compares each parser's cost on an adversarial
input of a small size with its cost on the same shape 8, 64 and 256 times longer, and allows
four times the growth in size. The shapes are the ones regexes backtrack on (runs of spaces
between two quantifiers, long digit runs, repeated separators, brackets). Each cost is the
least of several timed runs of enough calls to take a few milliseconds, so a loaded machine
slows both sides alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import given
from hypothesis import strategies as st

from apikeys import durations, listing, policies, ratelimit, scopes
from apikeys.addresses import parse_allowlist
from apikeys.cli import main
from apikeys.credentials import bearer_token
from apikeys.errors import APIKeyError, InvalidKeyParameters, MalformedAPIKey, MalformedJSON
from apikeys.importing.foreign import foreign_scheme
from apikeys.keys import parse_key, validate_prefix
from apikeys.leaks.http import parse_json
from apikeys.webhooks.admin import validate_url
from tests.public_surface import assert_all_is_complete, assert_exports_are_documented

SMALL = 64
GROWTH = (8, 64, 256)  # up to 16 KiB, what the settings page's form may hold
SLACK = 4
RUNS = 5
MIN_RUN_SECONDS = 0.004


def _cost(parse: Callable[[Any], object], given: Any) -> float:
    """Seconds per call of `parse(given)`: the least of `RUNS` timed runs."""

    def run(number: int) -> float:
        start = time.perf_counter()
        for _ in range(number):
            with contextlib.suppress(APIKeyError, ValueError):
                parse(given)
        return time.perf_counter() - start

    number = 1
    while (spent := run(number)) < MIN_RUN_SECONDS and number < 1 << 16:
        number *= 4
    return min([spent, *(run(number) for _ in range(RUNS - 1))]) / number


def _metadata(text: str) -> object:
    return policies.check_metadata(text)


# (parser, shape): the shape builds an adversarial input of about n characters.
Shape = Callable[[int], Any]
CASES: dict[str, tuple[Callable[[Any], object], Shape]] = {
    "rate_limit: 1 per, spaces": (ratelimit.parse_policies, lambda n: "1 per" + " " * n + "!"),
    "rate_limit: spaces, slash": (ratelimit.parse_policies, lambda n: "1" + " " * n + "/!"),
    "rate_limit: slash, spaces": (ratelimit.parse_policies, lambda n: "1/" + " " * n + "1 !"),
    "rate_limit: digits": (ratelimit.parse_policies, lambda n: "1" * n + "/second"),
    "rate_limit: named, spaces": (
        ratelimit.parse_policies,
        lambda n: "burst=1 per" + " " * n + "second!",
    ),
    "rate_limit: separators": (ratelimit.parse_policies, lambda n: ",;" * (n // 2)),
    "rate_limit: equals": (ratelimit.parse_policies, lambda n: "a=" * (n // 2)),
    "one limit: 1 per, spaces": (ratelimit.parse_rate_limit, lambda n: "1 per" + " " * n + "!"),
    "one limit: pipes": (ratelimit.parse_rate_limit, lambda n: "1/second|" * (n // 9)),
    "format_policies: 1 per, spaces": (
        ratelimit.format_policies,
        lambda n: "1 per" + " " * n + "!",
    ),
    "credit_refill: 1 per, spaces": (policies.parse_refill, lambda n: "1 per" + " " * n + "x"),
    "credit_refill: spaces": (policies.parse_refill, lambda n: "1" + " " * n + "x"),
    "credit_refill: digits": (policies.parse_refill, lambda n: "1" * n + "/day"),
    "duration: digits": (durations.parse_duration, lambda n: "1" * n + "s"),
    "duration: units": (durations.parse_duration, lambda n: "1d" * (n // 2)),
    "duration: spaces": (durations.parse_duration, lambda n: " " * n + "x"),
    "scope: long": (scopes.validate_scope, lambda n: "a" * n + ":read"),
    "scope: long action": (scopes.validate_scope, lambda n: "a:" + "a" * n + "!"),
    "metadata: brackets": (_metadata, lambda n: "[" * n),
    "metadata: objects": (_metadata, lambda n: '{"a":' * (n // 5)),
    "metadata: backslashes": (_metadata, lambda n: '{"a":"' + "\\" * n),
    "metadata: quotes": (_metadata, lambda n: '"\\"' * (n // 3)),
    "metadata: spaces": (_metadata, lambda n: " " * n + "{}"),
    "owner: long": (policies.check_owner, lambda n: "x" * n),
    "name: long": (lambda text: policies.check_text(text, "name"), lambda n: "x" * n),
    "allowlist: long": (parse_allowlist, lambda n: "1" * n),
    "allowlist: colons": (parse_allowlist, lambda n: ":" * n + "/64"),
    "key token: prefixes": (parse_key, lambda n: "ak_" * (n // 3)),
    "key prefix: long": (validate_prefix, lambda n: "a" * n),
    "authorization header": (bearer_token, lambda n: [b"Bearer " + b"a" * n]),
    "cursor: dots": (listing.decode_cursor, lambda n: "1." * (n // 2)),
    "webhook url: dots": (validate_url, lambda n: "http://" + "a." * (n // 2) + "!"),
    "leak body: brackets": (parse_json, lambda n: b"[" * n),
    "import hash: dollars": (foreign_scheme, lambda n: "pbkdf2_sha256$" + "1$" * (n // 2)),
}


@pytest.mark.parametrize("case", CASES)
def test_every_parser_costs_time_linear_in_its_input(case: str) -> None:
    parse, shape = CASES[case]
    base = _cost(parse, shape(SMALL))
    for growth in GROWTH:
        cost = _cost(parse, shape(SMALL * growth))
        assert cost <= SLACK * growth * base, (
            f"{case}: {growth} times the input took {cost / base:.0f} times as long"
        )


# -- every text gives a value or the parser's own error -----------------------------------

TEXT = st.one_of(
    st.text(),
    st.text(alphabet=' 0123456789/perdaymonthsecond,;=|[]{}":\\', max_size=200),
)
PARSERS: dict[str, tuple[Callable[[Any], object], type[Exception]]] = {
    "parse_policies": (ratelimit.parse_policies, InvalidKeyParameters),
    "parse_rate_limit": (ratelimit.parse_rate_limit, InvalidKeyParameters),
    "format_policies": (ratelimit.format_policies, InvalidKeyParameters),
    "parse_refill": (policies.parse_refill, InvalidKeyParameters),
    "parse_duration": (durations.parse_duration, InvalidKeyParameters),
    "validate_scope": (scopes.validate_scope, InvalidKeyParameters),
    "check_metadata": (_metadata, InvalidKeyParameters),
    "check_owner": (policies.check_owner, InvalidKeyParameters),
    "parse_allowlist": (parse_allowlist, InvalidKeyParameters),
    "parse_key": (parse_key, MalformedAPIKey),
    "validate_prefix": (validate_prefix, InvalidKeyParameters),
    "decode_cursor": (listing.decode_cursor, InvalidKeyParameters),
    "validate_url": (validate_url, InvalidKeyParameters),
}


@pytest.mark.parametrize("name", PARSERS)
@given(text=TEXT)
def test_any_text_gives_a_value_or_the_parsers_error(name: str, text: str) -> None:
    parse, error = PARSERS[name]
    with contextlib.suppress(error):
        parse(text)


@given(body=st.binary() | st.text().map(lambda text: text.encode("utf-8", "surrogatepass")))
def test_any_leak_body_gives_a_value_or_malformed_json(body: bytes) -> None:
    with contextlib.suppress(MalformedJSON):
        parse_json(body)


# -- the bounds themselves ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("parse", "text"),
    [
        (ratelimit.parse_policies, lambda: "1/second" + " " * ratelimit.MAX_POLICIES_LENGTH),
        (ratelimit.parse_rate_limit, lambda: "1/second" + " " * ratelimit.MAX_LIMIT_LENGTH),
        (policies.parse_refill, lambda: "1/day" + " " * policies.MAX_REFILL_LENGTH),
        (durations.parse_duration, lambda: "1d" + " " * durations.MAX_DURATION_LENGTH),
        (scopes.validate_scope, lambda: "a:" + "b" * scopes.MAX_SCOPE_LENGTH),
        (_metadata, lambda: '{"a": 1}' + " " * policies.MAX_METADATA_BYTES),
    ],
)
def test_text_over_its_bound_is_refused_unread(
    parse: Callable[[str], object], text: Callable[[], str]
) -> None:
    with pytest.raises(InvalidKeyParameters, match="at most") as caught:
        parse(text())
    assert len(str(caught.value)) < 600  # the text is never echoed whole


def test_bounds_leave_every_text_that_was_accepted_alone() -> None:
    policies_text = ", ".join(f"p{index}=10000 per 365 days" for index in range(8))
    assert len(ratelimit.parse_policies(policies_text)) == 8
    assert ratelimit.parse_rate_limit("  3 per 2 seconds ").amount == 3
    assert ratelimit.parse_rate_limit("10/ 2 MINUTES").get_expiry() == 120
    assert str(policies.parse_refill(" 5000  PER  month ")) == "5000/month"
    assert str(policies.parse_refill("1000 / day")) == "1000/day"
    assert durations.parse_duration("1w 2d 3h 4m 5s") == timedelta(
        weeks=1, days=2, hours=3, minutes=4, seconds=5
    )
    assert scopes.validate_scope("a" * 64 + ":" + "b" * 64)


MAX_JSON_DEPTH = 32  # apikeys.bounds.MAX_JSON_DEPTH, as docs/security.md states it


def test_metadata_nested_deeper_than_the_bound_is_refused_not_a_recursion_error() -> None:
    deep_text = '{"a": ' + "[" * 2000 + "]" * 2000 + "}"  # within the 4 KiB
    deep_value: list[Any] = []
    for _ in range(3000):
        deep_value = [deep_value]
    for metadata in (deep_text, {"a": deep_value}):
        with pytest.raises(InvalidKeyParameters, match=f"nested more than {MAX_JSON_DEPTH}"):
            policies.check_metadata(metadata)
    fits = {"a": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    assert policies.check_metadata(json.dumps(fits)) == fits
    assert policies.check_metadata(fits) == fits
    too_deep = {"a": [fits["a"]]}
    for metadata in (too_deep, json.dumps(too_deep)):
        with pytest.raises(InvalidKeyParameters, match="nested"):
            policies.check_metadata(metadata)
    # Brackets inside strings are text, not nesting.
    assert policies.check_metadata({"a": "[" * 1000}) == {"a": "[" * 1000}


def test_metadata_that_holds_itself_or_expands_is_refused() -> None:
    looped: dict[str, Any] = {}
    looped["a"] = looped
    shared: list[Any] = []
    for _ in range(22):  # 2**22 values once written out, 22 deep
        shared = [shared, shared]
    for metadata in (looped, {"a": shared}):
        with pytest.raises(InvalidKeyParameters):
            policies.check_metadata(metadata)


def test_metadata_with_a_lone_surrogate_is_refused() -> None:
    for metadata in ('{"a": "\\ud800"}', {"a": "\ud800"}):
        with pytest.raises(InvalidKeyParameters, match="Unicode"):
            policies.check_metadata(metadata)


def _cli(store_url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--store", store_url, *args])


def test_cli_metadata_nested_2000_deep_exits_2_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", "a12lhJ1ZtUxBc1-MiScXH5OOydqusf6GqQcSM1w6H6Q")
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    store_url = f"sqlite:///{tmp_path / 'k.db'}"
    created = _cli(store_url, "create", "--name", "n", "--full-access", "--json")
    assert created.exit_code == 0, created.output
    key_id = json.loads(created.stdout)["id"]
    for metadata in ('{"a": ' + "[" * 2000 + "]" * 2000 + "}", "[" * 4000):
        result = _cli(store_url, "update", key_id, "--metadata", metadata)
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert "metadata" in result.stderr
    shown = _cli(store_url, "show", key_id, "--json")
    assert json.loads(shown.stdout)["metadata"] == {}


@pytest.mark.parametrize("option", ["--name", "--workspace", "--owner"])
def test_cli_text_with_bytes_that_are_not_utf8_exits_2_naming_the_field_not_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str
) -> None:
    # A command line's arguments are decoded with surrogateescape: a byte that is not
    # UTF-8 arrives as a lone surrogate, which no store can encode.
    monkeypatch.setenv("APIKEYS_PEPPER", "a12lhJ1ZtUxBc1-MiScXH5OOydqusf6GqQcSM1w6H6Q")
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    store_url = f"sqlite:///{tmp_path / 'k.db'}"
    values = {"--name": "n", "--workspace": "w", "--owner": "o"}
    values[option] = "a\udcffb"
    args = [arg for pair in values.items() for arg in pair]
    result = _cli(store_url, "create", *args, "--full-access")
    assert result.exit_code == 2, result.output
    assert option.removeprefix("--") in result.stderr
    assert "store" not in result.stderr
    assert _cli(store_url, "list", "--json").stdout.strip() == "[]"


@pytest.mark.parametrize(
    "args",
    [("list", "--workspace"), ("list", "--owner"), ("audit", "--workspace")],
    ids=["list workspace", "list owner", "audit workspace"],
)
def test_cli_filters_with_bytes_that_are_not_utf8_exit_2_naming_the_field_not_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, str]
) -> None:
    monkeypatch.setenv("APIKEYS_PEPPER", "a12lhJ1ZtUxBc1-MiScXH5OOydqusf6GqQcSM1w6H6Q")
    monkeypatch.delenv("APIKEYS_STORE_URL", raising=False)
    store_url = f"sqlite:///{tmp_path / 'k.db'}"
    result = _cli(store_url, *args, "a\udcffb")
    assert result.exit_code == 2, result.output
    assert args[1].removeprefix("--") in result.stderr
    assert "store" not in result.stderr


def test_a_lone_surrogate_in_a_name_workspace_or_owner_is_refused() -> None:
    for text in ("a\ud800", "\udcff", "x\udfffy"):
        with pytest.raises(InvalidKeyParameters, match="Unicode"):
            policies.check_text(text, "name")
        with pytest.raises(InvalidKeyParameters, match="Unicode"):
            policies.check_owner(text)


@pytest.mark.parametrize("name", ["apikeys.bounds"])
def test_the_bounds_module_exports_and_documents_its_names(name: str) -> None:
    assert_all_is_complete(name)
    assert_exports_are_documented(name)


def test_a_leak_body_nested_deeper_than_the_bound_is_malformed_json() -> None:
    with pytest.raises(MalformedJSON, match=f"nested more than {MAX_JSON_DEPTH}"):
        parse_json(b'{"credentials": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    text = b'{"a": "' + b"[" * 50_000 + b'"}'  # brackets in a string are text
    assert parse_json(text) == {"a": "[" * 50_000}


def test_an_import_hash_over_its_bound_is_no_hash_and_is_not_parsed() -> None:
    from apikeys.importing.foreign import MAX_HASH_LENGTH

    digest = "pbkdf2_sha256$600000$salt$" + "A" * MAX_HASH_LENGTH
    assert foreign_scheme(digest) is None


def test_docs_list_each_bound_with_its_value() -> None:
    import importlib
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "security.md").read_text()
    section = text.split("## Bounded input", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| .+? \| (\d+) \w+ \| `(apikeys[\w.]+)\.(\w+)` \|$", section, re.M)
    assert len(rows) == 16
    for value, module, name in rows:
        assert getattr(importlib.import_module(module), name) == int(value), name


PAGE_FIELDS = {
    "rate_limit": "1 per" + " " * 16_000 + "!",
    "credit_refill": "1 per" + " " * 16_000 + "x",
    "metadata": '{"a": ' + "[" * 2000 + "]" * 2000 + "}",
    "credits": "9" * 5000,
    "owner": "x" * 16_000,
    "allowed_ips": "1" * 16_000,
    "expires": "1" * 16_000 + "d",
}


@pytest.mark.parametrize("field", PAGE_FIELDS)
def test_settings_page_fields_over_their_bound_are_a_form_error_not_a_500(field: str) -> None:
    from starlette.datastructures import ImmutableMultiDict

    from apikeys.ui.forms import read_key_form, read_policies

    form = ImmutableMultiDict(
        {"name": "n", "access": "full", "rate_limit": "", field: PAGE_FIELDS[field]}
    )
    values, errors, _ = read_key_form(form, ())
    read_policies(form, values, errors)
    assert set(errors) == {field}
