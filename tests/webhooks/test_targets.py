"""Webhooks go to public addresses only, unless the operator allows internal ones.

Every spelling of an internal address is refused when an endpoint is added and when a
delivery is sent (its host resolved then, and the connection made to the address checked);
`allow_private` / `APIKEYS_WEBHOOKS_ALLOW_PRIVATE=1` lets them through. All traffic here
stays on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import socket
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from apikeys import KeyManager, MemoryStore, WebhookTargetRefused
from apikeys.cli import main
from apikeys.stores.contract import WebhookStore
from apikeys.webhooks import Deliverer, DeliveryOptions
from apikeys.webhooks.admin import add_endpoint
from apikeys.webhooks.targets import (
    ALLOW_PRIVATE_ENV,
    REFUSED_INTERNAL,
    is_internal,
    resolve_target,
)
from tests.webhooks.receiver import Receiver


@pytest.fixture(autouse=True)
def allow_private_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default here: internal targets not allowed (tests/webhooks/conftest.py allows
    them for the other webhook tests)."""
    monkeypatch.delenv(ALLOW_PRIVATE_ENV, raising=False)


INTERNAL_URLS = [
    "http://127.0.0.1/hooks",
    "http://2130706433/hooks",  # decimal
    "http://0177.0.0.1/hooks",  # octal
    "http://0x7f.0.0.1/hooks",  # hex
    "http://0x7f000001/hooks",
    "http://127.1/hooks",
    "http://localhost/hooks",
    "http://localhost./hooks",
    "http://LOCALHOST:8080/hooks",
    "http://hooks.localhost/hooks",
    "http://127.0.0.1./hooks",
    "http://[::1]/hooks",
    "http://[::ffff:127.0.0.1]/hooks",  # IPv4-mapped IPv6
    "http://[::ffff:7f00:1]/hooks",
    "http://[64:ff9b::7f00:1]/hooks",  # NAT64 of 127.0.0.1
    "http://[2002:7f00:1::]/hooks",  # 6to4 of 127.0.0.1
    "http://0.0.0.0/hooks",
    "http://0/hooks",
    "http://[::]/hooks",
    "http://169.254.169.254/latest/meta-data/",  # the cloud metadata service
    "http://[fe80::1]/hooks",
    "http://10.0.0.1/hooks",
    "http://172.16.5.4/hooks",
    "http://192.168.1.1/hooks",
    "http://100.64.0.1/hooks",  # CGNAT
    "http://[fc00::1]/hooks",  # ULA
    "http://[fd12:3456::1]/hooks",
    "http://224.0.0.1/hooks",  # multicast
    "http://[ff02::1]/hooks",
    "http://240.0.0.1/hooks",  # reserved
    "http://255.255.255.255/hooks",
    "https://127.0.0.1:8443/hooks",
]

_INTERNAL_V4 = [
    ipaddress.ip_network(net)
    for net in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "224.0.0.0/4",
        "240.0.0.0/4",
    )
]


def _spellings(address: ipaddress.IPv4Address) -> list[str]:
    """Ways the system resolver reads as `address`, and the IPv6 forms that carry it."""
    a, b, c, d = address.packed
    number = int(address)
    return [
        str(address),
        str(number),
        hex(number),
        f"0{a:o}.0{b:o}.0{c:o}.0{d:o}",
        f"{hex(a)}.{hex(b)}.{hex(c)}.{hex(d)}",
        f"{a}.{(b << 16) | (c << 8) | d}",
        f"[::ffff:{address}]",
        f"[64:ff9b::{address}]",
    ]


@given(
    network=st.sampled_from(_INTERNAL_V4),
    offset=st.integers(min_value=0, max_value=2**32 - 1),
    spelling=st.integers(min_value=0, max_value=7),
)
@settings(max_examples=200, deadline=None)
def test_every_spelling_of_every_internal_ipv4_address_is_refused(
    network: ipaddress.IPv4Network, offset: int, spelling: int
) -> None:
    address = network[offset % network.num_addresses]
    assert isinstance(address, ipaddress.IPv4Address)
    host = _spellings(address)[spelling]
    with pytest.raises(WebhookTargetRefused, match="refused: internal address"):
        asyncio.run(resolve_target(f"http://{host}:8080/x", allow_private=False))
    allowed = asyncio.run(resolve_target(f"http://{host}:8080/x", allow_private=True))
    assert allowed is not None
    assert ipaddress.ip_address(allowed.address) in (
        address,
        ipaddress.IPv6Address(f"::ffff:{address}"),
        ipaddress.IPv6Address(f"64:ff9b::{address}"),
    )


@given(st.integers(min_value=0, max_value=2**32 - 1))
@settings(max_examples=300, deadline=None)
def test_an_ipv6_address_carrying_an_internal_ipv4_one_is_internal(number: int) -> None:
    address = ipaddress.IPv4Address(number)
    carried = [
        f"::ffff:{address}",
        f"64:ff9b::{address}",
        f"2002:{number >> 16:x}:{number & 0xFFFF:x}::",
    ]
    if is_internal(address):
        assert all(is_internal(ipaddress.IPv6Address(form)) for form in carried)


