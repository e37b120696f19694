"""Admin operations on a thread, under its execution's lease; and erasure.

Deleting, pruning, copying into or deleting runs of a thread while a run of it writes lands in
the middle of that run: the run goes on over rows that are gone (it ends ``done`` over a state
missing a channel's blob) or beside rows no token wrote. So an admin operation made through
an :class:`~langgraph_fence.Instance`'s checkpointer first takes the lease of the thread's
execution (the execution the thread is bound to) under an admin holder id, for its duration:

* while another holder's lease has not expired, it is refused with
  :class:`~langgraph_fence.errors.ExecutionLeaseHeldError` naming the execution and its
  holder, before anything is changed;
* otherwise the take moves the token on (epoch + 1), so a stale writer of the execution is
  fenced from then on, and a run that starts meanwhile is refused as by any holder;
* when the operation ends the lease is given back as it was found (status, reason and stamp
  set; an expired hold becomes ``pending``, a takeover candidate as before; a lease that did
  not exist is removed again), in one statement guarded by the admin's hold.

The take and the give-back each read and write the lease row in one transaction (the row
locked on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite): they are admin paths, beside the
lease store's one-statement hot paths, which they leave alone.

Erasure (:meth:`ThreadAdmin.erase`) removes every row derived from the thread under the
holds of its execution and of every ``ANY_INSTANCE`` child execution under it (recursively:
the children hold what the parent passed them; found by their records, the exact parent
their id names): for each, its checkpoints, blobs and writes, the execution's record (its
input) with its submitted and queued runs, the thread's binding (the thread id can be bound
again), the store items its steps wrote last, the exactly-once sink's stored results of the
execution's scope key, and the lease's reason and stamp set. Each lease row stays, ``done`` with
no reason: its epoch must never go back (a frozen worker still holding an old token, and the
sink's high-water mark, both rely on each take of a key getting a higher token), so a later
run of the same execution takes the next token as a new turn on a finished thread. The
sink's high-water mark row stays too: it holds the scope key and a token, no result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, delete, insert, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence.database import dialect_of, transaction
from langgraph_fence.database.retry import backoff
from langgraph_fence.errors import ExecutionLeaseHeldError
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus, validate_holder, validate_ttl
from langgraph_fence.lease.memory import MemoryLeaseRepository
from langgraph_fence.lease.schema import LEASES
from langgraph_fence.lease.stores import base_store
from langgraph_fence.lease.timeline import FailoverUnclassified, token_floor
from langgraph_fence.lease.transitions import fenced_error

if TYPE_CHECKING:
    from langgraph_fence.lease import ExecutionLeaseRepository
    from langgraph_fence.lease.records import ExecutionRecords

__all__ = [
    "AdminHold",
    "ThreadAdmin",
    "admin_holder",
    "count_erasable",
    "decide_admin_give_back",
    "decide_admin_take",
]

logger = logging.getLogger("langgraph_fence.admin")

_C = LEASES.c


@dataclass(frozen=True, slots=True)
class AdminHold:
    """An admin operation's hold of one execution: the lease as found, and as taken."""

    found: Lease | None
    held: Lease

    @property
    def key(self) -> LeaseKey:
        """The execution held."""
        return self.held.key


def decide_admin_take(
    current: Lease | None, key: LeaseKey, holder: str, ttl: float, now: float, *, store_id: str
) -> Lease | None:
    """The lease an admin operation holds, or ``None`` while another holder's has not expired.

    Taken whatever the status (a dead-lettered or finished execution too: nothing runs it),
    at epoch + 1 (1 when absent); the reason and stamp set stay for the give-back.
    """
    validate_holder(holder)
    ttl = validate_ttl(ttl)
    if current is None:
        return Lease(key, holder, 1, now + ttl, (), LeaseStatus.RUNNING, None, store_id)
    held = (
        current.status is LeaseStatus.RUNNING
        and current.holder is not None
        and current.expires_at is not None
        and current.expires_at > now
    )
    if held:
        return None
    return replace(
        current, holder=holder, epoch=current.epoch + 1, expires_at=now + ttl,
        status=LeaseStatus.RUNNING,
    )  # fmt: skip


