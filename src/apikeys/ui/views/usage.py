"""One key's usage: its requests per day over the last 30 days, as a table and a chart."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from apikeys.types import DailyUsage
from apikeys.ui.request import PageUser, own_key, page_of, render, view

__all__ = ["USAGE_DAYS", "Bar", "chart", "usage_page"]

USAGE_DAYS = 30
CHART_WIDTH, CHART_HEIGHT, CHART_TOP = 720, 200, 16


@dataclass(frozen=True, slots=True)
class Bar:
    """One day of the usage chart: where its two stacked rectangles go."""

    usage: DailyUsage
    x: float
    width: float
    admitted_y: float
    admitted_height: float
    refused_y: float
    refused_height: float

    @property
    def label(self) -> str:
        refused = ", ".join(f"{count} {code}" for code, count in self.usage.refused.items())
        text = f"{self.usage.day.isoformat()}: {self.usage.admitted} admitted"
        return text + (f"; refused: {refused}" if refused else "")


def chart(history: list[DailyUsage]) -> tuple[list[Bar], int]:
    """The bars of a stacked bar chart of `history` (admitted below, refused above), and
    the top of its scale (a round number at or above the busiest day)."""
    busiest = max((day.total for day in history), default=0)
    top = _round_up(busiest)
    slot = CHART_WIDTH / max(1, len(history))
    bars = []
    for index, day in enumerate(history):
        scale = (CHART_HEIGHT - CHART_TOP) / top
        admitted = day.admitted * scale
        refused = (day.total - day.admitted) * scale
        base = CHART_HEIGHT
        bars.append(
            Bar(
                usage=day,
                x=round(index * slot + slot * 0.15, 2),
                width=round(slot * 0.7, 2),
                admitted_y=round(base - admitted, 2),
                admitted_height=round(admitted, 2),
                refused_y=round(base - admitted - refused, 2),
                refused_height=round(refused, 2),
            )
        )
    return bars, top


def _round_up(value: int) -> int:
    """1, 2, 5, 10, 20, 50, … : the smallest at or above `value` (at least 1)."""
    step = 1
    while True:
        for factor in (1, 2, 5):
            if step * factor >= value:
                return step * factor
        step *= 10


@view
async def usage_page(request: Request, user: PageUser) -> Response:
    record = await own_key(request, user)
    history = await page_of(request).manager.usage(record.id, days=USAGE_DAYS)
    bars, top = chart(history)
    codes = sorted({code for day in history for code in day.refused})
    return render(
        request,
        "usage.html",
        title="Usage",
        record=record,
        history=history,
        bars=bars,
        top=top,
        codes=codes,
        days=USAGE_DAYS,
        width=CHART_WIDTH,
        height=CHART_HEIGHT,
        chart_top=CHART_TOP,
        admitted=sum(day.admitted for day in history),
        refused=sum(day.total - day.admitted for day in history),
    )
