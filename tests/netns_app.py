"""The example contacts service as `test_hosts.py` serves it in each host, configured by
environment: the service's own variables (`APIKEYS_STORE_URL`, `APIKEYS_LIMITER_URL`,
`EXAMPLE_DATABASE_URL`, `APIKEYS_PEPPER`, ...) plus `APIKEYS_TEST_STORE_OPTIONS` (JSON
keyword arguments of the store: the test's own table or key prefix).

Every response carries `x-worker-pid`, the process that answered, so a test can tell the
workers of one `uvicorn --workers` apart. `GET /_test/cache` answers whether the worker's
key cache is proven fresh (`{"fresh": true}`), so a test can wait for that instead of
sleeping.
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
_manager = KeyManager(store_from_url(_settings.store_url, **_options))
_service = create_app(_settings, _manager)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        await _service(scope, receive, send)
        return
    pid = str(os.getpid()).encode()
    if scope["path"] == "/_test/cache":
        cache = _manager.cache
        body = json.dumps({"fresh": cache is not None and cache.fresh}).encode()
        headers = [(b"content-type", b"application/json"), (b"x-worker-pid", pid)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        return

    async def send_with_pid(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-worker-pid", pid)]}
        await send(message)

    await _service(scope, receive, send_with_pid)