def decide_admin_give_back(found: Lease | None, held: Lease, *, erased: bool) -> Lease | None:
    """The lease after the admin's hold: as found (``None``: no lease row, as found).

    A hold found expired (``running``, its holder gone) is given back ``pending``: a
    takeover candidate, as it was. After an erasure: ``done``, no reason, no stamps, and the
    takeover budget reset (the thread starts afresh; only the token goes on).
    """
    if found is None:
        return None
    status = found.status
    reason, effects = found.reason, found.pending_effects
    takeovers, mark = found.takeovers, found.progress_mark
    if status is LeaseStatus.RUNNING:
        status = LeaseStatus.PENDING
    if erased:
        status, reason, effects, takeovers, mark = LeaseStatus.DONE, None, (), 0, None
    return replace(
        held,
        holder=None,
        expires_at=None,
        status=status,
        reason=reason,
        pending_effects=effects,
        takeovers=takeovers,
        progress_mark=mark,
    )


async def _take(store: Any, key: LeaseKey, holder: str, ttl: float) -> AdminHold | Lease:
    """Take ``key`` for the admin; the hold, or the lease that refused it."""
    if isinstance(store, MemoryLeaseRepository):
        now = await store.now()
        async with store.locked(key) as row:
            found = row.lease
            taken = decide_admin_take(found, key, holder, ttl, now, store_id=store.store_id)
            if taken is None:
                assert found is not None
                return found
            row.lease = taken
            return AdminHold(found, taken)
    try:
        try:
            return await _take_row(store, key, holder, ttl)
        except FailoverUnclassified:
            await store.settle_failover()
            return await _take_row(store, key, holder, ttl)
    except IntegrityError:
        # A run's first acquire inserted the row between this take's read and its insert
        # (PostgreSQL: nothing to lock before the row exists); now there is a row to lock.
        return await _take_row(store, key, holder, ttl)


async def _take_row(store: Any, key: LeaseKey, holder: str, ttl: float) -> AdminHold | Lease:
    where = and_(_C.tenant_id == key.tenant_id, _C.execution_id == key.execution_id)
    async with transaction(store.engine) as conn:
        row = (await conn.execute(select(LEASES).where(where).with_for_update())).first()
        found = None if row is None else store.lease_of(row)
        now = await store.now()  # after the lock: a hold that expired meanwhile is free
        taken = decide_admin_take(found, key, holder, ttl, now, store_id=store.store_id)
        if taken is None:
            assert found is not None
            return found  # type: ignore[no-any-return]
        # Above every token an earlier timeline issued (lease.timeline): after a failover
        # the row may not show the last of them. While its executions are unclassified
        # (quarantine), no hold: its give-back would move one out of the classification.
        floor, classified = await token_floor(conn, dialect_of(store.engine))
        if not classified and getattr(store, "on_failover", "trust") == "quarantine":
            raise FailoverUnclassified()
        taken = replace(taken, epoch=max(taken.epoch, floor + 1))
        values = {
            "epoch": taken.epoch,
            "holder": taken.holder,
            "expires_at": taken.expires_at,
            "status": taken.status.value,
            "updated_at": now,
        }
        if found is None:
            await conn.execute(
                insert(LEASES).values(
                    tenant_id=key.tenant_id,
                    execution_id=key.execution_id,
                    scope_key=key.scope_key,
                    pending_effects={},
                    **values,
                )
            )
        else:
            await conn.execute(update(LEASES).where(where).values(**values))
    return AdminHold(found, taken)


async def _give_back(store: Any, hold: AdminHold, *, erased: bool) -> None:
    """Give the admin's hold back (see :func:`decide_admin_give_back`); guarded by it."""
    held, key = hold.held, hold.key
    after = decide_admin_give_back(hold.found, held, erased=erased)
    if isinstance(store, MemoryLeaseRepository):
        async with store.locked(key) as row:
            current = row.lease
            if current is None or (current.holder, current.epoch) != (held.holder, held.epoch):
                raise fenced_error(held, current, action="give back the admin hold")
            row.lease = after
        return
    guard = and_(
        _C.tenant_id == key.tenant_id,
        _C.execution_id == key.execution_id,
        _C.holder == held.holder,
        _C.epoch == held.epoch,
        _C.status == LeaseStatus.RUNNING.value,
    )
    async with transaction(store.engine) as conn:
        if after is None:
            result = await conn.execute(delete(LEASES).where(guard))
        else:
            values: dict[str, Any] = {
                "holder": None,
                "expires_at": None,
                "status": after.status.value,
                "reason": after.reason,
                "takeovers": after.takeovers,
                "progress_mark": after.progress_mark,
                "updated_at": await store.now(),
            }
            if erased:
                values["pending_effects"] = {}
            # Otherwise the stamp set stays as stored: rewritten from its parsed form, an
            # entry of another version (an effect this one reads as retryable) would lose
            # what it said.
            result = await conn.execute(update(LEASES).where(guard).values(**values))
        if result.rowcount == 1:
            return
    current = await store.get(key)
    raise fenced_error(held, current, action="give back the admin hold")


