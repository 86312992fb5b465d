"""Closing an asyncio server a test started without leaking a connection it was accepting.

```python
server = await asyncio.start_server(handler, "127.0.0.1", 0)
...
await close_server(server)
```

On Python 3.11 `Server.close()` can land between the loop accepting a connection and the
task that makes its transport: that task then fails `Server._attach`'s assertion with the
socket already in the half-made transport, which nothing closes (CPython issues 109564 and
155934). The socket is left to the garbage collector, and its `ResourceWarning` fails
whichever test is running when a collection finds it. `close_server` stops reading the
listening sockets first, lets each connection already accepted become a transport (the
server's handler then sees it and may close it), and only then closes the server.
"""

from __future__ import annotations

import asyncio

__all__ = ["close_server"]


async def close_server(server: asyncio.Server) -> None:
    """Stop `server` accepting, let what it accepted become transports, close it."""
    loop = asyncio.get_running_loop()
    for sock in server.sockets:
        loop.remove_reader(sock.fileno())
    # A connection accepted before the line above is a task whose first step (making the
    # transport) is already queued: one turn of the loop runs it.
    await asyncio.sleep(0)
    server.close()
    await server.wait_closed()
