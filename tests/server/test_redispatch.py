"""langgraph issue #7417 on the real Agent Server: the server starts attempt 2 of a run while
attempt 1 is still inside a long step.

Through the real server: ``langgraph dev`` with two job slots; a route of the test's own
(``langgraph.json`` ``http.app``) does what the server's heartbeat sweep does to a run whose
worker went quiet, ``Runs.set_status(run_id, "pending")``, and the server's queue starts the
run's next attempt while the first still runs. Attempt 1 waits inside its step on a gate file
the test opens once attempt 2 has ended; each attempt leaves a file when it enters the step,
and the non-idempotent step appends to a ledger before it waits (the side effect).
"""

from __future__ import annotations

import asyncio
import json
import sys
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

import httpx
import pytest
from langgraph_sdk import get_client

from tests.support.agent_server import agent_server, rows
from tests.support.polling import eventually
from tests.support.write_steps import Database

pytestmark = pytest.mark.processes

CLI = str(Path(sys.executable).with_name("langgraph-fence"))

ROUTES = """
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route


async def redispatch(request):
    # What the server's sweep does to a run whose worker stopped answering.
    from langgraph_runtime_inmem.database import connect
    from langgraph_runtime_inmem.ops import Runs

    async with connect() as conn:
        await Runs.set_status(conn, request.path_params["run_id"], "pending")
    return JSONResponse({"redispatched": request.path_params["run_id"]})


app = Starlette(routes=[Route("/test/redispatch/{run_id}", redispatch, methods=["POST"])])
"""

AGENT = """
import asyncio
from pathlib import Path
from typing import TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.graph import END, START, StateGraph

from langgraph_fence import Effect, fence_graph, fenced


class State(TypedDict, total=False):
    folder: str
    by: int


async def _step(state: State, config: RunnableConfig, *, effect: bool) -> dict:
    folder = Path(state["folder"])
    attempt = config["metadata"]["run_attempt"]
    (folder / f"entered-{attempt}").touch()
    if effect:
        with (folder / "ledger").open("a") as ledger:
            ledger.write(f"charged by attempt {attempt}\\n")
    if attempt == 1:
        while not (folder / "gate").exists():  # attempt 1: a long call
            await asyncio.sleep(0.05)
    return {"by": attempt}


async def slow(state: State, config: RunnableConfig) -> dict:
    return await _step(state, config, effect=False)


@fenced(effect=Effect.NON_IDEMPOTENT_WRITE)
async def charge(state: State, config: RunnableConfig) -> dict:
    return await _step(state, config, effect=True)


def _graph(name, node):
    builder = StateGraph(State)
    builder.add_node(name, node)
    builder.add_edge(START, name)
    builder.add_edge(name, END)
    return fence_graph(builder).compile()


idempotent = _graph("slow", slow)
payment = _graph("charge", charge)
"""


async def _attempt_two_while_one_runs(
    server: str, graph: str, folder: Path
) -> tuple[Any, str, str]:
    """Start a run of ``graph``, wait until attempt 1 is inside its step, have the server
    start attempt 2, and wait for the run to end: (client, thread id, run id)."""
    client = get_client(url=server)
    thread = (await client.threads.create())["thread_id"]
    run = await client.runs.create(thread, graph, input={"folder": str(folder)})
    await eventually(lambda: (folder / "entered-1").exists(), what="attempt 1 in its step")
    async with httpx.AsyncClient() as http:
        answer = await http.post(f"{server}/test/redispatch/{run['run_id']}")
        answer.raise_for_status()
    await client.runs.join(thread, run["run_id"])
    return client, thread, run["run_id"]


@pytest.fixture
def server(database: Database, tmp_path: Path) -> Any:
    graphs = {"idempotent": "./agent.py:idempotent", "payment": "./agent.py:payment"}
    with agent_server(
        database,
        tmp_path,
        {"agent.py": AGENT, "routes.py": ROUTES},
        graphs,
        config={"http": {"app": "./routes.py:app"}},
        args=("--n-jobs-per-worker", "2"),
    ) as (url, log):
        yield url, log


