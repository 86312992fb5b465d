"""A process that only delivers webhooks: `python -m tests.webhooks.deliverer STORE_URL`.

It holds a `KeyManager` on the store with short retry delays, prints `ready`, and runs
until it is terminated.
"""

from __future__ import annotations

import asyncio
import sys

from apikeys import KeyManager
from apikeys.webhooks import DeliveryOptions

# The receivers of the tests listen on 127.0.0.1: internal targets are allowed explicitly.
OPTIONS = DeliveryOptions(
    poll_interval=0.05,
    retry_delays=(0.2, 0.4, 0.8),
    timeout=2,
    lease=10,
    allow_private_targets=True,
)


async def main(url: str) -> None:
    async with KeyManager(url, webhooks=OPTIONS):
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
