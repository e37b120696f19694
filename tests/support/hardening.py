"""Executions and checkpoints a hardening test crafts: a logging graph, an expired
execution, a marker a crafted payload would leave."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypedDict

import ormsgpack
from sqlalchemy import text

from langgraph_fence import LeaseKey
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import ExecutionRecord
from langgraph_fence.testing import Leases
from tests.support.databases import unique
from tests.support.graphs import one_step

TENANT = "acme"


def crafted(path: Path) -> bytes:
    """msgpack that, decoded permissively, calls ``leave_marker(path)`` (ext 0: module, name,
    single argument): what an attacker with write access to the database would store."""
    call = ormsgpack.packb((__name__, leave_marker.__name__, str(path)))
    return ormsgpack.packb({"log": ormsgpack.Ext(0, call)})


def log_graph(instance: Instance, name: str = "served") -> Any:
    async def step(state: Log) -> dict[str, Any]:
        return {"log": [*state.get("log", []), "step"]}

    return one_step(instance, Log, "step", step, name=name)


async def expired(
    db: Leases, graph: str, *, raw: tuple[str, bytes] | None = None, tenant: str = TENANT
) -> LeaseKey:
    """An execution of ``graph`` whose instance died before its first checkpoint.

    With ``raw`` its recorded input is replaced by those ``(input_type, bytes)``, as a row
    written straight into ``fence_executions`` would be.
    """
    key = LeaseKey(tenant, unique("job"))
    await db.records.record(ExecutionRecord(key, graph, key.execution_id, {"log": []}))
    if raw is not None:
        async with db.engine.begin() as conn:
            await conn.execute(
                text(
                    "UPDATE fence_executions SET input_type = :t, input = :b "
                    "WHERE tenant_id = :tenant AND execution_id = :e"
                ),
                {"t": raw[0], "b": raw[1], "tenant": key.tenant_id, "e": key.execution_id},
            )
    assert await db.store.acquire(key, "died", 30.0) is not None
    return key


def leave_marker(path: str) -> str:
    """The harmless stand-in for ``os.system``: proves code ran by leaving a file."""
    Path(path).write_text("ran")
    return path


class Log(TypedDict, total=False):
    log: list[str]