def _held_message(key: LeaseKey, thread_id: str, current: Lease, action: str) -> str:
    return (
        f"{action} of thread {thread_id!r} of tenant {key.tenant_id!r} refused: its execution "
        f"{key.execution_id!r} (scope key {key.scope_key!r}) is held by {current.holder!r} at "
        f"token {current.epoch} until {current.expires_at} (store clock). Nothing was changed: "
        "wait for that run to end (or for its lease to expire if that instance died), then "
        "try again"
    )


class ThreadAdmin:
    """Runs admin operations on threads under their executions' leases (see the module).

    Args:
        repository: the lease store (SQL or memory, possibly wrapped).
        records: the execution records and thread bindings.
        holder: the admin's holder id, as refusals and the lease table show it.
        ttl: how long an admin hold lasts (an admin process that dies frees it after that).
        sink_engine: the database of the exactly-once sink's tables, whose stored results
            an erasure deletes (default: the SQL lease store's; none over a memory store).
        store: the store whose items an erased execution's steps wrote are deleted with it
            (anything with ``erase_written_by(tenant_id, execution_id)``, as
            :class:`checkpointers.SqlStore`; ``Instance.open`` passes ``instance.store``'s).
    """

    def __init__(
        self,
        repository: ExecutionLeaseRepository,
        records: ExecutionRecords,
        *,
        holder: str,
        ttl: float = 30.0,
        sink_engine: AsyncEngine | None = None,
        store: Any = None,
    ) -> None:
        self.store = store
        self.repository = repository
        self.records = records
        self.holder = validate_holder(holder)
        self.ttl = validate_ttl(ttl)
        if sink_engine is None:
            try:
                sink_engine = getattr(base_store(repository), "engine", None)
            except ValueError:  # a store of another kind: its admin calls are refused
                sink_engine = None
        self.sink_engine = sink_engine

    async def execution_of(self, tenant_id: str, thread_id: str) -> LeaseKey:
        """The execution ``thread_id`` of ``tenant_id`` is bound to.

        An unbound thread is bound to its default execution (the thread id), as a first run
        without ``execution_id`` would bind it: a run racing the admin binds it the same way
        or is refused, so both always meet on one lease.
        """
        default = LeaseKey(tenant_id, thread_id)
        return LeaseKey(tenant_id, await self.records.bind(default, thread_id))

    @asynccontextmanager
    async def hold(
        self,
        tenant_id: str,
        thread_ids: Iterable[str],
        *,
        action: str,
        erase: bool = False,
        wait: float = 0.0,
    ) -> AsyncIterator[list[AdminHold]]:
        """Hold the execution of each thread for the block; give each back after it.

        Threads are taken in order of id (two admins never wait on each other in a
        circle). With ``erase``, a block that ends normally gives each lease back ``done``
        with no reason and no stamps. With ``wait``, a lease another holder holds is asked
        for again, with backoff, for up to ``wait`` seconds before the refusal.

        Raises:
            ExecutionLeaseHeldError: another holder's lease of one of the executions has not
                expired (the holds taken before it are given back; nothing was changed).
            ExecutionFencedError: the admin's hold was taken over before the give-back (the
                operation ran past ``ttl``).
        """
        store = base_store(self.repository)
        holds: list[AdminHold] = []
        async with AsyncExitStack() as stack:
            for thread_id in sorted(set(thread_ids)):
                key = await self.execution_of(tenant_id, thread_id)
                taken = await _take(store, key, self.holder, self.ttl)
                until = time.monotonic() + wait
                attempt = 0
                while not isinstance(taken, AdminHold) and time.monotonic() < until:
                    await asyncio.sleep(min(backoff(attempt), max(0.0, until - time.monotonic())))
                    attempt += 1
                    taken = await _take(store, key, self.holder, self.ttl)
                if not isinstance(taken, AdminHold):
                    raise ExecutionLeaseHeldError(_held_message(key, thread_id, taken, action))
                stack.push_async_callback(_give_back, store, taken, erased=False)
                holds.append(taken)
            logger.info(
                "%s: holding %s",
                action,
                ", ".join(f"{h.key.scope_key}@{h.held.epoch}" for h in holds),
            )
            yield holds
            if erase:
                stack.pop_all()
                for taken in reversed(holds):
                    await _give_back(store, taken, erased=True)

    async def tree(self, tenant_id: str, thread_id: str) -> list[tuple[LeaseKey, str]]:
        """``(execution, thread)`` of the thread's execution and of every ``ANY_INSTANCE``
        child under it, recursively (children found by their records: exact parent)."""
        tree = [(await self.execution_of(tenant_id, thread_id), thread_id)]
        children_of = getattr(self.records, "children_of", None)
        if children_of is None:  # records of another kind keep no children
            return tree
        seen = {tree[0][0]}
        index = 0
        while index < len(tree):
            for child, child_thread in await children_of(tree[index][0]):
                if child not in seen:
                    seen.add(child)
                    tree.append((child, child_thread))
            index += 1
        return tree

    async def erase(
        self,
        tenant_id: str,
        thread_id: str,
        delete_checkpoints: Callable[[str], Awaitable[None]],
    ) -> None:
        """Erase the tenant's thread and everything derived from it, under the holds of its
        execution and of every ``ANY_INSTANCE`` child execution under it (recursively).

        For each such execution: ``delete_checkpoints(thread)`` (its checkpoints, blobs and
        writes), then :meth:`forget` (its record, submitted and queued runs, binding, the
        store items it wrote and the sink's results). Children are looked up again under
        the holds until no new one appears (the parent cannot spawn one while held).

        Raises:
            ExecutionLeaseHeldError: another holder runs the execution or one of its
                children: nothing was changed.
        """
        threads = await self.tree(tenant_id, thread_id)
        while True:
            wanted = [thread for _, thread in threads]
            async with self.hold(tenant_id, wanted, action="delete_thread", erase=True) as holds:
                found = await self.tree(tenant_id, thread_id)
                if {t for _, t in found} <= set(wanted):
                    held = {hold.key: hold for hold in holds}
                    for _, thread in reversed(found):  # children first
                        await delete_checkpoints(thread)
                        await self.forget(held[await self.execution_of(tenant_id, thread)], thread)
                    return
            threads = found

    async def forget(self, hold: AdminHold, thread_id: str) -> None:
        """Delete the execution's record (with its submitted and queued runs), the thread's
        binding, the store items its steps wrote and the sink's results."""
        await self.records.forget(hold.key, thread_id)
        if self.store is not None:
            await self.store.erase_written_by(hold.key.tenant_id, hold.key.execution_id)
        if self.sink_engine is not None:
            from langgraph_fence.sinks import erase_results

            await erase_results(self.sink_engine, hold.key.scope_key)


