"""A child's write is never repeated: its stamp stands until a resume from the ROOT would
not run it again.

The graphs of ``tests.support.write_steps`` (``nested-*``): START -> hold -> parent ->
receipt, where ``parent`` runs a child graph, START -> charge -> child_done, as a subgraph
under the root's lease (a ``PARENT_INSTANCE`` child, the compiled child added as the node,
or a grandchild two levels down). ``charge`` is the one non-idempotent write.

The double charge these tests reproduce: under ``durability="async"`` the root checkpoint of
``parent``'s superstep is saved concurrently with ``parent``. When it is slow (a slow disk, a
lock wait), the child's ``charge`` finishes and its writes land, with its own subgraph
checkpoint, before the root's is stored. Those writes used to clear charge's stamp; a crash
then (here: the worker's database connection lost for good, so its lease lapses), and the
takeover resumed from the root checkpoint before: LangGraph gave ``parent`` a new task id,
the child started over in a new namespace, and charged again.

Each case runs on SQLite and PostgreSQL, with the project's ``SqlCheckpointer`` (the check in
the write's own statement) and with ``FencedCheckpointer`` over another saver (the check
after the inner write).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver

from langgraph_fence import (
    ExecutionDeadLetteredError,
    ExecutionLeaseLostError,
    Instance,
    LeaseKey,
    LeaseStatus,
)
from langgraph_fence.database import create_engine
from langgraph_fence.fence.admission import writes_proof
from langgraph_fence.lease import Lease
from langgraph_fence.lease.faults import arm_fault
from langgraph_fence.lease.records import SqlExecutionRecords
from langgraph_fence.lease.sql import SqlLeaseRepository
from tests.support.databases import unique
from tests.support.polling import eventually
from tests.support.write_steps import (
    NESTED_VARIANTS,
    TENANT,
    Database,
    build_graph,
    effects_of,
    engine_options,
    graph_name,
)

# A's lease lapses this long after its connection is lost; long enough that a loaded box
# never lapses it first (1.2 did in test_fault_points.py, renewals answered late).
TTL = 3.0
DEADLINE = 30.0
SAVERS = ("sql", "wrapped")

#: Instances of one test that meet on one database; ``wrapped`` ones share one InMemorySaver.
OpenInstance = Callable[[str], Any]


@pytest.fixture(params=SAVERS)
def saver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_instance(saver: str, database: Database) -> OpenInstance:
    """``open_instance(instance_id)``: an instance on the test's database, with the SQL saver
    (``sql``), or with ``FencedCheckpointer`` over an ``InMemorySaver`` every instance of
    the test shares (``wrapped``: leases and records stay in the database)."""
    shared = InMemorySaver()

    @asynccontextmanager
    async def opened(instance_id: str) -> AsyncIterator[Instance]:
        options = engine_options(database.url, database.schema)
        if saver == "sql":
            async with Instance.open(
                database.url, engine_options=options, instance_id=instance_id, lease_ttl=TTL
            ) as instance:
                yield instance
            return
        engine = create_engine(database.url, **options)
        repository = SqlLeaseRepository(engine)
        await repository.setup()
        instance = Instance(
            repository,
            shared,
            instance_id=instance_id,
            lease_ttl=TTL,
            records=SqlExecutionRecords(engine),
        )
        try:
            yield instance
        finally:
            await instance.aclose()
            await repository.aclose()
            await engine.dispose()

    return opened


def _ns(context: Mapping[str, Any]) -> str:
    return str(context["config"]["configurable"].get("checkpoint_ns") or "")


def _is_charge(context: Mapping[str, Any]) -> bool:
    return any(channel == "log" and value == ["charge"] for channel, value in context["writes"])


class Lost:
    """The worker's database gone for good from the first :meth:`now` on: every later
    fault point raises as a dead connection (its release too, so its lease lapses)."""

    def __init__(self) -> None:
        self.gone = False

    def now(self, where: str) -> None:
        self.gone = True
        raise ConnectionResetError(f"injected at {where}: connection lost")

    def after(self, context: Mapping[str, Any]) -> None:
        if self.gone:
            raise ConnectionResetError("injected: the connection stays lost")


async def _run_a(
    open_instance: OpenInstance,
    variant: str,
    directory: Path,
    durability: str,
    arm: Callable[[ExitStack, Lost, Instance], None],
) -> str:
    """Instance A runs one execution until its connection is lost; its execution id."""
    execution_id = unique(variant)
    lost = Lost()
    async with open_instance("A") as a:
        graph = build_graph(a, variant, directory, doomed=False)
        with ExitStack() as faults:
            arm(faults, lost, a)
            faults.enter_context(arm_fault("release.before", lost.after))
            with pytest.raises(
                (ExecutionLeaseLostError, ExecutionDeadLetteredError, ConnectionResetError)
            ):
                await a.ainvoke(
                    graph,
                    {"log": []},
                    {"configurable": {"thread_id": execution_id}},
                    tenant_id=TENANT,
                    durability=durability,  # type: ignore[arg-type]
                )
        assert lost.gone, "the connection was never lost: the fault point was not reached"
    return execution_id


async def _take_over(
    open_instance: OpenInstance, variant: str, directory: Path, execution_id: str
) -> Lease:
    """Instance B serves the graph until the execution has ended; its lease then."""
    async with open_instance("B") as b:
        graph = build_graph(b, variant, directory, doomed=False)
        stop = asyncio.Event()
        serving = asyncio.create_task(
            b.serve(
                {graph_name(variant): graph}, poll_interval=0.05, stop=stop, handle_signals=False
            )
        )

        async def ended() -> Lease | None:
            lease = await b.repository.get(LeaseKey(TENANT, execution_id))
            done = (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED, LeaseStatus.FAILED)
            return lease if lease is not None and lease.status in done else None

        try:
            return await eventually(ended, timeout=DEADLINE, what="the takeover to end")
        finally:
            stop.set()
            await asyncio.wait_for(serving, 30)


def _assert_charged_once(lease: Lease, effects: list[str]) -> str:
    where = f"{effects}, {lease.status.value}: {lease.reason}"
    assert effects.count("charge") == 1, where
    assert lease.status in (LeaseStatus.DONE, LeaseStatus.DEAD_LETTERED), where
    if lease.status is LeaseStatus.DEAD_LETTERED:
        assert lease.reason is not None, where
        assert "'charge'" in lease.reason, where
    return where


def _child_writes_before_the_roots_checkpoint(
    faults: ExitStack, lost: Lost, a: Instance, charge_stored: asyncio.Event
) -> None:
    """charge's writes wait for the subgraph checkpoint they belong to (that one stored,
    the root's of parent's superstep not yet: what used to clear the stamp); once they
    are stored, and every checkpoint of their proof below the root, ``charge_stored`` is
    set."""

    def stored(context: Mapping[str, Any], levels: list[tuple[str, str]]) -> Any:
        """Whether A's saver has the checkpoint of each ``(namespace, id)`` of ``levels``."""
        base = {**context["config"]["configurable"], "tenant_id": TENANT}
        base.pop("__fence", None)

        async def all_stored() -> bool:
            for ns, checkpoint_id in levels:
                at = {**base, "checkpoint_ns": ns, "checkpoint_id": checkpoint_id}
                if await a.checkpointer.aget_tuple({"configurable": at}) is None:
                    return False
            return True

        return all_stored

    async def after_the_childs_checkpoint(context: Mapping[str, Any]) -> None:
        lost.after(context)
        if _ns(context) and _is_charge(context):
            own = context["config"]["configurable"]
            levels = [(str(own["checkpoint_ns"]), str(own["checkpoint_id"]))]
            await eventually(
                stored(context, levels), timeout=DEADLINE, what="the child's checkpoint"
            )

    async def note_writes(context: Mapping[str, Any]) -> None:
        lost.after(context)
        if _ns(context) and _is_charge(context):
            # Every level between the child and the root stored too (nested-deep's middle
            # graph checkpoints concurrently under durability="async"): then the root's
            # checkpoint is the one that completes the proof, whatever the box's load.
            below_the_root = [at for at in writes_proof(context["config"]) if at[0]]
            await eventually(
                stored(context, below_the_root), timeout=DEADLINE, what="the levels below the root"
            )
            charge_stored.set()

    faults.enter_context(arm_fault("writes.before", after_the_childs_checkpoint))
    faults.enter_context(arm_fault("writes.after", note_writes))
    faults.enter_context(arm_fault("stamp.after", lost.after))


