"""A SQL store and the pure reference model, driven by the same random steps, never differ.

Hypothesis picks acquire / renew / release / mark / clear / dead-letter / clock-advance steps
over a few keys and holders; each step runs on the real store (a SQLite file, PostgreSQL) and
on :class:`MemoryLeaseRepository` (the ``decide_*`` transitions over a dict) and must give
the same lease (all fields but ``store_id``) or the same error. State machines are sync: each
machine owns a private event loop, and its engine is created and disposed in that loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy.ext.asyncio import AsyncEngine

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    Lease,
    LeaseKey,
    LeaseStatus,
    MemoryLeaseRepository,
    PendingEffect,
    SqlLeaseRepository,
)
from langgraph_fence.database import create_engine
from langgraph_fence.testing import ManualClock
from tests.support.databases import SQL_BACKENDS, pg_engine_options

T = TypeVar("T")
Outcome = tuple[Any, ...]

HOLDERS = st.sampled_from(["A", "B", "C"])
KEYS = st.integers(min_value=0, max_value=2)  # index into the machine's three keys
TTLS = st.sampled_from([1.0, 10.0, 10.0, 0])  # 0 is refused
STEPS = st.sampled_from([0.0, 0.5, 1.0, 9.0, 10.0])
STATUSES = st.sampled_from([*LeaseStatus, "bogus"])
REASONS = st.sampled_from([None, "why", "quote: \x00 \ud800", ""])
EFFECTS = st.sampled_from(list(Effect))
TASKS = st.sampled_from(["task-1", "task-2", "task-3"])
EPOCHS = st.one_of(st.none(), st.integers(min_value=0, max_value=6))
# The thread's latest checkpoint as a taker saw it; "" and 0 are refused.
MARKS = st.sampled_from([None, None, "c1", "c1", "c2", ""])
BUDGETS = st.sampled_from([None, 1, 1, 2, 0, True])


def outcome(result: Any) -> Outcome:
    """A result or an error, as comparable across stores."""
    if isinstance(result, ExecutionFencedError):
        return ("fenced", result.scope_key, result.token_held, result.token_seen, str(result))
    if isinstance(result, BaseException):
        return ("error", type(result))
    if isinstance(result, Lease):
        return ("lease", replace(result, store_id=""))
    if result is None:
        return ("none",)
    if isinstance(result, list | tuple):
        return ("leases", [replace(lease, store_id="") for lease in result])
    raise AssertionError(f"unexpected result {result!r}")


class LeaseMachine(RuleBasedStateMachine):
    """One SQL store and the memory model on one clock, in a loop of the machine's own."""

    leases = Bundle("leases")

    def __init__(self, make_engine: Callable[[], AsyncEngine]) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.clock = ManualClock()
        self.model = MemoryLeaseRepository(clock=self.clock)
        self.engine = self.run(self._engine(make_engine))
        self.store = SqlLeaseRepository(self.engine, clock=self.clock)
        self.run(self.store.setup())
        prefix = uuid.uuid4().hex[:8]  # the database outlives the machine: keys of its own
        # Two executions of one tenant, and the same execution id under another tenant.
        self.keys = [LeaseKey(f"{prefix}-t{i // 2}", f"e:{i % 2}") for i in range(3)]

    @staticmethod
    async def _engine(make_engine: Callable[[], AsyncEngine]) -> AsyncEngine:
        return make_engine()

    def run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]

    def both(
        self,
        call: Callable[[Any, Any], Awaitable[Any]],
        model_arg: Any = None,
        store_arg: Any = None,
    ) -> tuple[Any, Any]:
        """``call`` on the model then the store; the results (or errors) must agree."""

        async def one(repo: Any, arg: Any) -> Any:
            try:
                return await call(repo, arg)
            except (ValueError, KeyError, ExecutionFencedError) as exc:
                return exc

        expected = self.run(one(self.model, model_arg))
        got = self.run(one(self.store, store_arg))
        assert outcome(got) == outcome(expected), f"store {got!r} != model {expected!r}"
        return expected, got

    def teardown(self) -> None:
        try:
            self.run(self.engine.dispose())
        finally:
            self.loop.close()

    # -- steps

    @initialize()
    def start_clean(self) -> None:
        for key in self.keys:
            assert self.run(self.store.get(key)) is None

    @rule(target=leases, key=KEYS, holder=HOLDERS, ttl=TTLS, reopen=st.booleans())
    def acquire(self, key: int, holder: str, ttl: float, reopen: bool) -> Any:
        expected, got = self.both(
            lambda repo, _: repo.acquire(self.keys[key], holder, ttl, reopen=reopen)
        )
        if isinstance(expected, Lease):
            return multiple((expected, got))
        return multiple()

    @rule(target=leases, pair=leases, holder=HOLDERS, ttl=TTLS, reopen=st.booleans())
    def acquire_again(
        self, pair: tuple[Lease, Lease], holder: str, ttl: float, reopen: bool
    ) -> Any:
        # Most of what matters happens on a key that was taken before.
        return self.acquire(self.keys.index(pair[0].key), holder, ttl, reopen)

    @rule(pair=leases, ttl=TTLS)
    def renew(self, pair: tuple[Lease, Lease], ttl: float) -> None:
        self.both(lambda repo, lease: repo.renew(lease, ttl), *pair)

    @rule(pair=leases)
    def yield_lease(self, pair: tuple[Lease, Lease]) -> None:
        self.both(lambda repo, lease: repo.yield_lease(lease), *pair)

    @rule(target=leases, pair=leases, ttl=TTLS)
    def retake(self, pair: tuple[Lease, Lease], ttl: float) -> Any:
        expected, got = self.both(lambda repo, lease: repo.retake(lease, ttl), *pair)
        if isinstance(expected, Lease):
            return multiple((expected, got))
        return multiple()

    @rule(pair=leases, status=STATUSES, reason=REASONS)
    def release(self, pair: tuple[Lease, Lease], status: Any, reason: str | None) -> None:
        self.both(lambda repo, lease: repo.release(lease, status, reason), *pair)

    @rule(
        pair=leases,
        effect=EFFECTS,
        ttl=TTLS,
        node=st.sampled_from(["charge"] * 4 + ["", "n\x00"]),
        task=TASKS,
    )
    def mark(
        self, pair: tuple[Lease, Lease], effect: Effect, ttl: float, node: str, task: str
    ) -> None:
        stamp = PendingEffect(effect, node, task, pair[0].epoch)
        self.both(lambda repo, lease: repo.mark_pending_effect(lease, stamp, ttl), *pair)

    @rule(pair=leases, tasks=st.sets(TASKS) | st.none())
    def clear(self, pair: tuple[Lease, Lease], tasks: set[str] | None) -> None:
        self.both(lambda repo, lease: repo.clear_pending_effects(lease, tasks), *pair)

    @rule(
        target=leases,
        pair=leases,
        holder=HOLDERS,
        ttl=TTLS,
        mark=MARKS,
        max_takeovers=BUDGETS,
    )
    def take_over(
        self,
        pair: tuple[Lease, Lease],
        holder: str,
        ttl: float,
        mark: str | None,
        max_takeovers: int | None,
    ) -> Any:
        # The take and its verdict on the stamp set and the takeover budget in one
        # statement: the SQL stores must decide (and word the dead letter) as the model does.
        expected, got = self.both(
            lambda repo, lease: repo.take_over(
                lease, holder, ttl, progress_mark=mark, max_takeovers=max_takeovers
            ),
            *pair,
        )
        if isinstance(expected, Lease):
            return multiple((expected, got))
        return multiple()

    @rule(key=KEYS)
    def retry(self, key: int) -> None:
        self.both(lambda repo, _: repo.retry(self.keys[key]))

    @rule(key=KEYS, reason=st.sampled_from(["checked", " padded ", "", "  ", "nul \x00"]))
    def abandon(self, key: int, reason: str) -> None:
        self.both(lambda repo, _: repo.abandon(self.keys[key], reason))

    @rule(key=KEYS, reason=REASONS, epoch=EPOCHS)
    def dead_letter(self, key: int, reason: str | None, epoch: int | None) -> None:
        self.both(lambda repo, _: repo.dead_letter(self.keys[key], reason, epoch=epoch))

    @rule(seconds=STEPS)
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(key=KEYS)
    def advance_to_expiry(self, key: int) -> None:
        # Boundaries are where stores differ: land the clock exactly on a hold's end.
        current = self.run(self.model.get(self.keys[key]))
        if current is not None and current.expires_at is not None:
            self.clock.advance(max(0.0, current.expires_at - self.clock()))

    @rule(limit=st.sampled_from([1, 3, 10_000, 0]))
    def takeover_candidates(self, limit: int) -> None:
        mine = set(self.keys)

        async def candidates(repo: Any, _: Any) -> list[Lease]:
            # Other machines' keys share the database: compare ours, in their order.
            if limit == 0:
                await repo.takeover_candidates(limit=0)  # refused alike
            found = await repo.takeover_candidates(limit=10_000)
            return [lease for lease in found if lease.key in mine]

        self.both(candidates)

    @invariant()
    def same_rows(self) -> None:
        for key in self.keys:
            expected = self.run(self.model.get(key))
            got = self.run(self.store.get(key))
            assert outcome(got) == outcome(expected)


@pytest.mark.parametrize("backend", SQL_BACKENDS)
def test_sql_store_matches_the_model(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    if backend == "sqlite":
        url, options = f"sqlite+aiosqlite:///{tmp_path / 'machine.db'}", {}
    else:
        url, schema = request.getfixturevalue("pg_schema")
        options = pg_engine_options(schema)

    def make_engine() -> AsyncEngine:
        return create_engine(url, **options)

    run_state_machine_as_test(
        lambda: LeaseMachine(make_engine),
        settings=settings(
            max_examples=20,
            stateful_step_count=35,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