async def test_attempt_two_stands_and_attempt_one_writes_nothing_after_it(
    server: tuple[str, Path], database: Database, tmp_path: Path
) -> None:
    url, log = server
    folder = tmp_path / "work"
    folder.mkdir()
    client, thread, run_id = await _attempt_two_while_one_runs(url, "idempotent", folder)

    # Attempt 2 ran the step and ended the run: its result stands.
    assert (folder / "entered-2").exists()
    assert (await client.runs.get(thread, run_id))["status"] == "success"
    assert (await client.threads.get_state(thread))["values"]["by"] == 2
    before = rows(
        database,
        "SELECT checkpoint_id, parent_checkpoint_id, fence_token FROM fence_checkpoints "
        "WHERE thread_id = :t ORDER BY checkpoint_id",
        t=thread,
    )
    # Attempt 1 finishes its step now, and writes: refused (its token was fenced).
    (folder / "gate").touch()
    await eventually(
        lambda: "ServerAttemptSuperseded" in log.read_text(),
        what="attempt 1 to end as superseded",
    )
    after = rows(
        database,
        "SELECT checkpoint_id, parent_checkpoint_id, fence_token FROM fence_checkpoints "
        "WHERE thread_id = :t ORDER BY checkpoint_id",
        t=thread,
    )
    assert after == before  # nothing of attempt 1 landed
    assert (await client.runs.get(thread, run_id))["status"] == "success"  # not overwritten
    assert (await client.threads.get_state(thread))["values"]["by"] == 2
    # No fork: one chain of checkpoints, each the child of the one before.
    assert [parent for _, parent, _ in after[1:]] == [cid for cid, _, _ in after[:-1]]
    # Attempt 1 wrote its first checkpoint under token 1; attempt 2, which took the thread
    # over from it, everything after under token 2.
    assert {token for _, _, token in after} <= {1, 2}
    assert after[-1][2] == 2
    assert "ExecutionSupersededError" not in log.read_text()  # attempt 1 had started


async def test_a_charge_attempt_one_began_is_never_made_again_by_attempt_two(
    server: tuple[str, Path], database: Database, tmp_path: Path
) -> None:
    url, log = server
    folder = tmp_path / "work"
    folder.mkdir()
    client, thread, run_id = await _attempt_two_while_one_runs(url, "payment", folder)

    # Attempt 2 found attempt 1's stamp standing: it ends with the dead letter, naming the
    # node and the token, and never enters the step.
    run = await client.runs.get(thread, run_id)
    assert run["status"] == "error"
    assert not (folder / "entered-2").exists()
    assert (folder / "ledger").read_text() == "charged by attempt 1\n"
    leases = rows(
        database, "SELECT status, reason FROM fence_leases WHERE execution_id = :t", t=thread
    )
    assert len(leases) == 1
    status, reason = leases[0]
    assert status == "dead_lettered"
    assert "node 'charge' at token 1" in reason
    # Attempt 1 then ends its call: its writes are refused, the ledger holds one charge.
    (folder / "gate").touch()
    await eventually(
        lambda: "ServerAttemptSuperseded" in log.read_text(),
        what="attempt 1 to end as superseded",
    )
    assert (folder / "ledger").read_text() == "charged by attempt 1\n"
    assert rows(database, "SELECT status FROM fence_leases WHERE execution_id = :t", t=thread) == [
        ("dead_lettered",)
    ]
    # The operator's list shows it, with the reason, for `langgraph-fence resolve`.
    schema = ["--schema", database.schema] if database.schema else []
    cli = await asyncio.create_subprocess_exec(
        CLI, "dead-letters", "--db", database.url, "--json", *schema, stdout=PIPE
    )
    out, _ = await asyncio.wait_for(cli.communicate(), 60)
    assert cli.returncode == 0
    listed = json.loads(out)
    mine = [entry for entry in listed if entry["execution_id"] == thread]
    assert len(mine) == 1
    assert "node 'charge' at token 1" in mine[0]["reason"]
