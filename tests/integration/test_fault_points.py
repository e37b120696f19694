"""Never twice under database faults: a connection lost at every fault point, then a takeover.

start -> hold -> charge -> receipt, ``charge`` the one non-idempotent write. Instance A runs
it; at a named fault point after ``charge`` began, A's connection is lost (the point raises
``ConnectionResetError``), and stays lost: its release fails too, so its lease lapses as a
worker's whose database went away. Instance B (an engine of its own) then takes the
execution over with ``serve()``. Whatever the point and the durability mode, ``charge`` ran
at most once: the execution is dead-lettered (the write may have happened) or resumed past
it from the checkpoint that recorded it.

``test_orphan_writes_are_no_proof`` is the race of the reliability chaos (2 double charges in
10 runs): under ``durability="async"`` the checkpoint of charge's superstep fails after
charge's writes landed on it, so those writes hang on a checkpoint no resume loads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from langgraph_fence import (
    ExecutionDeadLetteredError,
    ExecutionLeaseLostError,
    Instance,
    LeaseKey,
    LeaseStatus,
)
from langgraph_fence.lease.faults import arm_fault
from tests.support.databases import unique
from tests.support.fault_points import reachable
from tests.support.write_steps import (
    TENANT,
    Database,
    assert_charged_at_most_once,
    at_charge,
    build_graph,
    effects_of,
    engine_options,
    take_over_all,
)

# A's lease lapses this long after its connection is lost. Long enough that a loaded box
# never lapses it before the fault point (0.6, then 1.2 did: renewals answered late).
TTL = 3.0
DEADLINE = 30.0


CASES = [(d, p) for d in ("sync", "async", "exit") for p in reachable(d)]


def lost(point: str, began: list[str], gone: list[str]) -> Any:
    """Raise as a dead connection at ``point``: the first time after charge began, and
    every time once the connection is ``gone``."""

    def action(context: Mapping[str, Any]) -> None:
        if gone or at_charge(point, context, began):
            gone.append(point)
            raise ConnectionResetError(f"injected at {point}: connection lost")

    return action


@contextmanager
def database_gone_at(point: str, began: list[str]) -> Iterator[list[str]]:
    """From ``point`` on, this instance's database is gone: its release fails too."""
    gone: list[str] = []
    with ExitStack() as stack:
        stack.enter_context(arm_fault(point, lost(point, began, gone)))
        if point != "release.before":
            stack.enter_context(arm_fault("release.before", lost("-", [], gone)))
        yield gone


async def run_a(database: Database, directory: Path, durability: str, point: str) -> str:
    """Instance A runs one execution until the fault point; returns its execution id."""
    execution_id = unique("linear")
    async with Instance.open(
        database.url,
        engine_options=engine_options(database.url, database.schema),
        instance_id="A",
        lease_ttl=TTL,
    ) as a:
        began: list[str] = []
        graph = build_graph(a, "linear", directory, doomed=False, on_effect=began.append)
        # A write step that fails mid-write is dead-lettered at once (its write may have
        # happened); anything else stops lease-lost (an infrastructure error: handed back
        # for takeover, never failed), the lost connection as its cause. A run whose work is
        # all saved and whose final release fails raises that error: its lease lapses.
        with (
            database_gone_at(point, began) as gone,
            pytest.raises(
                (ExecutionLeaseLostError, ExecutionDeadLetteredError, ConnectionResetError)
            ) as raised,
        ):
            await a.ainvoke(
                graph,
                {"log": []},
                {"configurable": {"thread_id": execution_id}},
                tenant_id=TENANT,
                durability=durability,  # type: ignore[arg-type]
            )
        if isinstance(raised.value, ConnectionResetError):
            assert point == "release.before", raised.value
        elif not isinstance(raised.value, ExecutionDeadLetteredError):
            assert isinstance(raised.value.__cause__, ConnectionResetError), raised.value
        assert began == ([] if point == "stamp.after" else ["charge"])
        assert gone[0] == point
    return execution_id


@pytest.mark.parametrize(("durability", "point"), CASES)
async def test_a_connection_lost_at_any_fault_point_never_repeats_the_charge(
    database: Database, durability: str, point: str, tmp_path: Path
) -> None:
    (tmp_path / "effects").mkdir()
    execution_id = await run_a(database, tmp_path, durability, point)
    leases = await take_over_all(database, "linear", tmp_path, [execution_id], deadline=DEADLINE)
    lease = leases[execution_id]
    effects = effects_of(tmp_path, execution_id)
    where = f"{point}/{durability}: {effects}, {lease.status.value} {lease.reason}"
    assert_charged_at_most_once(point, lease, effects, where)


