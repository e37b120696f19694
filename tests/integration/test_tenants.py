"""One thread, one execution: the tenant is part of every thread's key.

Two tenants that use the same thread id (``chat-1``: the normal case, not an attack) have two
threads that never meet, in both savers' rows and in every read through a fenced graph. A
thread is bound to one execution key: a run under another execution id is refused before it
takes a lease or writes anything. Every test runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import operator
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance.test_utils import generate_checkpoint
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from checkpointers.schema import CHECKPOINT_MIGRATIONS
from langgraph_fence import LeaseKey, SqlLeaseRepository
from langgraph_fence.database import create_engine, transaction
from langgraph_fence.database.migrations import migrate
from langgraph_fence.errors import ExecutionThreadBoundError
from langgraph_fence.fence.tenancy import DEFAULT_TENANT, inner_thread_id, outer_thread_id
from langgraph_fence.instance import Instance
from langgraph_fence.lease.records import EXECUTION_MIGRATIONS, SqlExecutionRecords
from langgraph_fence.lease.run_config import RecordedRun
from langgraph_fence.lease.schema import LEASE_MIGRATIONS
from tests.support.databases import SQL_BACKENDS, pg_engine_options, setup_all, unique
from tests.support.graphs import one_step

TABLES = ("fence_checkpoints", "fence_checkpoint_blobs", "fence_checkpoint_writes")


class Chat(TypedDict, total=False):
    secret: str
    log: Annotated[list[str], operator.add]


#: SqlCheckpointer on each database, and a saver that knows no tenants (LangGraph's
#: InMemorySaver, leases on SQLite): FencedCheckpointer keeps the tenants apart over it.
SAVERS = [*SQL_BACKENDS, "memory-saver"]


@pytest.fixture(params=SAVERS)
async def instance(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[Instance]:
    engine = make_engine("sqlite" if request.param == "memory-saver" else request.param)
    await setup_all(engine)
    repository = SqlLeaseRepository(engine)
    saver: BaseCheckpointSaver[Any] = InMemorySaver()
    if request.param != "memory-saver":
        saver = SqlCheckpointer(engine)
        await saver.setup()  # on this loop
    records = SqlExecutionRecords(engine)
    inst = Instance(repository, saver, instance_id=unique("inst"), lease_ttl=10.0, records=records)
    yield inst
    await inst.aclose()
    await engine.dispose()


def chat_graph(instance: Instance, step: Callable[[Chat], Any] | None = None) -> Any:
    async def answer(state: Chat) -> dict[str, Any]:
        if step is not None:
            await step(state)
        return {"log": [f"answer:{state.get('secret', '')}"]}

    return one_step(instance, Chat, "answer", answer, name="graph")


def thread_config(thread_id: str, tenant_id: str | None = None) -> RunnableConfig:
    configurable: dict[str, Any] = {"thread_id": thread_id}
    if tenant_id is not None:
        configurable["tenant_id"] = tenant_id
    return {"configurable": configurable}


async def tenant_rows(instance: Instance, thread_id: str) -> dict[str, list[bytes]]:
    """``{tenant: [every stored value of the thread's rows, as bytes]}``: over the three
    tables of SqlCheckpointer, or over what InMemorySaver keeps of the thread."""
    found: dict[str, list[bytes]] = {}
    inner = instance.checkpointer.inner
    if isinstance(inner, InMemorySaver):
        for inner_id, namespaces in inner.storage.items():
            tenant, thread = outer_thread_id(inner_id)
            if thread == thread_id:
                values = found.setdefault(tenant, [])
                for checkpoints in namespaces.values():
                    values.extend(bytes(c[1]) for c, _, _ in checkpoints.values())
                values.extend(bytes(v[1]) for k, v in inner.blobs.items() if k[0] == inner_id)
        return found
    assert isinstance(inner, SqlCheckpointer)
    async with inner.engine.connect() as conn:
        for table, column in zip(TABLES, ("checkpoint", "blob", "blob"), strict=True):
            result = await conn.execute(
                text(f"SELECT tenant_id, {column} FROM {table} WHERE thread_id = :t"),
                {"t": thread_id},
            )
            for tenant, value in result.all():
                found.setdefault(tenant, []).append(bytes(value or b""))
    return found


async def history(graph: Any, config: RunnableConfig) -> list[list[str]]:
    return [list(s.values.get("log", [])) async for s in graph.aget_state_history(config)]


async def assert_only_own(
    instance: Instance, graph: Any, thread: str, mine: str, theirs: str
) -> None:
    """Tenant ``mine`` sees only its own secret on ``thread``, in every read and every row."""
    config = thread_config(thread, mine)
    state = await graph.aget_state(config)
    assert state.values == {"secret": mine, "log": [f"answer:{mine}"]}
    assert state.config["configurable"]["tenant_id"] == mine
    for logs in await history(graph, config):
        assert all(theirs not in line for line in logs), logs
    listed = [t async for t in instance.checkpointer.alist(config)]
    assert listed
    assert all(t.config["configurable"]["tenant_id"] == mine for t in listed)
    assert all(theirs not in str(t.checkpoint["channel_values"]) for t in listed)
    rows = await tenant_rows(instance, thread)
    assert rows[mine], f"tenant {mine} has no rows of its own"
    assert not any(theirs.encode() in value for value in rows[mine]), "a row holds theirs"


async def test_two_tenants_one_thread_id_in_sequence(instance: Instance) -> None:
    thread = unique("chat")
    acme, globex = unique("acme"), unique("globex")
    graph = chat_graph(instance)
    first = await instance.ainvoke(graph, {"secret": acme}, thread_config(thread), tenant_id=acme)
    assert first == {"secret": acme, "log": [f"answer:{acme}"]}
    # globex's chat-1 is another thread: it starts empty, never from acme's checkpoint.
    second = await instance.ainvoke(
        graph, {"secret": globex}, thread_config(thread), tenant_id=globex
    )
    assert second == {"secret": globex, "log": [f"answer:{globex}"]}

    await assert_only_own(instance, graph, thread, acme, globex)
    await assert_only_own(instance, graph, thread, globex, acme)
    assert set(await tenant_rows(instance, thread)) == {acme, globex}
    # With no tenant given (plain LangGraph use) the read is of the default tenant's thread.
    assert DEFAULT_TENANT == "default"
    assert (await graph.aget_state(thread_config(thread))).values == {}
    untenanted = [t async for t in instance.checkpointer.alist(None)]
    assert all("tenant_id" not in t.config["configurable"] for t in untenanted)
    assert all(t.config["configurable"]["thread_id"] != thread for t in untenanted)


async def test_two_tenants_one_thread_id_at_the_same_time(instance: Instance) -> None:
    thread = unique("chat")
    acme, globex = unique("acme"), unique("globex")
    inside = {acme: asyncio.Event(), globex: asyncio.Event()}

    async def meet(state: Chat) -> None:
        # Each run waits inside its step until the other is inside its own: both runs hold
        # their leases and write the same thread id at the same time.
        mine = state["secret"]
        other = globex if mine == acme else acme
        inside[mine].set()
        await asyncio.wait_for(inside[other].wait(), 10)

    graph = chat_graph(instance, meet)
    results = await asyncio.gather(
        instance.ainvoke(graph, {"secret": acme}, thread_config(thread), tenant_id=acme),
        instance.ainvoke(graph, {"secret": globex}, thread_config(thread), tenant_id=globex),
    )
    assert results == [
        {"secret": acme, "log": [f"answer:{acme}"]},
        {"secret": globex, "log": [f"answer:{globex}"]},
    ]
    await assert_only_own(instance, graph, thread, acme, globex)
    await assert_only_own(instance, graph, thread, globex, acme)


async def chain(instance: Instance, tenant: str, thread: str) -> list[tuple[str, str | None]]:
    """``(checkpoint id, parent id)`` of every root checkpoint of the tenant's thread."""
    return [
        (
            t.config["configurable"]["checkpoint_id"],
            None if t.parent_config is None else t.parent_config["configurable"]["checkpoint_id"],
        )
        async for t in instance.checkpointer.alist(thread_config(thread, tenant))
        if t.config["configurable"]["checkpoint_ns"] == ""
    ]


async def test_a_second_execution_id_on_a_thread_is_refused_before_its_first_step(
    instance: Instance,
) -> None:
    thread = unique("order")
    acme = unique("acme")
    steps: list[str] = []

    async def count(state: Chat) -> None:
        steps.append(state["secret"])

    graph = chat_graph(instance, count)
    await instance.ainvoke(
        graph, {"secret": "e1"}, thread_config(thread), tenant_id=acme, execution_id="e1"
    )
    chain_before = await chain(instance, acme, thread)
    with pytest.raises(ExecutionThreadBoundError) as refused:
        await instance.ainvoke(
            graph, {"secret": "e2"}, thread_config(thread), tenant_id=acme, execution_id="e2"
        )
    # Refused before anything ran: no step, no lease, no record, no checkpoint; no fork.
    assert isinstance(refused.value, ValueError)
    assert refused.value.bound_execution_id == "e1"
    assert "'e1'" in str(refused.value)
    assert "execution_id='e1'" in str(refused.value)
    assert steps == ["e1"]
    assert await instance.repository.get(LeaseKey(acme, "e2")) is None
    assert await instance.records.get(LeaseKey(acme, "e2")) is None
    assert await chain(instance, acme, thread) == chain_before
    parents = [parent for _, parent in chain_before]
    assert len(chain_before) > 1, chain_before
    assert len(parents) == len(set(parents)), chain_before
    state = await graph.aget_state(thread_config(thread, acme))
    assert state.values["log"] == ["answer:e1"]
    # The bound execution itself goes on; another tenant's same thread id is its own thread,
    # bound to nothing of acme's: its e2 runs, and it never hears of e1.
    await instance.ainvoke(
        graph, {"secret": "e1 again"}, thread_config(thread), tenant_id=acme, execution_id="e1"
    )
    globex = unique("globex")
    out = await instance.ainvoke(
        graph, {"secret": "g"}, thread_config(thread), tenant_id=globex, execution_id="e2"
    )
    assert out == {"secret": "g", "log": ["answer:g"]}


async def test_two_first_runs_racing_with_two_execution_ids_one_wins(
    instance: Instance,
) -> None:
    thread, acme = unique("order"), unique("acme")
    graph = chat_graph(instance)
    outcomes = await asyncio.gather(
        *(
            instance.ainvoke(
                graph, {"secret": e}, thread_config(thread), tenant_id=acme, execution_id=e
            )
            for e in ("e1", "e2")
        ),
        return_exceptions=True,
    )
    refused = [o for o in outcomes if isinstance(o, ExecutionThreadBoundError)]
    ran = [o for o in outcomes if isinstance(o, dict)]
    assert len(refused) == 1, outcomes
    assert len(ran) == 1, outcomes
    winner = ran[0]["secret"]
    assert refused[0].bound_execution_id == winner
    state = await graph.aget_state(thread_config(thread, acme))
    assert state.values["log"] == [f"answer:{winner}"]


# -- hypothesis: random tenants, thread ids and execution ids

_ID = st.one_of(
    st.sampled_from(["chat-1", "a:b", "50%", "%3A", "é", "租户", "🙂", "a b", "x"]),
    st.text(
        alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"),
        min_size=1,
        max_size=6,
    ),
)
_RUNS = st.lists(
    st.tuples(st.sampled_from(["t1", "t2", "t3"]), _ID, st.sampled_from(["x1", "x2"])),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(tenants=st.lists(_ID, min_size=3, max_size=3, unique=True), threads=_ID, runs=_RUNS)
async def test_no_read_or_write_crosses_a_tenant_or_execution_key(
    instance: Instance, tenants: list[str], threads: str, runs: list[tuple[str, str, str]]
) -> None:
    """Runs of random tenants on random thread ids under random execution ids: each run
    lands in its own tenant's thread or is refused (thread bound to another execution id),
    and every read of a tenant's thread shows exactly that tenant's runs."""
    salt = uuid.uuid4().hex[:6]  # the database outlives examples: keys of this one only
    names = {f"t{i + 1}": f"{salt}{tenant}" for i, tenant in enumerate(tenants)}
    graph = chat_graph(instance)
    bound: dict[tuple[str, str], str] = {}
    model: dict[tuple[str, str], list[str]] = {}
    for i, (tenant_name, thread_part, execution_part) in enumerate(runs):
        tenant = names[tenant_name]
        thread = f"{threads}{thread_part}"
        execution_id = f"{salt}{execution_part}{thread_part}"
        value = f"v{i}@{tenant_name}"
        expected = bound.setdefault((tenant, thread), execution_id)
        run = instance.ainvoke(
            graph,
            {"secret": value},
            thread_config(thread),
            tenant_id=tenant,
            execution_id=execution_id,
        )
        if expected != execution_id:
            with pytest.raises(ExecutionThreadBoundError) as refused:
                await run
            assert refused.value.bound_execution_id == expected
            continue
        await run
        model.setdefault((tenant, thread), []).append(f"answer:{value}")
    every_thread = {thread for _, thread in model} | {thread for _, thread in bound}
    for tenant in names.values():
        for thread in every_thread:
            config = thread_config(thread, tenant)
            state = await graph.aget_state(config)
            assert state.values.get("log", []) == model.get((tenant, thread), [])
            for logs in await history(graph, config):
                assert set(logs) <= set(model.get((tenant, thread), []))
            async for item in instance.checkpointer.alist(config):
                assert item.config["configurable"]["tenant_id"] == tenant
                assert item.config["configurable"]["thread_id"] == thread
        listed = [t async for t in instance.checkpointer.alist(thread_config_none(tenant))]
        assert {t.config["configurable"]["thread_id"] for t in listed} == {
            thread for (owner, thread) in model if owner == tenant
        }


def thread_config_none(tenant: str) -> RunnableConfig:
    """A config naming only the tenant: ``alist`` over all of that tenant's threads."""
    return {"configurable": {"tenant_id": tenant}}


# -- the migration of rows written before tenants


@pytest.fixture(params=SQL_BACKENDS)
async def fresh_engine(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[AsyncEngine]:
    """An engine on a database no test has migrated: a new SQLite file, a new PG schema."""
    if request.param == "sqlite":
        engine = make_engine("sqlite")
    else:
        url, schema = request.getfixturevalue("own_schema")
        engine = create_engine(url, **pg_engine_options(schema))
    yield engine
    await engine.dispose()


async def test_rows_written_before_tenants_get_the_tenant_of_their_lease(
    fresh_engine: AsyncEngine,
) -> None:
    engine = fresh_engine
    await migrate(engine, "leases", LEASE_MIGRATIONS)
    await migrate(engine, "checkpoints", CHECKPOINT_MIGRATIONS[:1])
    await migrate(engine, "executions", EXECUTION_MIGRATIONS[:1])
    leases = SqlLeaseRepository(engine)
    for key in (
        LeaseKey("acme", "leased"),  # a lease of the thread's default execution
        LeaseKey("globex", "job-9"),  # the execution of the recorded thread below
        LeaseKey("acme", "mixed"),  # two tenants wrote one chain: no owner can be told
        LeaseKey("globex", "mixed"),
    ):
        assert await leases.acquire(key, "old-worker", 10.0) is not None
    records = SqlExecutionRecords(engine)
    type_, blob = JsonPlusSerializer().dumps_typed(generate_checkpoint())
    async with transaction(engine) as conn:
        # A record as version 1 wrote it (no run config).
        input_type, input_blob = records.serde.dumps_typed({})
        await conn.execute(
            text(
                "INSERT INTO fence_executions (tenant_id, execution_id, graph, thread_id, "
                "input_type, input, recorded_at) VALUES ('globex', 'job-9', 'g', 'recorded', "
                ":t, :b, 1.0)"
            ),
            {"t": input_type, "b": input_blob},
        )
        for thread in ("leased", "recorded", "orphan", "mixed"):
            await conn.execute(
                text(
                    "INSERT INTO fence_checkpoints (thread_id, checkpoint_ns, checkpoint_id,"
                    " type, checkpoint, channel_versions, metadata)"
                    " VALUES (:t, '', 'c1', :type, :blob, '{}', '{}')"
                ),
                {"t": thread, "type": type_, "blob": blob},
            )
            await conn.execute(
                text(
                    "INSERT INTO fence_checkpoint_blobs (thread_id, channel, version, type, blob)"
                    " VALUES (:t, 'ch', '1', 'empty', NULL)"
                ),
                {"t": thread},
            )
            await conn.execute(
                text(
                    "INSERT INTO fence_checkpoint_writes (thread_id, checkpoint_id, task_id, idx,"
                    " channel, type, blob) VALUES (:t, 'c1', 'task', 0, 'ch', :type, :blob)"
                ),
                {"t": thread, "type": type_, "blob": blob},
            )

    saver = SqlCheckpointer(engine)
    await saver.setup()
    await records.setup()

    # Version 2 gives each thread its lease's tenant, or '' (the old default); version 3
    # moves '' to the one default tenant, except a thread two tenants' leases name.
    owners = {"leased": "acme", "recorded": "globex", "orphan": "default", "mixed": ""}
    async with engine.connect() as conn:
        for table in TABLES:
            found = dict(
                (await conn.execute(text(f"SELECT thread_id, tenant_id FROM {table}"))).all()
            )
            assert found == owners, table
    for thread, tenant in owners.items():
        assert await saver.aget_tuple(thread_config(thread, tenant)) is not None
        other = "globex" if tenant == "acme" else "acme"
        assert await saver.aget_tuple(thread_config(thread, other)) is None
    # The recorded thread is bound to the execution that recorded it.
    assert await records.bind(LeaseKey("globex", "another"), "recorded") == "job-9"
    # Read back after the run-config columns came (version 3): a takeover runs it with none.
    old = await records.get(LeaseKey("globex", "job-9"))
    assert old is not None
    assert old.run == RecordedRun()
    assert old.input == {}


@given(
    tenant=st.one_of(st.just(DEFAULT_TENANT), _ID),
    thread=st.one_of(_ID, st.builds("lgf-tenant:{}".format, _ID)),
)
def test_a_saver_without_tenants_keeps_each_pair_under_an_id_of_its_own(
    tenant: str, thread: str
) -> None:
    """The ids FencedCheckpointer gives a tenant's thread in a saver that knows no tenants
    decode back to the pair (so no two pairs share one); the default tenant's ids are kept
    as they are unless they look like such an id."""
    inner = inner_thread_id(tenant, thread)
    assert outer_thread_id(inner) == (tenant, thread)
    if tenant == DEFAULT_TENANT and not thread.startswith("lgf-tenant:"):
        assert inner == thread


async def test_a_tenant_id_that_is_not_text_is_refused_by_name(instance: Instance) -> None:
    thread, acme = unique("chat"), unique("acme")
    bad: Any = {"configurable": {"thread_id": thread, "tenant_id": 42}}
    with pytest.raises(ValueError, match=r'\["tenant_id"\] must be a str'):
        await instance.checkpointer.aget_tuple(bad)
    # A run is of one tenant: a config naming another is refused before anything runs.
    with pytest.raises(ValueError, match=f"tenant_id is '{acme}'"):
        await instance.ainvoke(
            chat_graph(instance), {"secret": "s"}, thread_config(thread, "other"), tenant_id=acme
        )
    assert await instance.repository.get(LeaseKey(acme, thread)) is None


async def test_deleting_a_tenants_thread_leaves_the_other_tenants_alone(
    instance: Instance,
) -> None:
    thread = unique("chat")
    acme, globex = unique("acme"), unique("globex")
    graph = chat_graph(instance)
    for tenant in (acme, globex):
        await instance.ainvoke(graph, {"secret": tenant}, thread_config(thread), tenant_id=tenant)
    await instance.checkpointer.adelete_thread(thread)  # the default tenant's: nothing here
    await instance.checkpointer.adelete_thread(thread, tenant_id=acme)
    assert (await graph.aget_state(thread_config(thread, acme))).values == {}
    assert (await graph.aget_state(thread_config(thread, globex))).values["secret"] == globex


@pytest.fixture(params=SQL_BACKENDS)
async def sql_saver(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine]
) -> AsyncIterator[SqlCheckpointer]:
    saver = SqlCheckpointer(make_engine(request.param))
    await saver.setup()
    yield saver
    await saver.engine.dispose()


async def test_copy_prune_and_delete_for_runs_stay_within_one_tenant(
    sql_saver: SqlCheckpointer,
) -> None:
    thread, copy = unique("chat"), unique("copy")
    acme, globex = unique("acme"), unique("globex")
    run_ids = {}
    for tenant in (acme, globex):
        run_ids[tenant] = str(uuid.uuid4())
        config: Any = {"configurable": {**thread_config(thread, tenant)["configurable"]}}
        config["configurable"]["checkpoint_ns"] = ""
        for _ in range(2):
            metadata: Any = {"run_id": run_ids[tenant], "source": "loop", "step": 0}
            config = await sql_saver.aput(config, generate_checkpoint(), metadata, {})

    async def ids(tenant: str, thread_id: str) -> list[str]:
        return [
            t.config["configurable"]["checkpoint_id"]
            async for t in sql_saver.alist(thread_config(thread_id, tenant))
        ]

    globex_before = await ids(globex, thread)
    await sql_saver.acopy_thread(thread, copy, tenant_id=acme)
    assert await ids(acme, copy) == await ids(acme, thread)
    assert await ids(globex, copy) == []
    await sql_saver.aprune([thread], tenant_id=acme)
    assert len(await ids(acme, thread)) == 1
    assert await ids(globex, thread) == globex_before
    await sql_saver.adelete_for_runs([run_ids[globex]], tenant_id=acme)  # not acme's run
    assert await ids(globex, thread) == globex_before
    await sql_saver.adelete_for_runs([run_ids[globex]], tenant_id=globex)
    assert await ids(globex, thread) == []
    assert len(await ids(acme, thread)) == 1
