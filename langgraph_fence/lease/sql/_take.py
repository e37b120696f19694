"""The take of a run: bind its thread, take its lease, write its record, all or nothing.

One statement on PostgreSQL; on SQLite one ``BEGIN IMMEDIATE`` transaction, run as one call
on the connection's thread. The lease is taken only where the thread is bound to the
execution (and, for a run with a record, no submitted run of it waits for a worker), and the
record is written only where the lease was taken: a refused start never rewrites the record
of the run in flight.

The records' tables come from :mod:`langgraph_fence.lease.records`, imported when a take is
built or run: that module loads LangGraph's serializer, which the CLI's listings (a lease
store, no runs) must not.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any, NamedTuple

from sqlalchemy import (
    Double,
    Integer,
    Text,
    and_,
    bindparam,
    exists,
    literal,
    null,
    select,
    text,
    true,
    union_all,
)
from sqlalchemy.dialects import postgresql as pg_dialect

from langgraph_fence.database.driver import DriverStatement, sqlite_fetch
from langgraph_fence.lease import LeaseKey
from langgraph_fence.lease.sql._statements import LeaseStatements

__all__ = ["SqliteTake", "build_take", "record_params"]

#: The record's columns :meth:`SqlLeaseRepository.take` binds by name (``recorded_at``
#: comes as ``at``, ``thread_id`` is the take's own).
_RECORD_BINDS = ("graph", "input_type", "input", "run_type", "run")


def record_params(record: Mapping[str, Any]) -> dict[str, Any]:
    """The take's parameters for ``record`` (the columns of
    :meth:`~langgraph_fence.lease.records.SqlExecutionRecords.columns`)."""
    params = {f"p_{name}": record[name] for name in _RECORD_BINDS}
    params["p_recorded_at"] = record["at"]
    return params


def build_take(statements: LeaseStatements, *, with_record: bool) -> Any:
    """The take's lease statement (SQLite: the acquire offered only where the thread is
    bound to the key), or the whole take as one statement of CTEs (PostgreSQL)."""
    from langgraph_fence.lease.records import (
        BINDINGS,
        CLEARED,
        EXECUTIONS,
        RECORDED,
        SUBMIT_WAITING,
    )

    tenant = bindparam("p_tenant_id", type_=Text)
    thread = bindparam("p_thread_id", type_=Text)
    execution = bindparam("p_execution_id", type_=Text)
    # New input is refused while a submitted run waits (run.py says so with the reason).
    no_submit_waiting = text(
        "NOT EXISTS (SELECT 1 FROM fence_leases l WHERE l.tenant_id = :p_tenant_id "
        f"AND l.execution_id = :p_execution_id AND {SUBMIT_WAITING})"
    )
    b = BINDINGS.c
    if statements.dialect == "sqlite":
        # The binding was written (or found) by the transaction's first statement.
        when: Any = exists().where(
            b.tenant_id == tenant, b.thread_id == thread, b.execution_id == execution
        )
        if with_record:
            when = and_(when, no_submit_waiting)
        return statements.acquire_upsert(reopen=True, when=when)
    # PostgreSQL: every part sees the table as it was when the statement began, and the
    # parts see each other's rows only through RETURNING. A first run that loses the
    # race to bind the thread finds no binding at all (its insert met the winner's row,
    # which its snapshot does not show): it takes nothing and writes nothing.
    existing = (select(b.execution_id).where(b.tenant_id == tenant, b.thread_id == thread)).cte(
        "existing"
    )
    bind = pg_dialect.insert(BINDINGS).from_select(
        ["tenant_id", "thread_id", "execution_id", "bound_at"],
        select(tenant, thread, execution, bindparam("p_at", type_=Double)).where(
            ~exists(select(existing.c.execution_id))
        ),
    )
    inserted = (
        bind.on_conflict_do_nothing(index_elements=["tenant_id", "thread_id"])
        .returning(b.execution_id)
        .cte("inserted")
    )
    binding = union_all(select(existing.c.execution_id), select(inserted.c.execution_id)).cte(
        "binding"
    )
    when = exists(select(binding.c.execution_id).where(binding.c.execution_id == execution))
    if with_record:
        when = and_(when, no_submit_waiting)
    taken = statements.acquire_upsert(reopen=True, when=when).cte("taken")
    one = select(literal(1, Integer).label("one")).subquery("one")
    stmt = select(
        select(binding.c.execution_id).limit(1).scalar_subquery().label("bound"),
        *taken.c,
    ).select_from(one.outerjoin(taken, true()))
    if not with_record:
        return stmt
    e = EXECUTIONS.c
    offered = select(
        tenant,
        execution,
        *(bindparam(f"p_{name}", type_=e[name].type) for name in RECORDED),
    ).where(exists(select(taken.c.epoch)))
    record = pg_dialect.insert(EXECUTIONS).from_select(
        ["tenant_id", "execution_id", *RECORDED], offered
    )
    upsert = record.on_conflict_do_update(
        index_elements=["tenant_id", "execution_id"],
        set_={
            **{name: record.excluded[name] for name in RECORDED},
            **dict.fromkeys(CLEARED, null()),
        },
    ).returning(e.tenant_id)
    return stmt.add_cte(upsert.cte("recorded"))


class SqliteTake(NamedTuple):
    """The take on SQLite, its statements compiled for the driver: bind the thread, take
    the lease, read the binding back, write the record."""

    bind: DriverStatement
    take: DriverStatement
    bound_to: DriverStatement
    upsert: DriverStatement

    def run(
        self,
        conn: sqlite3.Connection,
        key: LeaseKey,
        thread_id: str,
        params: dict[str, Any],
        record: Mapping[str, Any] | None,
    ) -> tuple[Any, str]:
        """The take in one transaction on ``conn``: the lease row taken (or ``None``) and
        the execution id the thread is bound to."""
        binding = {"tenant_id": key.tenant_id, "thread_id": thread_id}
        # BEGIN IMMEDIATE: the write lock from the first statement on, so no other
        # writer comes between the binding, the lease and the record. The whole
        # transaction is one call on the connection's thread: one hop, not five.
        conn.execute("BEGIN IMMEDIATE")
        try:
            sqlite_fetch(
                conn, self.bind, {**binding, "execution_id": key.execution_id, "at": params["p_at"]}
            )
            rows = sqlite_fetch(conn, self.take, params)
            if rows:
                if record is not None:
                    sqlite_fetch(conn, self.upsert, record)
                found: tuple[Any, str] = (rows[0], key.execution_id)
            else:
                found = (None, sqlite_fetch(conn, self.bound_to, binding)[0]["execution_id"])
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return found