async def test_orphan_writes_are_no_proof(database: Database, tmp_path: Path) -> None:
    """charge's writes land on its superstep's checkpoint, whose own write then fails."""
    (tmp_path / "effects").mkdir()
    execution_id = unique("orphan")
    charge_writes_landed = asyncio.Event()
    superstep: list[str] = []

    def note_stamp(context: Mapping[str, Any]) -> None:
        if context["effect"].node == "charge":
            superstep.append(context["effect"].checkpoint_id)

    def note_writes(context: Mapping[str, Any]) -> None:
        if any(channel == "log" and value == ["charge"] for channel, value in context["writes"]):
            charge_writes_landed.set()

    async def fail_charges_checkpoint(context: Mapping[str, Any]) -> None:
        # The checkpoint whose tasks include charge (step 1): hold it until charge's
        # writes are stored on it, then lose the connection.
        if context["metadata"].get("step") == 1:
            await asyncio.wait_for(charge_writes_landed.wait(), DEADLINE)
            assert superstep == [context["checkpoint"]["id"]]
            raise ConnectionResetError("injected: the checkpoint's connection was killed")

    async with Instance.open(
        database.url,
        engine_options=engine_options(database.url, database.schema),
        instance_id="A",
        lease_ttl=TTL,
    ) as a:
        graph = build_graph(a, "linear", tmp_path, doomed=False)
        with (
            arm_fault("stamp.after", note_stamp),
            arm_fault("writes.after", note_writes),
            arm_fault("checkpoint.before", fail_charges_checkpoint),
            arm_fault("release.before", lost("-", [], ["gone"])),
            pytest.raises(ExecutionLeaseLostError) as raised,
        ):
            await a.ainvoke(
                graph,
                {"log": []},
                {"configurable": {"thread_id": execution_id}},
                tenant_id=TENANT,
                durability="async",
            )
        assert isinstance(raised.value.__cause__, ConnectionResetError), raised.value
        # The writes are stored, their checkpoint is not: a resume would start before charge.
        state = await graph.aget_state(
            {"configurable": {"thread_id": execution_id, "tenant_id": TENANT}}
        )
        assert state.metadata is not None, state
        assert state.metadata["step"] == 0, state
        stored = await a.repository.get(LeaseKey(TENANT, execution_id))
        assert stored is not None
        assert [e.node for e in stored.pending_effects] == ["charge"]  # not cleared by them
    started = time.monotonic()
    leases = await take_over_all(database, "linear", tmp_path, [execution_id], deadline=DEADLINE)
    lease = leases[execution_id]
    assert effects_of(tmp_path, execution_id) == ["charge"]
    assert lease.status is LeaseStatus.DEAD_LETTERED, lease
    assert lease.reason is not None
    assert "node 'charge' at token 1" in lease.reason
    assert time.monotonic() - started < DEADLINE


@pytest.mark.parametrize("durability", ["sync", "async", "exit"])
async def test_two_runs_in_a_row_on_one_thread_both_end_done(
    database: Database, durability: str, tmp_path: Path
) -> None:
    """A run that ended done leaves no entry standing, in every durability mode: with
    "exit" no task write is saved, so only the final checkpoint (and the release) can clear
    charge's entry; the first version left it and dead-lettered the thread's next run."""
    (tmp_path / "effects").mkdir()
    thread = unique("exit")
    async with Instance.open(
        database.url, engine_options=engine_options(database.url, database.schema)
    ) as instance:
        graph = build_graph(instance, "linear", tmp_path, doomed=False)
        for turn in (1, 2):
            out = await instance.ainvoke(
                graph,
                {"log": [f"turn {turn}"]},
                {"configurable": {"thread_id": thread}},
                tenant_id=TENANT,
                durability=durability,  # type: ignore[arg-type]
            )
            assert out["log"][-3:] == ["hold", "charge", "receipt"], out
            lease = await instance.repository.get(LeaseKey(TENANT, thread))
            assert lease is not None, lease
            assert lease.status is LeaseStatus.DONE, lease
            assert lease.pending_effects == (), lease
    assert effects_of(tmp_path, thread) == ["charge", "charge"]  # one per turn
