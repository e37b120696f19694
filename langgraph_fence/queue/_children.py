"""Children as submitted runs: recorded together under their parent's hold, their ends read
back in one read, and the parent woken once none of them is in flight.

On PostgreSQL a batch of children and a look at their ends are one statement each, run on
the driver in one round trip (compiled once); on SQLite, one transaction of a fixed number
of statements, and one read.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from langgraph_fence.database import transaction
from langgraph_fence.database.driver import DriverStatement, fetch, give_back
from langgraph_fence.database.retry import retry_connection_errors
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.queue._database import QueueDatabase
from langgraph_fence.queue._state import RunState
from langgraph_fence.queue._statements import (
    CHILD_ENDS,
    PARENT_HELD,
    RECORD_INTO,
    RECORD_UPSERT,
    SQLITE_CHILDREN_PER_STATEMENT,
)
from langgraph_fence.queue.notifications import NOTIFY_CHANNEL

__all__ = ["ChildRuns", "Spawn"]

#: Children to record: each one's key, and its input as it is recorded (type, bytes).
Spawn = Sequence[tuple[LeaseKey, tuple[str, bytes]]]


class ChildRuns:
    """The children's side of the run queue on ``db``."""

    def __init__(self, db: QueueDatabase) -> None:
        self._db = db
        if db.pg:
            dialect = db.engine.dialect
            self._spawn = DriverStatement(db.leases.spawn_children, dialect)
            self._ends = DriverStatement(CHILD_ENDS["postgresql"], dialect)

    async def record(
        self, parent: Lease, common: Mapping[str, Any], children: Spawn
    ) -> set[str] | None:
        """Record ``children`` (of one tenant, distinct keys, at least one) pending, with
        the record columns ``common`` gives them all, only while ``parent`` is held; the
        execution ids recorded now (``None``: ``parent`` is no longer held, nothing
        written)."""
        held = {
            "ptenant": parent.key.tenant_id,
            "pexecution": parent.key.execution_id,
            "holder": parent.holder,
            "epoch": parent.epoch,
        }
        once = self._record_pg if self._db.pg else self._record_sqlite
        return await retry_connection_errors(
            lambda: once(held, common, children), what="spawn children"
        )

    async def _record_pg(
        self, held: Mapping[str, Any], common: Mapping[str, Any], children: Spawn
    ) -> set[str] | None:
        (row,) = await _on_driver(
            self._db.engine,
            self._spawn,
            {
                **held,
                **common,
                **self._db.now(),
                # As JSON (the inputs in hex): the same one parameter for any number,
                # and no array type for the driver to look up on a new connection.
                "children": json.dumps(
                    [
                        [key.execution_id, key.scope_key, input_type, blob.hex()]
                        for key, (input_type, blob) in children
                    ]
                ),
                "channel": NOTIFY_CHANNEL,
            },
        )
        if not row["held"]:
            return None
        return set(json.loads(row["created"] or "[]"))

    async def _record_sqlite(
        self, held: Mapping[str, Any], common: Mapping[str, Any], children: Spawn
    ) -> set[str] | None:
        async with transaction(self._db.engine) as conn:
            # BEGIN IMMEDIATE serialises every writer: a takeover of the parent waits
            # for this transaction, so children are recorded only under its token.
            if (await conn.execute(text(PARENT_HELD), held)).first() is None:
                return None
            rows = json.dumps([[key.execution_id, key.scope_key] for key, _ in children])
            created = {
                row.execution_id
                for row in await conn.execute(
                    self._db.leases.spawn_leases,
                    {
                        "tenant_id": common["tenant_id"],
                        "rows": rows,
                        "pexecution": held["pexecution"],
                        **self._db.now(),
                    },
                )
            }
            new = [(key, typed) for key, typed in children if key.execution_id in created]
            step = SQLITE_CHILDREN_PER_STATEMENT
            for start in range(0, len(new), step):
                await _record_children_sqlite(conn, common, new[start : start + step])
            return created

    async def ends(
        self, children: Collection[LeaseKey]
    ) -> dict[LeaseKey, tuple[RunState, tuple[Any, Any]] | None]:
        """Of ``children``, those that ended with their stored outputs, and those that are
        gone (``None``), in one read."""
        params = {"keys": json.dumps([[key.tenant_id, key.execution_id] for key in children])}

        async def once() -> Sequence[Any]:
            if self._db.pg:
                return await _on_driver(self._db.engine, self._ends, params)
            # One statement, in autocommit: a read takes no write lock.
            async with self._db.writer.connect() as conn:
                rows = await conn.execute(CHILD_ENDS["sqlite"], params)
                return [row._mapping for row in rows]

        found: dict[LeaseKey, tuple[RunState, tuple[Any, Any]] | None] = {}
        for row in await retry_connection_errors(once, what="children's ends"):
            key = LeaseKey(row["tenant_id"], row["execution_id"])
            if row["status"] is None:
                found[key] = None
                continue
            state = RunState(
                key,
                LeaseStatus(row["status"]),
                row["holder"],
                int(row["epoch"]),
                None,
                None,
                True,
                row["reason"],
            )
            found[key] = (state, (row["output_type"], row["output"]))
        return found

    async def wake(self, statement: Any, params: Mapping[str, Any], *, what: str) -> int:
        """Run a wake of yielded trees (the lease writes' ``wake`` or ``wake_all``) in one
        transaction, and tell the serving instances when it woke any (PostgreSQL NOTIFY, on
        commit); how many it woke."""

        async def once() -> int:
            async with transaction(self._db.engine) as conn:
                woken = len(list(await conn.execute(statement, {**params, **self._db.now()})))
                if woken:
                    await self._db.notify(conn, NOTIFY_CHANNEL, "")
                return woken

        return await retry_connection_errors(once, what=what)


async def _on_driver(
    engine: AsyncEngine, statement: DriverStatement, params: Mapping[str, Any]
) -> Sequence[Any]:
    """Run ``statement`` on an asyncpg connection of ``engine`` (autocommit: one statement
    is its own transaction) in one round trip; its rows. A connection the call was
    interrupted on is discarded (its state is unknown: :mod:`langgraph_fence.database.driver`)."""
    conn = await engine.connect()
    try:
        driver = (await conn.get_raw_connection()).driver_connection
        rows = await fetch(driver, statement, params)
    except BaseException as exc:
        await give_back(conn, exc)
        raise
    await conn.close()
    return rows


async def _record_children_sqlite(
    conn: AsyncConnection,
    common: Mapping[str, Any],
    children: Spawn,
) -> None:
    """The records of ``children`` on SQLite, in one statement: a row of three positional
    parameters each (id, input type, input), since SQLite's JSON cannot carry a blob."""
    if not children:
        return
    values = ", ".join(["(?, ?, ?)"] * len(children))
    statement = (
        RECORD_INTO + "SELECT ?, v.column1, ?, v.column1, v.column2, v.column3, ?, ?, ?, ?, "
        f"NULL, NULL, NULL FROM (VALUES {values}) AS v WHERE true" + RECORD_UPSERT
    )
    params: list[Any] = [
        common["tenant_id"],
        common["graph"],
        common["run_type"],
        common["run"],
        common["at"],
        common["at"],
    ]
    for key, (input_type, blob) in children:
        params.extend((key.execution_id, input_type, blob))
    await conn.exec_driver_sql(statement, tuple(params))
