"""New keys waiting for their one display, in this process's memory only.

After a key is created (or rolled) the browser is redirected to the list page
(Post/Redirect/Get), which must show the key once, and never on a reload. The key cannot
travel in the session cookie: it is signed, not encrypted, so the browser, its extensions
and anything that logs cookies could read it. It is kept here instead, under a random
nonce, for a few minutes at most; only the nonce goes into the session, and the first page
that shows the key removes it. Nothing is written to disk or to the database.

With several workers the redirected request may reach another process; the page then says
the key cannot be shown (roll it to get a new one). Run one worker for the UI, or use
sticky sessions.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime

from apikeys.types import KeyRecord

__all__ = ["Reveal", "RevealStore"]


@dataclass(frozen=True, slots=True)
class Reveal:
    """A key to show once, to the user who made it."""

    key: str = field(repr=False)
    record: KeyRecord
    user_id: str
    rolled_from: KeyRecord | None = None
    """For a roll: the old key, with its new (grace period) expiry."""
    old_expires_at: datetime | None = None


class RevealStore:
    """`put` a `Reveal`, get a nonce; `pop` it back once, within `ttl` seconds."""

    def __init__(self, ttl: float = 300.0, capacity: int = 1000) -> None:
        self.ttl = ttl
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[float, Reveal]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def _purge(self, now: float) -> None:
        while self._items:
            nonce, (deadline, _) = next(iter(self._items.items()))
            if deadline > now and len(self._items) <= self.capacity:
                break
            del self._items[nonce]

    def put(self, reveal: Reveal) -> str:
        now = time.monotonic()
        nonce = secrets.token_urlsafe(24)
        self._items[nonce] = (now + self.ttl, reveal)
        self._purge(now)
        return nonce

    def pop(self, nonce: object, user_id: str) -> Reveal | None:
        """The reveal for `nonce` if it is `user_id`'s and still fresh; it is gone after."""
        self._purge(time.monotonic())
        if not isinstance(nonce, str):
            return None
        item = self._items.get(nonce)
        if item is None or item[1].user_id != user_id:
            return None
        del self._items[nonce]
        return item[1]
