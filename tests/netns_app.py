"""The example contacts service as `test_hosts.py` serves it in each host, configured by
environment: the service's own variables (`APIKEYS_STORE_URL`, `APIKEYS_LIMITER_URL`,
`EXAMPLE_DATABASE_URL`, `APIKEYS_PEPPER`, ...) plus `APIKEYS_TEST_STORE_OPTIONS` (JSON
keyword arguments of the store: the test's own table or key prefix).

Every response carries `x-worker-pid`, the process that answered, so a test can tell the
workers of one `uvicorn --workers` apart.
"""

from __future__ import annotations

import json
import os

from examples.contacts_service.app import create_app
from examples.contacts_service.settings import Settings
from starlette.types import Message, Receive, Scope, Send

from apikeys import KeyManager, store_from_url

__all__ = ["app"]

_settings = Settings.from_env()
_options = json.loads(os.environ.get("APIKEYS_TEST_STORE_OPTIONS") or "{}")
_service = create_app(_settings, KeyManager(store_from_url(_settings.store_url, **_options)))


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        await _service(scope, receive, send)
        return
    pid = str(os.getpid()).encode()

    async def send_with_pid(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-worker-pid", pid)]}
        await send(message)

    await _service(scope, receive, send_with_pid)
