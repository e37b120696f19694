"""A schedule's ticks: the times its cron expression names in its time zone, as epoch
seconds. The only module that reads cron expressions (croniter: the parser LangGraph's Agent
Server uses for its crons, with time zones and daylight-saving changes handled)."""

from __future__ import annotations

from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped]

__all__ = ["check_cron", "check_timezone", "next_tick", "tick_until"]


def check_cron(cron: object) -> str:
    """``cron`` if it is a cron expression: five fields (minute, hour, day of month, month,
    day of week), or six with seconds last (``"* * * * * */10"``: every 10 seconds).

    Raises:
        ValueError: anything else, named with an example.
    """
    if not isinstance(cron, str) or len(cron.split()) not in (5, 6) or not _valid(cron):
        raise ValueError(
            f"cron must be a cron expression of 5 fields (minute hour day month weekday, e.g. "
            f"'0 9 * * MON-FRI': 9:00 on weekdays) or 6 with seconds last (e.g. "
            f"'* * * * * */10': every 10 seconds), got {cron!r}"
        )
    return cron


def _valid(cron: str) -> bool:
    try:
        return bool(croniter.is_valid(cron))
    except Exception:
        return False


def check_timezone(timezone: object) -> ZoneInfo:
    """The IANA time zone ``timezone`` names (``"Europe/Paris"``, ``"UTC"``).

    Raises:
        ValueError: not a name the system's time zone database knows.
    """
    try:
        if not isinstance(timezone, str) or not timezone:
            raise ZoneInfoNotFoundError(timezone)
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"timezone must be an IANA time zone name such as 'UTC' or 'Europe/Paris' (the "
            f"zone the cron's hours are in, daylight saving included), got {timezone!r}"
        ) from None


def next_tick(cron: str, timezone: str, after: float) -> float:
    """The first time after ``after`` (epoch seconds) that ``cron`` names in ``timezone``.

    A local time that repeats because the clocks went back (the fall-back hour) is one
    tick, at its first occurrence: a daily job at 02:30 runs once that day, as cron runs
    it (a job of every hour runs once in the repeated hour; one of every minute runs in
    both, their local times differing)."""
    zone = ZoneInfo(timezone)
    start = datetime.fromtimestamp(after, zone)
    ticks: Any = croniter(cron, start)
    found: Any = ticks.get_next(datetime)
    while _wall(found) == _wall(start):
        found = ticks.get_next(datetime)  # the same local time again, an hour later
    return float(found.timestamp())


def tick_until(cron: str, timezone: str, after: float, end_at: float | None) -> float | None:
    """:func:`next_tick`, or ``None`` when it falls after ``end_at`` (the schedule ended)."""
    tick = next_tick(cron, timezone, after)
    return None if end_at is not None and tick > end_at else tick


def _wall(at: datetime) -> datetime:
    """``at``'s local wall-clock time, without its offset."""
    return at.replace(tzinfo=None)