def _parents_superstep(context: Mapping[str, Any]) -> bool:
    """The root checkpoint whose tasks include parent (step 1)."""
    return not _ns(context) and context["metadata"].get("step") == 1


def _hold_the_roots_checkpoint(
    faults: ExitStack, lost: Lost, a: Instance, charge_stored: asyncio.Event, *, lost_in_it: bool
) -> None:
    """The arm both races share: charge's writes go before the root checkpoint of parent's
    superstep, which waits until they are stored; ``lost_in_it``: the connection is lost
    right then, so that checkpoint never lands."""
    _child_writes_before_the_roots_checkpoint(faults, lost, a, charge_stored)

    async def hold_parents_checkpoint(context: Mapping[str, Any]) -> None:
        lost.after(context)
        if _parents_superstep(context):
            await asyncio.wait_for(charge_stored.wait(), DEADLINE)
            if lost_in_it:
                lost.now("the root checkpoint of parent's superstep")

    faults.enter_context(arm_fault("checkpoint.before", hold_parents_checkpoint))


@pytest.mark.parametrize("variant", NESTED_VARIANTS)
async def test_a_childs_writes_clear_nothing_while_the_roots_checkpoint_is_missing(
    open_instance: OpenInstance, variant: str, tmp_path: Path
) -> None:
    """The root checkpoint of ``parent``'s superstep is held back until the child's charge
    writes are stored, then the connection is lost: the resume would start before
    ``parent`` and run the child again, so the execution is dead-lettered, charged once."""
    (tmp_path / "effects").mkdir()
    charge_stored = asyncio.Event()

    def arm(faults: ExitStack, lost: Lost, a: Instance) -> None:
        _hold_the_roots_checkpoint(faults, lost, a, charge_stored, lost_in_it=True)

    execution_id = await _run_a(open_instance, variant, tmp_path, "async", arm)
    lease = await _take_over(open_instance, variant, tmp_path, execution_id)
    where = _assert_charged_once(lease, effects_of(tmp_path, execution_id))
    assert lease.status is LeaseStatus.DEAD_LETTERED, where


