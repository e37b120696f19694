"""When a submitted run may start: ``submit(..., not_before=...)``, checked before anything
is written, and made one time on the database's clock inside the submit's transaction."""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from typing import TypeAlias

from sqlalchemy.ext.asyncio import AsyncConnection

from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.validate import MAX_SECONDS

__all__ = ["Checked", "NotBefore", "check_not_before", "not_before_at"]

#: A delay (seconds, or a ``timedelta``) from the submit, or a time (an aware ``datetime``).
NotBefore: TypeAlias = datetime | timedelta | float | int

# (absolute time in epoch seconds, or None; delay in seconds, or None)
Checked: TypeAlias = tuple[float | None, float | None]


def check_not_before(value: object) -> Checked | None:
    """``not_before`` as ``(time, delay)``, one of them set; ``None`` for ``None``.

    Raises:
        ValueError: a naive ``datetime``, a negative, infinite or NaN delay, or a delay
            over :data:`~langgraph_fence.validate.MAX_SECONDS`; named with the fix.
        TypeError: any other type.
    """
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(
                f"not_before is a naive datetime ({value!r}): it is judged on the database's "
                "clock, so give it a time zone, e.g. datetime.now(timezone.utc) + "
                "timedelta(minutes=5), or pass a delay in seconds"
            )
        return value.timestamp(), None
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            "not_before must be an aware datetime (when the run may start), a timedelta or "
            f"a number of seconds (a delay from the submit), got {value!r}"
        )
    delay = float(value)
    if not math.isfinite(delay) or delay < 0 or delay > MAX_SECONDS:
        raise ValueError(
            f"not_before must be a delay of 0 to {MAX_SECONDS:.0e} seconds, got {value!r}"
        )
    return None, delay


async def not_before_at(
    conn: AsyncConnection, checked: Checked | None, db: QueueDatabase
) -> float | None:
    """The time (store clock, epoch seconds) the run may start: the given time, or the
    delay added to the database's clock as ``conn``'s transaction reads it; ``None`` when
    ``checked`` is."""
    if checked is None:
        return None
    at, delay = checked
    if at is not None:
        return at
    return await db.store_now(conn) + (delay or 0.0)
