"""A private PgBouncer for the tests: Debian's `pgbouncer`, started on a free loopback port
in front of a PostgreSQL server, with its configuration and auth file in a temporary folder.

PgBouncer refuses to run as root: as root the process runs as the `postgres` user, which
owns the folder. Off CI a missing `pgbouncer` skips the tests that need it; with
`APIKEYS_REQUIRE_SERVICES=1` (as `.ci/run` sets, after installing it) they fail instead.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import pytest

from tests import services

# Debian installs it in /usr/sbin, which is not on every user's PATH.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def executable() -> str | None:
    """The `pgbouncer` program, or None when it is not installed."""
    return shutil.which("pgbouncer", path=_SEARCH_PATH)


def require() -> str:
    """The `pgbouncer` program; skip (or fail, when services are required) without it."""
    program = executable()
    if program is not None:
        return program
    message = (
        "pgbouncer is not installed; install it (apt-get install pgbouncer; bash .ci/run "
        "does) to run the tests through PgBouncer"
    )
    if services.REQUIRE_SERVICES:
        pytest.fail(message + " [APIKEYS_REQUIRE_SERVICES=1]")
    pytest.skip(message)


def postgres_server() -> str:
    """`host:port` of the suite's PostgreSQL server (`APIKEYS_TEST_POSTGRES_URL`)."""
    parts = urlsplit(services.POSTGRES_URL)
    return f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"


def _credentials() -> tuple[str, str]:
    parts = urlsplit(services.POSTGRES_URL)
    return unquote(parts.username or "postgres"), unquote(parts.password or "")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PgBouncer:
    """One `pgbouncer` process; `url(database)` is a URL that goes through it.

    `server` is the PostgreSQL server's `host:port` it forwards to (the suite's, by default);
    clients log in as the suite's user, which PgBouncer trusts. `settings` are extra lines
    of its `[pgbouncer]` section (`default_pool_size`, `query_wait_timeout`, …).
    """

    def __init__(
        self,
        *,
        pool_mode: str = "transaction",
        server: str | None = None,
        settings: Mapping[str, str | int] | None = None,
    ) -> None:
        self.pool_mode = pool_mode
        self.server = server or postgres_server()
        self.user, self._password = _credentials()
        self.settings = dict(settings or {})
        self.port = 0
        self.folder: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, database: str = "postgres", **query: str | int) -> str:
        """A `postgresql://` URL to `database` through this PgBouncer."""
        text = f"postgresql://{quote(self.user, safe='')}@127.0.0.1:{self.port}/{database}"
        if query:
            text += "?" + "&".join(f"{name}={value}" for name, value in query.items())
        return text

    def via(self, url: str) -> str:
        """`url` (a PostgreSQL URL of the server behind it) with its host and port swapped
        for this PgBouncer's."""
        parts = urlsplit(url)
        netloc = f"{quote(self.user, safe='')}@127.0.0.1:{self.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

    def log(self) -> str:
        if self.folder is None:
            return ""
        path = self.folder / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        program = require()
        host, _, port = self.server.rpartition(":")
        folder = Path(tempfile.mkdtemp(prefix="apikeys-pgbouncer-"))
        self.folder = folder
        as_root = os.geteuid() == 0
        owner = pwd.getpwnam("postgres") if as_root else None
        # PgBouncer trusts its clients, and logs in to the server with this password.
        user, password = (value.replace('"', '""') for value in (self.user, self._password))
        (folder / "userlist.txt").write_text(f'"{user}" "{password}"\n')
        for attempt in range(5):
            self.port = free_port()
            lines = [
                "[databases]",
                f"* = host={host} port={port}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = trust",
                f"auth_file = {folder / 'userlist.txt'}",
                f"pool_mode = {self.pool_mode}",
                f"logfile = {folder / 'pgbouncer.log'}",
                f"pidfile = {folder / 'pgbouncer.pid'}",
                "ignore_startup_parameters = extra_float_digits",
                "server_login_retry = 1",
                *(f"{name} = {value}" for name, value in self.settings.items()),
            ]
            config = folder / "pgbouncer.ini"
            config.write_text("\n".join(lines) + "\n")
            if owner is not None:
                for path in (folder, *folder.iterdir()):
                    os.chown(path, owner.pw_uid, owner.pw_gid)
            process = subprocess.Popen(
                [program, "-q", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                user=owner.pw_uid if owner is not None else None,
                group=owner.pw_gid if owner is not None else None,
                extra_groups=[] if owner is not None else None,
            )
            self.process = process
            if self._wait_until_listening(process):
                return
            self._stop_process()
            if attempt == 4:
                raise RuntimeError(f"pgbouncer did not start:\n{self.log()}")

    def _wait_until_listening(self, process: subprocess.Popen[bytes]) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if process.poll() is not None:
                return False  # e.g. the port was taken in the meantime
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.5):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    def _stop_process(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # immediate shutdown
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

    def stop(self) -> None:
        try:
            self._stop_process()
        finally:
            folder, self.folder = self.folder, None
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
