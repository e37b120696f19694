"""One conformance suite for every saver this project ships or wraps.

``langgraph.checkpoint.conformance.validate`` runs the 58 base checks (put, put_writes,
get_tuple, list, delete_thread) and every extended capability (delete_for_runs, copy_thread,
prune) that the saver's class overrides: an override is a claim, and a claim must pass.

``server-*``: the saver as LangGraph's Agent Server holds it, its own adapter
(``_CustomCheckpointerAdapter``, langgraph-api) over the fenced SQL saver, as behind
``langgraph_fence.server.checkpointer``. The suite writes from outside any run, which the
factory's saver (an instance's) refuses by design; so the fenced saver here is the unbound
wrapper, the same code without the instance's admission.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import (
    BASE_CAPABILITIES,
    EXTENDED_CAPABILITIES,
    DetectedCapabilities,
)
from langgraph.checkpoint.memory import InMemorySaver
from sqlalchemy.ext.asyncio import AsyncEngine

from checkpointers import SqlCheckpointer
from langgraph_fence import FencedCheckpointer
from tests.support.server_adapter import server_adapter

SAVERS = [
    "sql-sqlite",
    "sql-postgresql",
    "fenced-memory",
    "fenced-sql-sqlite",
    "fenced-sql-postgresql",
    "server-fenced-sql-sqlite",
    "server-fenced-sql-postgresql",
]

#: The extended capabilities each saver claims, and must pass.
CLAIMS = {
    "sql-sqlite": EXTENDED_CAPABILITIES,
    "sql-postgresql": EXTENDED_CAPABILITIES,
    "fenced-memory": frozenset(),
    "fenced-sql-sqlite": EXTENDED_CAPABILITIES,
    "fenced-sql-postgresql": EXTENDED_CAPABILITIES,
    "server-fenced-sql-sqlite": EXTENDED_CAPABILITIES,
    "server-fenced-sql-postgresql": EXTENDED_CAPABILITIES,
}


@pytest.fixture(params=SAVERS)
def saver_factory(
    request: pytest.FixtureRequest, make_engine: Callable[[str], AsyncEngine]
) -> Callable[[], AsyncIterator[BaseCheckpointSaver[Any]]]:
    name: str = request.param

    async def factory() -> AsyncIterator[BaseCheckpointSaver[Any]]:
        if name == "fenced-memory":
            yield FencedCheckpointer(InMemorySaver())
            return
        saver = SqlCheckpointer(make_engine(name.rsplit("-", 1)[1]))
        await saver.setup()
        if name.startswith("server"):
            yield server_adapter(FencedCheckpointer(saver))
        else:
            yield FencedCheckpointer(saver) if name.startswith("fenced") else saver
        await saver.engine.dispose()

    factory.__name__ = name.replace("-", "_")
    return factory


async def test_conformance(
    request: pytest.FixtureRequest,
    saver_factory: Callable[[], AsyncIterator[BaseCheckpointSaver[Any]]],
) -> None:
    name = request.node.callspec.params["saver_factory"]
    registered = checkpointer_test(name=name)(saver_factory)
    report = await validate(registered)
    failures = {cap: result.failures for cap, result in report.results.items() if result.failures}
    assert report.passed_all_base(), failures
    claimed = {cap for cap, result in report.results.items() if result.detected} - {
        c.value for c in BASE_CAPABILITIES
    }
    assert claimed == {c.value for c in CLAIMS[name]}, claimed
    assert report.passed_all(), failures
    for cap in CLAIMS[name]:
        result = report.results[cap.value]
        assert result.passed, (cap, result)
        assert result.tests_passed > 0, (cap, result)


def test_wrapper_claims_only_what_its_inner_saver_implements(
    make_engine: Callable[[str], AsyncEngine],
) -> None:
    over_memory = FencedCheckpointer(InMemorySaver())
    assert DetectedCapabilities.from_instance(over_memory).detected == BASE_CAPABILITIES
    assert isinstance(over_memory, FencedCheckpointer)
    over_sql = FencedCheckpointer(SqlCheckpointer(make_engine("sqlite")))
    assert DetectedCapabilities.from_instance(over_sql).detected == (
        BASE_CAPABILITIES | EXTENDED_CAPABILITIES
    )
    assert type(over_sql) is not type(over_memory)
    assert type(FencedCheckpointer(InMemorySaver())) is type(over_memory), "classes are cached"
