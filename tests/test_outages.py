"""The request path's 503s are logged a line a second per cause, with the count of those
refused in between (`apikeys.outages`)."""

from __future__ import annotations

import pytest

from apikeys.errors import LimiterUnavailable, StoreUnavailable
from apikeys.outages import OutageLog


def test_a_cause_is_logged_once_a_second_with_the_refusals_in_between(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = OutageLog(clock=lambda: now[0])
    store_down = StoreUnavailable(ConnectionRefusedError("10.0.0.1 password=hunter2"))
    with caplog.at_level("WARNING", logger="apikeys"):
        for _ in range(4):
            log.refused(store_down)
        log.refused(LimiterUnavailable(TimeoutError()))  # another cause: its own line
        now[0] += 1.0
        log.refused(store_down)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 3
    assert "ConnectionRefusedError" in lines[0]
    assert "TimeoutError" in lines[1]
    assert lines[2].endswith("(3 more since the last line)")
    assert "hunter2" not in caplog.text  # the error's type, never its text
