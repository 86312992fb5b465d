"""Where a webhook may be sent: to public addresses only, unless the operator allows more.

An endpoint's URL is chosen by whoever adds it, and its delivery status is shown to the
workspace: a URL that reaches the delivering host's own network (loopback, RFC 1918, ULA,
link-local with the cloud metadata service, CGNAT, multicast, reserved) would let it probe
that network. So the host is resolved, every address it resolves to is checked (an IPv6
address that embeds an IPv4 one, mapped, 6to4, Teredo or NAT64, is checked as that one),
and the connection is made to the address that was checked, with the URL's name in the
`Host` header and as the TLS server name (httpx's `sni_hostname` extension): a name that
resolves elsewhere a moment later (DNS rebinding) changes nothing. Every spelling of an
address (`2130706433`, `0177.0.0.1`, `0x7f.1`, `[::ffff:127.0.0.1]`, `localhost.`) is
resolved as the system resolver reads it, so each is refused as the address it is.

`DeliveryOptions(allow_private_targets=True)`, or `APIKEYS_WEBHOOKS_ALLOW_PRIVATE=1`,
lets an operator send to internal receivers (a service on the same network, tests).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from apikeys.errors import WebhookTargetRefused

__all__ = [
    "ALLOW_PRIVATE_ENV",
    "REFUSED_INTERNAL",
    "Target",
    "allow_private_from_env",
    "is_internal",
    "resolve_target",
]

ALLOW_PRIVATE_ENV = "APIKEYS_WEBHOOKS_ALLOW_PRIVATE"
"""Set to 1 (true, yes, on) to allow endpoints on internal addresses."""

REFUSED_INTERNAL = "refused: internal address"
"""A delivery's `last_error` when its endpoint is, or resolves to, an internal address."""

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_CGNAT = ipaddress.ip_network("100.64.0.0/10")


def allow_private_from_env() -> bool:
    """Whether `APIKEYS_WEBHOOKS_ALLOW_PRIVATE` allows internal targets."""
    return os.environ.get(ALLOW_PRIVATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (and reaches) on the way, if any."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def is_internal(address: _Address) -> bool:
    """Whether `address` is one a webhook is not sent to by default: anything but a
    global unicast address (and an IPv6 address embedding an internal IPv4 one)."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded(address)
        if embedded is not None and is_internal(embedded):
            return True
        if address.is_site_local:
            return True
    elif address in _CGNAT:
        return True
    return (
        not address.is_global
        or address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


@dataclass(frozen=True, slots=True)
class Target:
    """Where a URL's request goes: `address`, the checked IP it connects to, and the
    URL's `host` (the `Host` header's name and the TLS server name)."""

    host: str
    port: int
    address: str


def _host(name: str) -> str:
    """The name to resolve: lowercase, without one trailing dot (`localhost.` is
    `localhost`); an IPv6 literal as is."""
    name = name.lower()
    return name[:-1] if name.endswith(".") and ":" not in name else name


async def resolve_target(url: str, *, allow_private: bool) -> Target | None:
    """Resolve `url`'s host and check each address it resolves to: the `Target` to connect
    to (the first address), or None when the name does not resolve now.

    `WebhookTargetRefused` when the host is, or resolves to, an internal address (see the
    module doc) and `allow_private` is false."""
    parts = urlsplit(url)
    host = _host(parts.hostname or "")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    if not allow_private and (host == "localhost" or host.endswith(".localhost")):
        raise WebhookTargetRefused(host)
    try:
        found = await asyncio.get_running_loop().getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
        )
    except (socket.gaierror, UnicodeError):
        return None
    addresses = [
        ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        for family, _, _, _, sockaddr in found
        if family in (socket.AF_INET, socket.AF_INET6)
    ]
    if not addresses:
        return None
    if not allow_private and any(is_internal(address) for address in addresses):
        raise WebhookTargetRefused(host)
    return Target(host=host, port=port, address=str(addresses[0]))
