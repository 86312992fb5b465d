"""Hosts of their own on this machine: Linux network namespaces that share PostgreSQL and Redis.

```python
with Hosts(["a", "b"], services=[postgres_url, redis_url]) as (a, b):
    a.url(postgres_url)        # the store URL a process in host a connects to
    a.popen(["python", ...])   # a process inside host a (`ip netns exec`)
    b.partition_notifications("black_hole")  # or "cut": the caches' notification links
    b.partition_store("cut")   # or "black_hole": every connection to every service
    b.drop_postgres_notices()  # NOTIFY messages lost, listening connections otherwise fine
    b.heal()
```

Each host is a namespace `ak-<pid>-<tag>-<name>` linked to the root namespace by a veth pair, with
the two addresses of a /30 of its own (the root side `.1`, the host `.2`). PostgreSQL and
Redis listen on 127.0.0.1 of the root namespace only, so for every service each host gets a
`TcpProxy` bound to its root-side address that forwards to it: that forwarder is the host's
whole path to the service, and partitions are faults of the forwarder. The test process (in
the root namespace) reaches a host's servers at `host.address`. Nothing is sent to any other
address.

Everything is undone on exit, whatever happened: the processes started in a host (every
process still in its namespace is killed), the forwarders, the namespaces and their links.
Empty namespaces of a test process that was killed outright (its pid is in their names) are
deleted by the next run.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal
from urllib.parse import urlsplit

import pytest

from tests.services import REQUIRE_SERVICES
from tests.tcpproxy import TcpProxy, rewrite_url

__all__ = ["Host", "Hosts", "Mode", "netns_unavailable", "require_netns", "wait_until"]

Mode = Literal["black_hole", "cut"]

# Where the hosts' /30s are drawn from; one that overlaps an address or route of the root
# namespace is never used.
_POOL = ipaddress.ip_network("10.231.0.0/16")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def netns_unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    try:
        _ip("netns", "list")
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def require_netns(reason: str | None = None) -> None:
    """Skip (or fail, when services are required) unless namespaces can be made."""
    reason = reason or netns_unavailable()
    if reason is None:
        return
    message = f"{reason}; the two-host tests run as root with iproute2 (as bash .ci/run does)"
    if REQUIRE_SERVICES:
        pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
    pytest.skip(message)


def _taken_networks() -> list[ipaddress.IPv4Network]:
    taken: list[ipaddress.IPv4Network] = []
    addresses = json.loads(_ip("-j", "-4", "addr", "show").stdout or "[]")
    for link in addresses:
        for info in link.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{info['local']}/{info['prefixlen']}", False))
    for route in json.loads(_ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        destination = route.get("dst", "")
        if destination and destination != "default":
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(destination, strict=False))
    return taken


def _sweep() -> None:
    """Delete the empty namespaces left by a test process that was killed before it could."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) != 4 or parts[0] != "ak" or not parts[1].isdigit():
            continue
        if Path(f"/proc/{parts[1]}").exists() or _ip("netns", "pids", name, check=False).stdout:
            continue  # its test still runs, or something runs in it: not ours to undo
        _ip("netns", "delete", name, check=False)


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    taken = _taken_networks()
    candidates = list(_POOL.subnets(new_prefix=30))
    random.shuffle(candidates)
    chosen = [net for net in candidates if not any(net.overlaps(t) for t in taken)][:count]
    if len(chosen) < count:
        raise RuntimeError(f"no free /30 left in {_POOL}")
    return chosen


