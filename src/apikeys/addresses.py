"""Client addresses and per-key IP allowlists.

An allowlist is a list of CIDR ranges, IPv4 and IPv6 alike. `parse_allowlist` validates and
normalises what an administrator writes; `Allowlist` answers whether an address is inside;
`client_address` finds the address to check in an ASGI scope.

- **Normal form.** Every range is stored as `network/prefix` (`10.0.0.0/8`,
  `2001:db8::/32`); a bare address is a single host (`/32` or `/128`). A range with host
  bits set (`10.0.0.1/8`) is refused, not silently widened. An IPv4-mapped IPv6 range
  (`::ffff:10.0.0.0/104`) is stored as the IPv4 range it means (`10.0.0.0/8`).
- **IPv4 clients are matched against IPv4 ranges only**, also when a dual-stack server
  reports them as `::ffff:a.b.c.d`. IPv6 ranges never cover them: `::/0` means "every IPv6
  client"; allowing everyone takes `0.0.0.0/0` and `::/0`.
- **An empty allowlist means no restriction.** `Allowlist.parse(())` returns `None`, and an
  `Allowlist` object is never empty, so an object always restricts and never means "all".
- **The client address** is the connection's (`scope["client"]`), unless the application
  says how many proxies in front of it it trusts: then it is the entry those proxies
  appended to `X-Forwarded-For`, counted from the right. Entries a client writes itself
  always sit to the left of those, so they cannot choose the address. Anything that cannot
  be read (too short a chain, an entry that is not an address, malformed headers) gives
  `None`, which no allowlist allows: the check fails closed.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Any

from apikeys.errors import ConfigurationError, InvalidKeyParameters

__all__ = ["MAX_ALLOWLIST_ENTRIES", "Allowlist", "client_address", "parse_allowlist"]

MAX_ALLOWLIST_ENTRIES = 100
"""The most (distinct) ranges one allowlist may hold."""

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_MAX_RANGE_LENGTH = 100
"""Longer than any range `ipaddress` accepts (netmask forms included); refused unread."""
_MAX_ADDRESS_LENGTH = 100
"""Longer than any address with a sane scope id; refused unread."""
_MAX_HOP_LENGTH = 64
"""Longer than the longest `X-Forwarded-For` entry read (`[<IPv6>]:65535`, 55 characters)."""
_QUOTE_LENGTH = 60
_HINT = "write an IPv4 or IPv6 address or CIDR range, e.g. '10.0.0.0/8' or '2001:db8::/32'"
_XFF = b"x-forwarded-for"
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")


def _quote(value: object) -> str:
    """`value` for a one-line message: at most 60 characters, control characters escaped."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > _QUOTE_LENGTH:
        text = text[:_QUOTE_LENGTH] + "…"
    return repr(text)