def admin_holder(instance_id: str) -> str:
    """The holder id of an instance's admin operations: ``<instance id>/admin``."""
    return f"{instance_id}/admin"


#: What an erase deletes, by table: ``(table, the column it is found by)``; a thread's rows by
#: its thread id, an execution's by its execution id.
_ERASED_BY = (
    ("fence_checkpoints", "thread_id"),
    ("fence_checkpoint_blobs", "thread_id"),
    ("fence_checkpoint_writes", "thread_id"),
    ("fence_executions", "execution_id"),
    ("fence_runs", "execution_id"),
    ("fence_server_attempts", "execution_id"),
    ("fence_journal", "execution_id"),
    ("fence_thread_bindings", "thread_id"),
    ("fence_store_items", "fence_execution"),
)


async def count_erasable(
    engine: AsyncEngine, tenant_id: str, tree: Sequence[tuple[LeaseKey, str]]
) -> dict[str, int]:
    """How many rows of each table an erase of ``tree`` (:meth:`ThreadAdmin.tree`) would
    delete now: what ``langgraph-fence erase`` reports, counted before and after it."""
    threads = sorted({thread for _, thread in tree})
    executions = sorted({key.execution_id for key, _ in tree})
    counts: dict[str, int] = {}
    async with engine.connect() as conn:
        for table, column in _ERASED_BY:
            ids = threads if column == "thread_id" else executions
            names = ", ".join(f":i{n}" for n in range(len(ids)))
            params: dict[str, Any] = {f"i{n}": value for n, value in enumerate(ids)}
            params["tenant"] = tenant_id
            statement = text(
                f"SELECT count(*) FROM {table} WHERE tenant_id = :tenant AND {column} IN ({names})"
            )
            counts[table] = int((await conn.execute(statement, params)).scalar_one())
    return counts
