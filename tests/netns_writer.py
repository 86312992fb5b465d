"""A writer that `test_hosts.py` runs inside host a: JSON lines in, JSON lines out.

`{"op": "create"}` makes a key (workspace `acme`, scope `contacts:read`) and answers its id
and secret; `{"op": "revoke", "id": ...}` revokes it and answers when `revoke` started and
returned, on `time.monotonic()` (the machine's clock, the same in every namespace).
`KeyManager.revoke` returns once every reader acknowledged, or a lease passed. The
store is `APIKEYS_STORE_URL` with the options `APIKEYS_TEST_STORE_OPTIONS`; the manager has a
cache, as a service's would.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from apikeys import Hasher, KeyManager, store_from_url


async def serve() -> None:
    options = json.loads(os.environ.get("APIKEYS_TEST_STORE_OPTIONS") or "{}")
    store = store_from_url(os.environ["APIKEYS_STORE_URL"], **options)
    loop = asyncio.get_running_loop()
    async with KeyManager(store, hasher=Hasher(pepper=os.environ["APIKEYS_PEPPER"])) as manager:
        await store.setup()
        print(json.dumps({"ready": True}), flush=True)
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            request = json.loads(line)
            answer: dict[str, Any]
            try:
                if request["op"] == "create":
                    created = await manager.create(
                        name=request.get("name", "netns"),
                        workspace="acme",
                        scopes=["contacts:read"],
                        rate_limit="100000/minute",
                    )
                    answer = {"id": created.record.id, "key": created.key}
                elif request["op"] == "revoke":
                    started = time.monotonic()
                    await manager.revoke(request["id"])
                    returned = time.monotonic()
                    answer = {"started": started, "returned": returned}
                else:
                    answer = {"error": f"unknown op {request['op']!r}"}
            except Exception as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    asyncio.run(serve())