class Host:
    """One namespace: its link, its forwarders to the services, and its processes."""

    def __init__(self, name: str, netns: str, outside: str, subnet: ipaddress.IPv4Network):
        first, second = list(subnet.hosts())
        self.name = name
        self.netns = netns
        self.outside = outside  # the root side of the veth pair (the inside is `eth0`)
        self.gateway = str(first)  # root side: where the forwarders listen
        self.address = str(second)  # the host's own address, where its servers listen
        self.prefix = subnet.prefixlen
        self.proxies: dict[str, TcpProxy] = {}
        self.processes: list[subprocess.Popen[Any]] = []

    def __repr__(self) -> str:
        return f"Host({self.name!r}, netns={self.netns!r}, address={self.address!r})"

    # -- making and unmaking ---------------------------------------------------------------

    def create(self) -> None:
        inside = self.outside[:-1] + "i"
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", self.netns)
        _ip("addr", "add", f"{self.gateway}/{self.prefix}", "dev", self.outside)
        _ip("link", "set", self.outside, "up")
        inner = ("-n", self.netns)
        _ip(*inner, "link", "set", inside, "name", "eth0")
        _ip(*inner, "addr", "add", f"{self.address}/{self.prefix}", "dev", "eth0")
        _ip(*inner, "link", "set", "eth0", "up")
        _ip(*inner, "link", "set", "lo", "up")

    def forward(self, service_url: str) -> TcpProxy:
        """Start this host's forwarder to the service of `service_url` (one per service)."""
        proxy = TcpProxy.to_url(service_url, host=self.gateway).start()
        self.proxies[_service(service_url)] = proxy
        return proxy

    def destroy(self) -> None:
        """Kill the host's processes, stop its forwarders, delete its namespace and link."""
        try:
            self.kill_processes()
        finally:
            for proxy in self.proxies.values():
                with contextlib.suppress(Exception):
                    proxy.close()
            self.proxies.clear()
            _ip("netns", "delete", self.netns, check=False)
            _ip("link", "delete", self.outside, check=False)  # gone with the namespace anyway

    def pids(self) -> list[int]:
        """Every process running in the host's namespace (all of them started by a test)."""
        listed = _ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def kill_processes(self) -> None:
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
            for stream in (process.stdin, process.stdout, process.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.processes.clear()

    # -- using -----------------------------------------------------------------------------

    def url(self, service_url: str) -> str:
        """`service_url` as seen from inside this host: through its forwarder.

        PostgreSQL URLs get `ssl=disable` unless they say otherwise: the forwarder tells
        connections apart by what they send, which it cannot read inside TLS.
        """
        proxy = self.proxies[_service(service_url)]
        url = rewrite_url(service_url, proxy.host, proxy.port)
        query = urlsplit(url).query
        if _service(url) == "postgresql" and "ssl" not in query:
            url += ("&" if query else "?") + "ssl=disable"
        return url

    def command(self, args: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args]

    def popen(
        self,
        args: Sequence[str],
        *,
        env: dict[str, str],
        cwd: Path,
        stdout: IO[Any] | int | None,
        stdin: int | None = subprocess.DEVNULL,
        text: bool = False,
    ) -> subprocess.Popen[Any]:
        """Start `args` inside the host, in a process group of its own."""
        process = subprocess.Popen(
            self.command(args),
            env=env,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout not in (None, subprocess.PIPE) else None,
            text=text,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    def run(
        self, args: Sequence[str], *, env: dict[str, str], cwd: Path, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run `args` inside the host to its end."""
        return subprocess.run(
            self.command(args),
            env=env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )

    # -- partitions ------------------------------------------------------------------------

    def partition_notifications(self, mode: Mode) -> None:
        """Cut the host off from the caches' notification connections only (`LISTEN`,
        `SUBSCRIBE`): their bytes held unanswered (`black_hole`) or reset (`cut`)."""
        for proxy in self.proxies.values():
            if mode == "black_hole":
                proxy.black_hole_notifications()
            else:
                proxy.cut_notifications()

    def partition_store(self, mode: Mode) -> None:
        """Cut the host off from every service: every connection's bytes held unanswered,
        new ones too (`black_hole`), or every connection reset and new ones refused (`cut`)."""
        for proxy in self.proxies.values():
            if mode == "black_hole":
                proxy.pause()
            else:
                proxy.sever()

    def drop_postgres_notices(self, channel: str | None = None) -> None:
        """Lose the PostgreSQL notifications on `channel` (every one if None) on the way to
        this host; the listening connections stay up and everything else on them flows."""
        self.proxies["postgresql"].drop_notices(channel)

    def heal(self) -> None:
        for proxy in self.proxies.values():
            proxy.restore()

    def notification_connections(self) -> int:
        """Notification connections of this host open now (held ones too)."""
        return sum(proxy.active_notification_connections for proxy in self.proxies.values())


def _service(url: str) -> str:
    scheme = url.split("://", 1)[0].split("+")[0]
    return "postgresql" if scheme == "postgres" else scheme


class Hosts:
    """Makes hosts named `names`, each forwarding to every URL of `services`; undoes it all."""

    def __init__(self, names: Iterable[str], services: Sequence[str]) -> None:
        self.names = list(names)
        if any(len(name) > 7 or not name.isalnum() for name in self.names):
            raise ValueError("host names are 1 to 7 letters or digits (link names are short)")
        self.services = list(services)
        self.tag = secrets.token_hex(3)
        self.hosts: list[Host] = []

    def __enter__(self) -> list[Host]:
        reason = netns_unavailable()
        if reason is not None:
            require_netns(reason)
        _sweep()
        try:
            subnets = _free_subnets(len(self.names))
            for name, subnet in zip(self.names, subnets, strict=True):
                netns = f"ak-{os.getpid()}-{self.tag}-{name}"
                host = Host(name, netns, f"ak{self.tag}{name}o", subnet)
                self.hosts.append(host)
                try:
                    host.create()
                except subprocess.CalledProcessError as exc:
                    require_netns(f"could not make a network namespace: {exc.stderr.strip()}")
                for url in self.services:
                    host.forward(url)
        except BaseException:
            self.close()
            raise
        return list(self.hosts)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        errors: list[BaseException] = []
        for host in reversed(self.hosts):
            try:
                host.destroy()
            except Exception as exc:  # every host is torn down, whatever one of them says
                errors.append(exc)
        self.hosts.clear()
        if errors:
            raise errors[0]


def wait_until(predicate: Any, within: float, step: float = 0.05) -> bool:
    """Poll `predicate()` until it is true or `within` seconds passed."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return bool(predicate())
