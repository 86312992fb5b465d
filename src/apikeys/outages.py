"""What the request path logs when the key store or the limiter fails (`503
auth_unavailable`): a warning on the `apikeys` logger naming the cause (the error's type
and apikeys' hint, never its text nor anything of the request), at most one line a second
for each cause, with how many requests it refused since the last line. An outage at
thousands of requests a second is then a line a second, not thousands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from apikeys.bounded import remember
from apikeys.errors import AuthUnavailable

__all__ = ["OutageLog"]

logger = logging.getLogger("apikeys")

_EVERY: Final = 1.0
_CAUSES: Final = 64


class OutageLog:
    """The warnings of one request path (a `Gate`) about its 503s."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # cause -> (when it was last logged, refusals since)
        self._causes: dict[str, tuple[float, int]] = {}

    def refused(self, exc: AuthUnavailable) -> None:
        """Count a request refused for `exc`; log it unless its cause was logged within
        the last second."""
        cause = str(exc)
        now = self._clock()
        last, since = self._causes.get(cause, (float("-inf"), 0))
        if now - last < _EVERY:
            self._causes[cause] = (last, since + 1)
            return
        remember(self._causes, cause, (now, 0), _CAUSES)
        more = f" ({since} more since the last line)" if since else ""
        logger.warning("apikeys: answering 503: %s%s", cause, more)
