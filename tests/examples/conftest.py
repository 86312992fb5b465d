"""What the example tests share: the contacts service, started as a user starts it.

`python -m uvicorn examples.contacts_service.app:app --no-proxy-headers` (its documented
command line) runs in a subprocess from the repository root, with an environment of the
test's own (no `APIKEYS_*` or `EXAMPLE_*` variable of the caller leaks in).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
PEPPER = "qbRhbA6IiMiaArqjfWDbsCTo3JRbjUrJdaAXX1c0ERE"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_service(
    env: dict[str, str], log: Path, *options: str
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the service with `env`, its output in `log`; return it and its base URL.

    `options` go to uvicorn after the documented ones (say, the proxy a test stands for).
    """
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "examples.contacts_service.app:app",
        # As documented: no proxy is trusted, unless the test names one in `options`.
        *([] if "--forwarded-allow-ips" in options else ["--no-proxy-headers"]),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *options,
    ]
    with log.open("wb") as output:
        process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the service exited with {process.returncode}:\n{log.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base_url}/api/v1/openapi.json", timeout=1).status_code == 200:
                return process, base_url
        time.sleep(0.1)
    process.kill()
    pytest.fail(f"the service did not start within 30 seconds:\n{log.read_text()}")


def stop_service(process: subprocess.Popen[bytes], log: Path) -> None:
    """Stop it as a process manager would (SIGTERM) and check it shut down cleanly."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    output = log.read_text()
    # Every refusal is an answer, never a crash: no traceback may reach the server's log.
    assert "Traceback" not in output, output
    assert "Application shutdown complete" in output, output


def service_env(**overrides: str) -> dict[str, str]:
    """This environment without `APIKEYS_*` and `EXAMPLE_*`, the test settings, `overrides`."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("APIKEYS_", "EXAMPLE_"))
    }
    env.update(
        APIKEYS_PEPPER=PEPPER,
        APIKEYS_LIMITER_URL="memory://",
        # High enough for the schemathesis run; tests of 429 give their key its own limit.
        APIKEYS_RATE_LIMIT="100000/minute",
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env
