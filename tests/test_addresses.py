"""IP allowlists and the client address: parsing, matching, X-Forwarded-For behind proxies."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apikeys.addresses import (
    MAX_ALLOWLIST_ENTRIES,
    Allowlist,
    client_address,
    parse_allowlist,
)
from apikeys.errors import ConfigurationError, InvalidKeyParameters

XFF = b"x-forwarded-for"
MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def scope_with(*forwarded: bytes, client: Any = ("203.0.113.9", 51000)) -> dict[str, Any]:
    headers = [(b"host", b"api.example.com")]
    headers += [(XFF, value) for value in forwarded]
    return {"type": "http", "client": client, "headers": headers}


# --- parse_allowlist ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "normalised"),
    [
        ("10.0.0.0/8", "10.0.0.0/8"),
        ("192.0.2.7", "192.0.2.7/32"),
        ("192.0.2.7/32", "192.0.2.7/32"),
        ("0.0.0.0/0", "0.0.0.0/0"),
        (" 10.0.0.0/8\t", "10.0.0.0/8"),
        ("10.0.0.0/255.0.0.0", "10.0.0.0/8"),
        ("2001:DB8::/32", "2001:db8::/32"),
        ("2001:0db8:0000::/48", "2001:db8::/48"),
        ("::1", "::1/128"),
        ("::/0", "::/0"),
        ("::ffff:192.0.2.7", "192.0.2.7/32"),
        ("::ffff:192.0.2.0/120", "192.0.2.0/24"),
        ("::ffff:0:0/96", "0.0.0.0/0"),
        ("::192.0.2.7", "::c000:207/128"),  # IPv4-compatible (deprecated): stays IPv6
    ],
)
def test_if_range_valid_then_normalised(value: str, normalised: str) -> None:
    assert parse_allowlist([value]) == (normalised,)


def test_if_host_bits_set_then_refused_with_the_network_suggested() -> None:
    with pytest.raises(InvalidKeyParameters, match=r"host bits .*did you mean '10\.0\.0\.0/8'"):
        parse_allowlist(["10.0.0.1/8"])
    with pytest.raises(InvalidKeyParameters, match=r"did you mean '2001:db8::/32'"):
        parse_allowlist(["2001:db8::1/32"])
    with pytest.raises(InvalidKeyParameters, match=r"did you mean '192\.0\.2\.0/24'"):
        parse_allowlist(["::ffff:192.0.2.1/120"])


@pytest.mark.parametrize(
    "value",
    [
        "",
        "   ",
        "garbage",
        "10.0.0",
        "256.0.0.0",
        "010.0.0.1",  # leading zeros: octal or decimal?
        "10.0.0.0/33",
        "10.0.0.0/-1",
        "10.0.0.0/",
        "/8",
        "2001:db8::/129",
        "2001:db8:::1",
        "fe80::%eth0/64",
        "fe80::1%eth0",
        "10.0.0.0/8,192.0.2.0/24",
        "1.2.3.4:80",
        "[2001:db8::1]",
        "\u0661\u0660.0.0.0/8",  # non-ASCII (Arabic-Indic) digits
        "10.0.0.0/\u0668",
        "x" * 1000,
    ],
)
def test_if_range_invalid_then_refused(value: str) -> None:
    with pytest.raises(InvalidKeyParameters, match="invalid IP range"):
        parse_allowlist([value])


@pytest.mark.parametrize("value", [None, 10, b"10.0.0.0/8", ipaddress.ip_network("10.0.0.0/8")])
def test_if_range_not_a_string_then_refused(value: Any) -> None:
    with pytest.raises(InvalidKeyParameters, match="expected a string"):
        parse_allowlist([value])


def test_if_value_long_or_odd_then_the_message_quotes_it_cut_on_one_line() -> None:
    with pytest.raises(InvalidKeyParameters) as caught:
        parse_allowlist(["bad\n" + "z" * 500])
    message = str(caught.value)
    assert "\n" not in message
    assert "'bad\\n" + "z" * 56 + "…'" in message
    assert "z" * 57 not in message


def test_if_invalid_then_error_is_a_value_error_too() -> None:
    with pytest.raises(ValueError, match="invalid IP range"):
        parse_allowlist(["nope"])


def test_if_duplicates_then_dropped_and_first_order_kept() -> None:
    values = ["192.0.2.0/24", "10.0.0.0/8", "192.0.2.0/24", "::ffff:10.0.0.0/104", "::1"]
    assert parse_allowlist(values) == ("192.0.2.0/24", "10.0.0.0/8", "::1/128")


def test_if_ranges_overlap_then_both_kept() -> None:
    assert parse_allowlist(["10.0.0.0/8", "10.1.0.0/16"]) == ("10.0.0.0/8", "10.1.0.0/16")


def test_if_single_string_then_read_as_one_range() -> None:
    assert parse_allowlist("10.0.0.0/8") == ("10.0.0.0/8",)


def test_if_no_ranges_then_empty() -> None:
    assert parse_allowlist([]) == ()
    assert parse_allowlist(iter(())) == ()


def test_if_at_most_the_limit_then_accepted_beyond_refused() -> None:
    hosts = [f"10.0.{i // 256}.{i % 256}" for i in range(MAX_ALLOWLIST_ENTRIES + 1)]
    assert len(parse_allowlist(hosts[:MAX_ALLOWLIST_ENTRIES])) == MAX_ALLOWLIST_ENTRIES
    with pytest.raises(InvalidKeyParameters, match=f"at most {MAX_ALLOWLIST_ENTRIES}"):
        parse_allowlist(hosts)


def test_if_over_the_limit_only_by_duplicates_then_accepted() -> None:
    hosts = [f"10.0.0.{i}" for i in range(MAX_ALLOWLIST_ENTRIES)]
    assert len(parse_allowlist(hosts + hosts)) == MAX_ALLOWLIST_ENTRIES


def test_if_one_range_invalid_then_the_whole_list_is_refused() -> None:
    with pytest.raises(InvalidKeyParameters, match=r"'10\.0\.0\.1/8'"):
        parse_allowlist(["192.0.2.0/24", "10.0.0.1/8"])


networks = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6)).flatmap(
    lambda ip: st.integers(0, ip.max_prefixlen).map(
        lambda length: ipaddress.ip_network((ip, length), strict=False)
    )
)


@given(st.lists(networks, max_size=20))
def test_if_parsed_then_parsing_again_changes_nothing(values: list[Any]) -> None:
    parsed = parse_allowlist([str(network) for network in values])
    assert parse_allowlist(parsed) == parsed
    assert len(set(parsed)) == len(parsed)


# --- Allowlist ---------------------------------------------------------------------------

LIST = Allowlist(["10.0.0.0/8", "192.0.2.7", "2001:db8::/32", "fe80::/10"])


@pytest.mark.parametrize(
    "address",
    [
        "10.0.0.0",
        "10.255.255.255",
        "192.0.2.7",
        "2001:db8::1",
        "2001:DB8:ffff::",
        "::ffff:10.1.2.3",  # an IPv4 client on a dual-stack socket
        "::ffff:a01:203",
        "::ffff:192.0.2.7",
        "fe80::1%eth0",
        "fe80::1%1",
    ],
)
def test_if_address_inside_then_allowed(address: str) -> None:
    assert LIST.allows(address)


@pytest.mark.parametrize(
    "address",
    [
        "11.0.0.0",
        "9.255.255.255",
        "192.0.2.6",
        "192.0.2.8",
        "2001:db9::",
        "::ffff:11.0.0.1",
        "::a00:1",  # IPv4-compatible: an IPv6 address, not 10.0.0.1
        "::1",
        "fe80::1%",
        "",
        "garbage",
        "10.0.0.1 ",
        "10.0.0.1/32",
        "10.0.0.0/8",
        "010.0.0.1",
        "[2001:db8::1]",
        "10.0.0.1:80",
        "testclient",
        "2001:db8::1%" + "x" * 200,
    ],
)
def test_if_address_outside_or_unreadable_then_refused(address: str) -> None:
    assert not LIST.allows(address)


@pytest.mark.parametrize(
    "address", [None, 167772161, b"10.0.0.1", ipaddress.ip_address("10.0.0.1")]
)
def test_if_address_not_a_string_then_refused(address: Any) -> None:
    assert not LIST.allows(address)


def test_if_only_ipv6_ranges_then_ipv4_mapped_clients_are_refused() -> None:
    allowlist = Allowlist(["::/0"])
    assert allowlist.allows("2001:db8::1")
    assert not allowlist.allows("::ffff:10.0.0.1")
    assert not allowlist.allows("10.0.0.1")


def test_if_ipv4_mapped_range_then_ipv4_clients_match_it() -> None:
    allowlist = Allowlist(["::ffff:10.0.0.0/104"])
    assert allowlist.ranges == ("10.0.0.0/8",)
    assert allowlist.allows("10.1.2.3")
    assert allowlist.allows("::ffff:10.1.2.3")


def test_if_everything_allowed_then_both_versions_are_listed() -> None:
    allowlist = Allowlist(["0.0.0.0/0", "::/0"])
    for address in ("1.2.3.4", "::ffff:1.2.3.4", "2001:db8::1", "::"):
        assert allowlist.allows(address)


def test_if_empty_then_parse_returns_none_and_constructor_refuses() -> None:
    assert Allowlist.parse([]) is None
    assert Allowlist.parse(()) is None
    with pytest.raises(InvalidKeyParameters, match="no restriction"):
        Allowlist([])


def test_if_parsed_then_ranges_are_normalised_and_objects_shared() -> None:
    first = Allowlist.parse(["10.0.0.1", "2001:DB8::/32"])
    assert first is not None
    assert first.ranges == ("10.0.0.1/32", "2001:db8::/32")
    assert Allowlist.parse(["10.0.0.1", "2001:DB8::/32"]) is first
    assert first == Allowlist(["10.0.0.1/32", "2001:db8::/32"])
    assert hash(first) == hash(Allowlist(first.ranges))
    assert repr(first) == "Allowlist(['10.0.0.1/32', '2001:db8::/32'])"


def test_if_parse_given_a_string_then_one_range() -> None:
    allowlist = Allowlist.parse("10.0.0.0/8")
    assert allowlist is not None
    assert allowlist.ranges == ("10.0.0.0/8",)


def test_if_parse_given_invalid_ranges_then_refused() -> None:
    with pytest.raises(InvalidKeyParameters, match="host bits"):
        Allowlist.parse(["10.0.0.1/8"])
    with pytest.raises(InvalidKeyParameters, match="expected a string"):
        Allowlist.parse([["10.0.0.0/8"]])  # type: ignore[list-item]


addresses = st.one_of(st.ip_addresses(v=4), st.ip_addresses(v=6))


@given(st.lists(networks, min_size=1, max_size=12), st.lists(addresses, max_size=12))
def test_if_any_ranges_then_allows_agrees_with_ipaddress(
    ranges: list[Any], candidates: list[Any]
) -> None:
    allowlist = Allowlist(str(network) for network in ranges)
    # Also addresses at the edges of each range, where an off-by-one would show.
    edges = [a for network in ranges for a in (network.network_address, network.broadcast_address)]
    for address in [*candidates, *edges]:
        plain = address.ipv4_mapped if address.version == 6 and address.ipv4_mapped else address
        expected = any(network.version == plain.version and plain in network for network in ranges)
        if plain.version == 4:
            # An IPv4-mapped IPv6 range covers the IPv4 addresses it maps.
            as_mapped = ipaddress.IPv6Address(f"::ffff:{plain}")
            expected = expected or any(
                network.version == 6 and network.subnet_of(MAPPED) and as_mapped in network
                for network in ranges
            )
        assert allowlist.allows(str(address)) is expected
        assert allowlist.allows(str(plain)) is expected
        if plain.version == 4:
            assert allowlist.allows(f"::ffff:{plain}") is expected


@given(st.text(max_size=120))
def test_if_any_text_then_allows_answers_without_raising(address: str) -> None:
    assert LIST.allows(address) in (True, False)


# --- client_address ----------------------------------------------------------------------


def test_if_no_trusted_proxies_then_the_connection_address_even_with_forwarded_for() -> None:
    assert client_address(scope_with(b"10.0.0.1")) == "203.0.113.9"
    assert client_address(scope_with(b"10.0.0.1"), 0) == "203.0.113.9"
    assert client_address(scope_with(client=["2001:db8::9", 443])) == "2001:db8::9"


@pytest.mark.parametrize("client", [None, (), [], (None, 0), (b"10.0.0.1", 1), "10.0.0.1"])
def test_if_no_usable_connection_address_then_none(client: Any) -> None:
    assert client_address(scope_with(client=client)) is None
    assert client_address({"type": "http", "headers": []}) is None


def test_if_one_trusted_proxy_then_the_rightmost_entry() -> None:
    scope = scope_with(b"6.6.6.6, 192.0.2.7")
    assert client_address(scope, 1) == "192.0.2.7"


def test_if_two_trusted_proxies_then_the_second_entry_from_the_right() -> None:
    scope = scope_with(b"6.6.6.6, 192.0.2.7, 10.0.0.2")
    assert client_address(scope, 2) == "192.0.2.7"


def test_if_several_headers_then_joined_in_order() -> None:
    scope = scope_with(b"6.6.6.6, 7.7.7.7", b"192.0.2.7", b"10.0.0.2")
    assert client_address(scope, 1) == "10.0.0.2"
    assert client_address(scope, 2) == "192.0.2.7"
    assert client_address(scope, 3) == "7.7.7.7"
    assert client_address(scope, 4) == "6.6.6.6"


def test_if_header_name_in_another_case_then_still_read() -> None:
    scope = {"client": ("10.0.0.9", 1), "headers": [(b"X-Forwarded-For", b"192.0.2.7")]}
    assert client_address(scope, 1) == "192.0.2.7"


@pytest.mark.parametrize("trusted", [1, 2, 3])
def test_if_chain_shorter_than_the_trusted_proxies_then_none(trusted: int) -> None:
    entries = ", ".join(["192.0.2.7"] * (trusted - 1)).encode()
    scope = scope_with(entries) if entries else scope_with()
    assert client_address(scope, trusted) is None


def test_if_no_forwarded_for_header_then_none_not_the_connection_address() -> None:
    assert client_address(scope_with(), 1) is None
    assert client_address({"client": ("10.0.0.9", 1)}, 1) is None


@pytest.mark.parametrize(
    "entry",
    [
        b"",
        b"unknown",
        b"_hidden",
        b"proxy.example.com",
        b"192.0.2.7 extra",
        b"192.0.2.256",
        b"fe80::1%eth0",
        b"1.2.3.4:",
        b"1.2.3.4:99999",
        b"1.2.3.4:http",
        b"[1.2.3.4]:80",
        b"[2001:db8::1",
        b"[2001:db8::1]443",
        b"[2001:db8::1]:",
        b"\xff\xfe\x00",
        b"1.2.3.4\x00",
        b"\xa01.2.3.4",  # NBSP is not HTTP whitespace
        b'for="192.0.2.7"',
    ],
)
def test_if_chosen_entry_not_an_address_then_none(entry: bytes) -> None:
    assert client_address(scope_with(b"192.0.2.1, " + entry), 1) is None


@pytest.mark.parametrize(
    ("entry", "address"),
    [
        (b"192.0.2.7", "192.0.2.7"),
        (b"  192.0.2.7\t", "192.0.2.7"),
        (b"192.0.2.7:5678", "192.0.2.7"),
        (b"2001:DB8::1", "2001:db8::1"),
        (b"2001:db8::1:443", "2001:db8::1:443"),  # unbracketed IPv6: all of it is the address
        (b"[2001:db8::1]", "2001:db8::1"),
        (b"[2001:db8::1]:443", "2001:db8::1"),
        (b"::ffff:192.0.2.7", "::ffff:c000:207"),
    ],
)
def test_if_chosen_entry_an_address_with_or_without_port_then_its_canonical_text(
    entry: bytes, address: str
) -> None:
    assert client_address(scope_with(b"6.6.6.6," + entry), 1) == address


def test_if_an_empty_entry_sits_among_the_trusted_ones_then_none_not_shifted() -> None:
    # An empty entry still counts as a hop, so the choice never slides left into the
    # client's part of the chain.
    assert client_address(scope_with(b"6.6.6.6, 192.0.2.7,, 10.0.0.2"), 2) is None
    assert client_address(scope_with(b"6.6.6.6, 192.0.2.7", b"", b"10.0.0.2"), 2) is None


@pytest.mark.parametrize(
    "headers",
    [
        None,
        "x-forwarded-for: 192.0.2.7",
        b"x-forwarded-for: 192.0.2.7",
        [(XFF,)],
        [(XFF, b"6.6.6.6"), (XFF, "192.0.2.7")],
        [(XFF, b"6.6.6.6"), ("x-forwarded-for", b"192.0.2.7")],
        [(XFF, b"6.6.6.6"), None],
        [(XFF, b"6.6.6.6"), (XFF, b"192.0.2.7", b"extra")],
        iter([(XFF, b"192.0.2.7")]),
    ],
)
def test_if_headers_malformed_then_none(headers: Any) -> None:
    assert client_address({"client": ("10.0.0.9", 1), "headers": headers}, 1) is None


def test_if_headers_are_lists_of_lists_then_read() -> None:
    scope = {"client": ("10.0.0.9", 1), "headers": [[XFF, b"192.0.2.7"]]}
    assert client_address(scope, 1) == "192.0.2.7"


@pytest.mark.parametrize("trusted", [-1, True, 1.0, "1", None])
def test_if_trusted_proxies_not_a_whole_number_from_zero_then_refused(trusted: Any) -> None:
    with pytest.raises(ConfigurationError, match="trusted_proxies"):
        client_address(scope_with(b"192.0.2.7"), trusted)


def test_if_the_result_fails_closed_then_no_allowlist_allows_it() -> None:
    everything = Allowlist(["0.0.0.0/0", "::/0"])
    assert not everything.allows(client_address(scope_with(b"unknown"), 1))
    assert not everything.allows(client_address(scope_with(), 2))
    assert not everything.allows(client_address(scope_with(client="testclient")))


# --- properties: forgery and hostile bytes -----------------------------------------------

forged_entries = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.ip_addresses().map(lambda ip: str(ip).encode()),
        st.sampled_from([b"", b",", b" , ", b"unknown", b"[::1]:80", b"1.2.3.4:80"]),
    ),
    max_size=6,
)
proxy_hops = st.lists(st.ip_addresses().map(str), min_size=1, max_size=4)


@given(
    forged=st.lists(forged_entries, max_size=3),
    appended=proxy_hops,
    merge=st.booleans(),
    space=st.sampled_from([b",", b", ", b" ,\t"]),
)
def test_if_client_forges_forwarded_for_then_the_proxy_appended_address_is_chosen(
    forged: list[list[bytes]], appended: list[str], merge: bool, space: bytes
) -> None:
    # The client sends any X-Forwarded-For headers it likes (any bytes, commas included).
    headers: list[tuple[bytes, bytes]] = [(XFF, b", ".join(entries)) for entries in forged]
    # Then each of the N trusted proxies appends the address it received the request from:
    # the outermost the client's real address, each next one the previous proxy's.
    for hop in appended:
        if merge and headers:
            headers[-1] = (XFF, headers[-1][1] + space + hop.encode())
        else:
            headers.append((XFF, hop.encode()))
    scope = {"type": "http", "client": ("10.0.0.9", 1), "headers": headers}
    chosen = client_address(scope, trusted_proxies=len(appended))
    assert chosen == str(ipaddress.ip_address(appended[0]))


header_names = st.one_of(st.binary(max_size=20), st.sampled_from([XFF, b"X-FORWARDED-FOR"]))


@given(
    headers=st.lists(st.tuples(header_names, st.binary(max_size=80)), max_size=8),
    client=st.one_of(st.none(), st.tuples(st.text(max_size=50), st.integers(0, 65535))),
    trusted=st.integers(0, 6),
)
def test_if_headers_hold_any_bytes_then_no_error_and_an_address_or_none(
    headers: list[tuple[bytes, bytes]], client: Any, trusted: int
) -> None:
    scope = {"type": "http", "client": client, "headers": headers}
    chosen = client_address(scope, trusted)
    if trusted == 0:
        assert chosen == (client[0] if client else None)
    elif chosen is not None:
        assert ipaddress.ip_address(chosen)
    assert LIST.allows(chosen) in (True, False)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10) | st.binary(max_size=10),
        lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner),
        max_leaves=12,
    ),
    st.integers(1, 3),
)
def test_if_headers_any_shape_then_no_error(headers: Any, trusted: int) -> None:
    chosen = client_address({"client": ("10.0.0.9", 1), "headers": headers}, trusted)
    assert chosen is None or ipaddress.ip_address(chosen)