@pytest.mark.parametrize("variant", NESTED_VARIANTS)
async def test_the_roots_late_checkpoint_proves_the_childs_writes(
    open_instance: OpenInstance, variant: str, tmp_path: Path
) -> None:
    """The same race, but the root checkpoint lands late instead of never: it completes
    the proof of the child's writes and clears charge's stamp in its own write, so a crash
    right after it resumes past the charge (no false dead letter; before, the stamp stood
    until the root's next checkpoint, which comes only after the whole child)."""
    (tmp_path / "effects").mkdir()
    charge_stored = asyncio.Event()

    def arm(faults: ExitStack, lost: Lost, a: Instance) -> None:
        _hold_the_roots_checkpoint(faults, lost, a, charge_stored, lost_in_it=False)

        def lose_after_it(context: Mapping[str, Any]) -> None:
            lost.after(context)
            if _parents_superstep(context):
                lost.now("right after the root checkpoint of parent's superstep")

        faults.enter_context(arm_fault("checkpoint.after", lose_after_it))

    execution_id = await _run_a(open_instance, variant, tmp_path, "async", arm)
    lease = await _take_over(open_instance, variant, tmp_path, execution_id)
    where = _assert_charged_once(lease, effects_of(tmp_path, execution_id))
    assert lease.status is LeaseStatus.DONE, where


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
@pytest.mark.parametrize("variant", NESTED_VARIANTS)
async def test_a_child_killed_right_after_its_charge_is_never_charged_again(
    open_instance: OpenInstance, saver: str, variant: str, durability: str, tmp_path: Path
) -> None:
    """The connection is lost right after the child's charge (its writes stored; with
    ``durability="exit"``, which saves nothing before the end, right after its body):
    charged once, in every durability mode. With ``sync`` and the SQL saver every
    checkpoint above the child's was stored before it ran, so its writes proved it recorded
    in their own statement and the takeover resumes past it (not a false dead letter; over
    another saver the clear comes after the writes, and the connection was lost before)."""
    (tmp_path / "effects").mkdir()

    def arm(faults: ExitStack, lost: Lost, a: Instance) -> None:
        def after_charge_writes(context: Mapping[str, Any]) -> None:
            lost.after(context)
            if _ns(context) and _is_charge(context):
                lost.now("after the child's charge writes")

        def after_charge(context: Mapping[str, Any]) -> None:
            lost.after(context)
            if context["node"] == "charge":
                lost.now("after the child's charge")

        if durability == "exit":
            faults.enter_context(arm_fault("effect.after", after_charge))
        else:
            faults.enter_context(arm_fault("writes.after", after_charge_writes))
        faults.enter_context(arm_fault("checkpoint.before", lost.after))

    execution_id = await _run_a(open_instance, variant, tmp_path, durability, arm)
    lease = await _take_over(open_instance, variant, tmp_path, execution_id)
    where = _assert_charged_once(lease, effects_of(tmp_path, execution_id))
    if durability == "sync" and saver == "sql":
        assert lease.status is LeaseStatus.DONE, where