def _unmap(network: _Network) -> _Network:
    """The IPv4 range an IPv4-mapped IPv6 range stands for; any other range unchanged."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_MAPPED):
        mapped = network.network_address.ipv4_mapped
        assert mapped is not None  # inside ::ffff:0:0/96
        return ipaddress.IPv4Network((mapped, network.prefixlen - 96))
    return network


def _parse_range(value: object) -> _Network:
    if not isinstance(value, str):
        raise InvalidKeyParameters(
            f"invalid IP range {_quote(value)}: expected a string, got {type(value).__name__}"
        )
    text = value.strip()
    if not text:
        raise InvalidKeyParameters(f"invalid IP range {_quote(value)}: it is empty; {_HINT}")
    if len(text) > _MAX_RANGE_LENGTH:
        raise InvalidKeyParameters(f"invalid IP range {_quote(value)}: too long; {_HINT}")
    if "%" in text:
        # `ipaddress` accepts `fe80::%eth0/64`; an interface name means nothing in a range.
        raise InvalidKeyParameters(
            f"invalid IP range {_quote(value)}: a range cannot name an interface ('%'); {_HINT}"
        )
    try:
        return _unmap(ipaddress.ip_network(text))
    except ValueError:
        pass
    try:
        loose = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise InvalidKeyParameters(f"invalid IP range {_quote(value)}: {_HINT}") from None
    raise InvalidKeyParameters(
        f"invalid IP range {_quote(value)}: host bits are set; "
        f"did you mean {_unmap(loose).with_prefixlen!r}?"
    )


def _parse_networks(values: Iterable[str]) -> dict[str, _Network]:
    if isinstance(values, str):
        values = [values]
    networks: dict[str, _Network] = {}
    for value in values:
        network = _parse_range(value)
        text = network.with_prefixlen
        if text in networks:
            continue
        if len(networks) == MAX_ALLOWLIST_ENTRIES:
            raise InvalidKeyParameters(
                f"too many IP ranges: an allowlist holds at most {MAX_ALLOWLIST_ENTRIES}"
            )
        networks[text] = network
    return networks


def parse_allowlist(values: Iterable[str]) -> tuple[str, ...]:
    """Validate CIDR ranges and return them normalised, without duplicates, in order.

    Each value is an IPv4 or IPv6 address or range: `10.0.0.0/8`, `192.0.2.7` (read as
    `192.0.2.7/32`), `2001:db8::/32`, `::1` (`::1/128`); surrounding whitespace is ignored
    and an IPv4 netmask (`10.0.0.0/255.0.0.0`) is read as its prefix. The result holds
    each range as `network/prefix`; an IPv4-mapped IPv6 range becomes its IPv4 range
    (`::ffff:192.0.2.0/120` -> `192.0.2.0/24`). Duplicates (also ones written differently)
    are dropped, the first kept. A single string is read as a list of one range.

    Raises `InvalidKeyParameters`, with a one-line message quoting the value (cut to 60
    characters), for a value that is not a string, not an address or range, has host bits
    set (`10.0.0.1/8`: the message suggests `10.0.0.0/8`) or names an interface
    (`fe80::%eth0/64`), and for more than `MAX_ALLOWLIST_ENTRIES` distinct ranges.
    An empty result means the key is not restricted by address.
    """
    return tuple(_parse_networks(values))


def _table(networks: Iterable[_Network], bits: int) -> tuple[tuple[int, frozenset[int]], ...]:
    """`(shift, prefixes)` per prefix length: an address is inside when `int >> shift` is in."""
    by_length: dict[int, set[int]] = {}
    for network in ipaddress.collapse_addresses(networks):  # type: ignore[type-var]
        shift = bits - network.prefixlen
        by_length.setdefault(shift, set()).add(int(network.network_address) >> shift)
    # Widest ranges first: they are the likeliest to match.
    return tuple((shift, frozenset(by_length[shift])) for shift in sorted(by_length, reverse=True))


class Allowlist:
    """The IP ranges a key may be used from, ready to check addresses fast.

    Build it with `Allowlist.parse(ranges)`, which returns `None` for an empty list (no
    restriction) and shares one object per distinct list; `Allowlist(ranges)` refuses an
    empty list, so an `Allowlist` always restricts. Ranges are validated and normalised as
    by `parse_allowlist` (they raise `InvalidKeyParameters` if invalid).

    `allows(address)` is True only for a valid IP address inside one of the ranges.
    """

    __slots__ = ("_ranges", "_v4", "_v6")

    def __init__(self, ranges: Iterable[str]) -> None:
        networks = _parse_networks(ranges)
        if not networks:
            raise InvalidKeyParameters(
                "an empty IP allowlist means no restriction: use Allowlist.parse, "
                "which returns None for it"
            )
        self._ranges = tuple(networks)
        values = networks.values()
        self._v4 = _table((n for n in values if n.version == 4), 32)
        self._v6 = _table((n for n in values if n.version == 6), 128)

    @classmethod
    def parse(cls, ranges: Iterable[str]) -> Allowlist | None:
        """The allowlist of `ranges`, or `None` when there are none (no restriction).

        Objects are cached per distinct tuple of ranges, so calling this on every request
        with a key's stored ranges parses them once.
        """
        if isinstance(ranges, str):
            ranges = (ranges,)
        values = tuple(ranges)
        if all(isinstance(value, str) for value in values):
            return _cached_allowlist(values)
        return cls(values)  # raises InvalidKeyParameters for the non-string

    @property
    def ranges(self) -> tuple[str, ...]:
        """The normalised ranges, as `parse_allowlist` returns them."""
        return self._ranges

    def allows(self, address: str | None) -> bool:
        """True when `address` is a valid IP address inside one of the ranges.

        `None`, a non-string and anything that is not an IP address are never allowed. An
        IPv4-mapped IPv6 address (`::ffff:192.0.2.7`) is checked as the IPv4 address it
        carries, against the IPv4 ranges. An IPv6 scope id (`fe80::1%eth0`) is ignored:
        the address is checked without it.
        """
        if not isinstance(address, str) or len(address) > _MAX_ADDRESS_LENGTH:
            return False
        try:
            ip: _Address = ipaddress.ip_address(address)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        value = int(ip)  # an IPv6 scope id is not part of the integer
        for shift, prefixes in self._v4 if ip.version == 4 else self._v6:
            if value >> shift in prefixes:
                return True
        return False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Allowlist):
            return NotImplemented
        return self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(self._ranges)

    def __repr__(self) -> str:
        return f"Allowlist({list(self._ranges)!r})"


@functools.lru_cache(maxsize=4096)
def _cached_allowlist(ranges: tuple[str, ...]) -> Allowlist | None:
    return Allowlist(ranges) if ranges else None


def _valid_port(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isascii() and text.isdigit() and int(text) <= 65535


def _parse_hop(hop: str) -> _Address | None:
    """The address of one `X-Forwarded-For` entry, or None.

    Accepted: an address (`192.0.2.7`, `2001:db8::1`), an IPv4 address with a port
    (`192.0.2.7:443`), a bracketed IPv6 address with or without a port
    (`[2001:db8::1]`, `[2001:db8::1]:443`). An unbracketed IPv6 address is read whole,
    never as an address and a port. Scope ids, names, `unknown` and anything else: None.
    """
    if not hop or len(hop) > _MAX_HOP_LENGTH or "%" in hop:
        return None
    version = 0
    if hop.startswith("["):
        host, bracket, port = hop[1:].partition("]")
        if not bracket or (port and not (port.startswith(":") and _valid_port(port[1:]))):
            return None
        version = 6
    elif hop.count(":") == 1:
        host, _, port = hop.partition(":")
        if not _valid_port(port):
            return None
        version = 4
    else:
        host = hop
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if version and address.version != version:
        return None
    return address


def client_address(scope: Mapping[str, Any], trusted_proxies: int = 0) -> str | None:
    """The address of the client that sent the request in `scope`, or None if unknown.

    With `trusted_proxies=0` (the default), the connection's peer: `scope["client"][0]`,
    as the server wrote it, or None when the server gave none.

    With `trusted_proxies=N`, the application states that every request reaches it
    through exactly N proxies it trusts, each appending the address it received the
    request from to `X-Forwarded-For`. All `X-Forwarded-For` headers are joined in order
    (with commas) and split into entries; the client is the N-th entry from the right (the
    rightmost was appended by the nearest proxy). A client can only add entries to the
    left of those, so a forged header never chooses the address. The result is the
    entry's address in its canonical text; a port (`192.0.2.7:443`, `[2001:db8::1]:443`)
    and brackets are dropped. None, which no allowlist allows, when the chain has fewer
    than N entries, the N-th is not an IP address (a name, `unknown`, an address with a
    scope id), or the headers are malformed.

    Only set N when the application cannot be reached except through those N proxies:
    a client that connects directly writes the whole header itself.
    """
    if isinstance(trusted_proxies, bool) or not isinstance(trusted_proxies, int):
        raise ConfigurationError(
            f"trusted_proxies must be a whole number, not {type(trusted_proxies).__name__}"
        )
    if trusted_proxies < 0:
        raise ConfigurationError(f"trusted_proxies must be 0 or more, not {trusted_proxies}")
    if trusted_proxies == 0:
        client = scope.get("client")
        if isinstance(client, tuple | list) and client and isinstance(client[0], str):
            return client[0]
        return None
    values = _forwarded_for(scope.get("headers"))
    if not values:
        return None
    entries = ",".join(values).rsplit(",", trusted_proxies)
    if len(entries) < trusted_proxies:
        return None
    address = _parse_hop(entries[-trusted_proxies].strip(" \t"))
    return None if address is None else str(address)


def _forwarded_for(headers: object) -> list[str] | None:
    """The values of every `X-Forwarded-For` header, in order; None for malformed headers.

    Malformed means not a list of `(bytes, bytes)` pairs, anywhere in the list: skipping a
    bad pair could skip the header a trusted proxy wrote and hand the choice to the client.
    """
    if not isinstance(headers, list | tuple):
        return None
    values: list[str] = []
    for header in headers:
        if not isinstance(header, tuple | list) or len(header) != 2:
            return None
        name, value = header
        if not isinstance(name, bytes) or not isinstance(value, bytes):
            return None
        if name.lower() == _XFF:
            values.append(value.decode("latin-1"))
    return values