@pytest.mark.parametrize("public", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111"])
def test_a_global_address_is_not_internal(public: str) -> None:
    assert not is_internal(ipaddress.ip_address(public))


def _hooks() -> tuple[MemoryStore, WebhookStore]:
    store = MemoryStore()
    hooks = store.webhooks()
    assert hooks is not None
    return store, hooks


@pytest.mark.parametrize("url", INTERNAL_URLS)
async def test_add_refuses_an_internal_target_and_adds_nothing(url: str) -> None:
    _, hooks = _hooks()
    with pytest.raises(WebhookTargetRefused, match="refused: internal address"):
        await add_endpoint(hooks, url)
    assert await hooks.endpoints() == []


@pytest.mark.parametrize("url", INTERNAL_URLS)
async def test_add_takes_an_internal_target_when_the_operator_allows_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, hooks = _hooks()
    assert (await add_endpoint(hooks, url, allow_private=True)).url == url
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    await add_endpoint(hooks, url)
    assert len(await hooks.endpoints()) == 2


async def test_add_takes_a_name_that_does_not_resolve_now() -> None:
    # Checked again at each delivery; `.invalid` never resolves (RFC 2606).
    _, hooks = _hooks()
    await add_endpoint(hooks, "https://hooks.example.invalid/x")
    assert len(await hooks.endpoints()) == 1


@pytest.mark.sqlite
def test_cli_add_of_an_internal_target_exits_1_and_adds_nothing(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}"
    runner = CliRunner()
    for url in ("http://2130706433/hooks", "http://169.254.169.254/", "http://localhost./x"):
        result = runner.invoke(main, ["--store", store, "webhooks", "add", url])
        assert result.exit_code == 1, result.output
        assert "refused: internal address" in result.output
        assert "whsec_" not in result.output
    listed = runner.invoke(main, ["--store", store, "webhooks", "list", "--json"])
    assert json.loads(listed.output) == []
    allowed = runner.invoke(
        main,
        ["--store", store, "webhooks", "add", "http://127.1:9/x"],
        env={ALLOW_PRIVATE_ENV: "1"},
    )
    assert allowed.exit_code == 0, allowed.output


def _receiver_spellings(port: int) -> list[str]:
    return [
        f"http://127.0.0.1:{port}/a",
        f"http://127.1:{port}/b",
        f"http://2130706433:{port}/c",
        f"http://0177.0.0.1:{port}/d",
        f"http://0x7f.0.0.1:{port}/e",
        f"http://localhost:{port}/f",
        f"http://[::ffff:127.0.0.1]:{port}/g",
    ]


async def test_a_delivery_to_an_internal_target_is_refused_unless_allowed(
    receiver: Receiver,
) -> None:
    store, hooks = _hooks()
    urls = _receiver_spellings(receiver.port)
    # Added by an operator who allowed it (or whose name resolved elsewhere then): the
    # delivering process, which does not allow it, refuses each at send time.
    for url in urls:
        await add_endpoint(hooks, url, allow_private=True)
    async with KeyManager(store, webhooks=False) as manager:
        await manager.create(name="k", full_access=True)
    refusing = Deliverer(hooks, DeliveryOptions(retry_delays=(0.0,), timeout=5))
    try:
        assert await refusing.run_once() == len(urls)
    finally:
        await refusing.aclose()
    assert receiver.received == []
    deliveries = await hooks.deliveries()
    assert len(deliveries) == len(urls)
    for delivery in deliveries:
        assert (delivery.status, delivery.last_error) == ("pending", REFUSED_INTERNAL)
        assert delivery.last_status is None

    allowing = Deliverer(
        hooks, DeliveryOptions(retry_delays=(0.0,), timeout=5, allow_private_targets=True)
    )
    try:
        assert await allowing.run_once() == len(urls)
    finally:
        await allowing.aclose()
    assert sorted(item.headers["host"] for item in receiver.received) == sorted(
        url.split("/")[2] for url in urls
    )
    assert {d.status for d in await hooks.deliveries()} == {"delivered"}


async def test_a_delivery_connects_to_the_address_checked_with_the_name_as_host(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name is resolved once per attempt, by the check; the request goes to that
    address (a second resolution, which DNS rebinding would answer otherwise, is never
    made: this name resolves nowhere else)."""
    real = socket.getaddrinfo
    asked: list[str] = []

    def resolver(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "hooks.rebind.test":
            asked.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", receiver.port))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    store, hooks = _hooks()
    url = f"http://hooks.rebind.test:{receiver.port}/hooks"
    with pytest.raises(WebhookTargetRefused):
        await add_endpoint(hooks, url)
    await add_endpoint(hooks, url, allow_private=True)
    async with KeyManager(store, webhooks=False) as manager:
        await manager.create(name="k", full_access=True)
    asked.clear()
    deliverer = Deliverer(hooks, DeliveryOptions(timeout=5, allow_private_targets=True))
    try:
        assert await deliverer.run_once() == 1
    finally:
        await deliverer.aclose()
    assert asked == ["hooks.rebind.test"]
    (item,) = receiver.received
    assert item.headers["host"] == f"hooks.rebind.test:{receiver.port}"


def test_the_environment_allows_internal_targets_for_delivery_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert DeliveryOptions().allow_private_targets is False
    monkeypatch.setenv(ALLOW_PRIVATE_ENV, "1")
    assert DeliveryOptions().allow_private_targets is True
    assert DeliveryOptions(allow_private_targets=False).allow_private_targets is False
