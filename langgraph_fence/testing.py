"""Test your own fenced graphs the way langgraph-fence tests itself (a pytest plugin).

Installed as a ``pytest11`` entry point, so with langgraph-fence installed every test can
ask for the ``leases`` fixture:

* ``leases.instance(name)`` builds an :class:`~langgraph_fence.Instance` on a real store
  (a SQLite file of the test's own) with a controlled clock;
* ``leases.stall(instance)`` freezes that instance as a GC pause or SIGSTOP would (its renew
  timers stop and its lease-store calls block), ``leases.resume(instance)`` thaws it;
* ``leases.advance(seconds)`` moves the clock (expiry is judged by it);
* ``await leases.take_over(key)`` takes an expired lease from outside, deciding a standing
  stamp as ``serve()`` would (a ``NON_IDEMPOTENT_WRITE`` entry dead-letters it).

:func:`run_node` runs one node function (a plain one, as ``fence_graph`` users write them,
or one decorated with ``@fenced``) with a held lease (or a lost one, or a given token) so a
node can be tested without a graph.

The fixture works whatever the project's pytest-asyncio mode (``strict``, its default, or
``auto``): it is declared with ``pytest_asyncio.fixture``. Outside pytest (a notebook, a
script), ``async with open_leases(url) as leases:`` gives the same tools on any database;
this module then needs no pytest installed (only the ``leases`` fixture is left out).
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from langgraph_fence._compat import CONFIG_KEY_TASK_ID
from langgraph_fence.effects import EFFECT_ATTRIBUTE, EffectLike, as_effect
from langgraph_fence.fence import RunHandle
from langgraph_fence.keys import FENCE_CONFIG_KEY
from langgraph_fence.lease import Lease, LeaseKey
from langgraph_fence.lease.faults import StallableRepository, StallGate
from langgraph_fence.lease.timeline import OnFailover
from langgraph_fence.lease.transitions import DEFAULT_MAX_TAKEOVERS, fenced_error

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    from langgraph_fence.instance import Instance

__all__ = ["Leases", "ManualClock", "open_leases", "run_node"]


class ManualClock:
    """A clock that moves only when told: pass it as a store's and an instance's clock.

    Calling it returns the current time in seconds; :meth:`advance` moves it forward and
    wakes every :meth:`sleep` whose time has come.
    """

    def __init__(self, start: float = 1_000_000.0) -> None:
        self._now = float(start)
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0 (clocks do not go back), got {seconds!r}")
        self._now += float(seconds)
        due = [(t, f) for t, f in self._sleepers if t <= self._now]
        self._sleepers = [(t, f) for t, f in self._sleepers if t > self._now]
        for _, future in due:
            if not future.done():
                future.get_loop().call_soon_threadsafe(_resolve, future)
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds``."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self._now + seconds, future))
        await future


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Leases:
    """A real lease store and checkpointer on a SQLite file, a controlled clock, and
    instances on them that a test can stall and resume. See the module docstring."""

    def __init__(
        self, engine: AsyncEngine, clock: ManualClock, *, on_failover: OnFailover | None = None
    ) -> None:
        from langgraph_fence.checkpointers import SqlCheckpointer
        from langgraph_fence.lease.records import SqlExecutionRecords
        from langgraph_fence.lease.sql import SqlLeaseRepository

        self.clock = clock
        self.engine = engine
        self.store = SqlLeaseRepository(engine, clock=clock, on_failover=on_failover)
        self.saver = SqlCheckpointer(engine)
        self.records = SqlExecutionRecords(engine)
        self._gates: dict[str, StallGate] = {}

    async def setup(self) -> None:
        """Create the tables (the fixture does this)."""
        await self.store.setup()
        await self.saver.setup()
        await self.records.setup()

    def instance(
        self,
        name: str,
        *,
        lease_ttl: float = 30.0,
        renew_interval: float | None = None,
        max_takeovers: int = DEFAULT_MAX_TAKEOVERS,
        max_held: int | None = None,
    ) -> Instance:
        """A new instance called ``name`` on the shared store, saver and clock (holding at
        most ``max_held`` executions at once, as :class:`~langgraph_fence.Instance` does)."""
        from langgraph_fence.instance import Instance

        if name in self._gates:
            raise ValueError(f"an instance called {name!r} exists already in this test")
        gate = StallGate()
        self._gates[name] = gate
        return Instance(
            StallableRepository(self.store, gate),
            self.saver,
            instance_id=name,
            lease_ttl=lease_ttl,
            renew_interval=renew_interval,
            clock=self.clock,
            sleep=gate.gated_sleep(self.clock.sleep),
            records=self.records,
            max_takeovers=max_takeovers,
            max_held=max_held,
        )

    def _gate(self, instance: Instance) -> StallGate:
        gate = self._gates.get(instance.instance_id)
        if gate is None:
            raise ValueError(
                f"instance {instance.instance_id!r} was not made by leases.instance(): only "
                "those can be stalled"
            )
        return gate

    def stall(self, instance: Instance) -> None:
        """Freeze ``instance``: its renew timers stop and its lease-store calls block."""
        self._gate(instance).stall()

    def resume(self, instance: Instance) -> None:
        """Thaw ``instance``: whatever it had pending goes on."""
        self._gate(instance).resume()

    def advance(self, seconds: float) -> float:
        """Move the clock forward (leases expire by it; timers wake by it)."""
        return self.clock.advance(seconds)

    async def take_over(self, key: LeaseKey, holder: str = "take-over") -> Lease:
        """Take the lease of ``key`` from outside (epoch + 1), as ``serve()`` would.

        It must be expired or handed back. The take decides a standing stamp in the same
        statement as ``serve()``'s: with a ``NON_IDEMPOTENT_WRITE`` entry standing, the
        lease returned is ``dead_lettered`` (status and reason set), never running.
        """
        current = await self.store.get(key)
        taken = None if current is None else await self.store.take_over(current, holder, 30.0)
        if taken is None:
            raise AssertionError(
                f"the lease of {key.scope_key!r} could not be taken over: it is {current}; "
                "advance the clock past its expiry first"
            )
        return taken


@asynccontextmanager
async def open_leases(
    url: str, *, on_failover: OnFailover | None = None, **engine_options: Any
) -> AsyncIterator[Leases]:
    """The ``leases`` fixture's tools on the database at ``url``, for the block.

    Creates the tables, and on exit thaws every stalled instance and closes the engine.

    Args:
        url: ``sqlite+aiosqlite:///path.db`` or ``postgresql+asyncpg://...`` (a
            multi-host URL for a replicated PostgreSQL).
        on_failover: what a failover of PostgreSQL does to the executions in flight
            (:class:`~langgraph_fence.SqlLeaseRepository`).
        **engine_options: passed to :func:`langgraph_fence.database.create_engine`.
    """
    from langgraph_fence.database import create_engine

    engine = create_engine(url, **engine_options)
    fixture = Leases(engine, ManualClock(), on_failover=on_failover)
    try:
        await fixture.setup()
        yield fixture
    finally:
        for gate in fixture._gates.values():
            gate.resume()
        await engine.dispose()


try:
    import pytest
except ImportError:  # a notebook or a script: open_leases and run_node need no pytest
    pass
else:
    try:  # pytest-asyncio's own decorator: the fixture then works in its strict mode too
        from pytest_asyncio import fixture as _async_fixture
    except ImportError:  # no pytest-asyncio: another async plugin (anyio) may serve it
        _async_fixture = pytest.fixture  # type: ignore[assignment]

    @_async_fixture
    async def leases(tmp_path: Path) -> AsyncIterator[Leases]:
        """Instances on a real store with a controlled clock that a test can stall and resume."""
        async with open_leases(f"sqlite+aiosqlite:///{tmp_path / 'leases.db'}") as fixture:
            yield fixture

    __all__ += ["leases"]


FenceOption = Literal["held", "lost"] | int


async def run_node(
    node: Callable[..., Any],
    state: Any,
    *,
    fence: FenceOption = "held",
    effect: EffectLike | None = None,
    config: Mapping[str, Any] | None = None,
    tenant_id: str = "test-tenant",
    thread_id: str | None = None,
    **kwargs: Any,
) -> Any:
    """Run one node function (sync or async) with a lease, without a graph; return its output.

    Args:
        node: the node function: a plain one (it runs as ``fence_graph`` would wrap it,
            with ``effect``) or one decorated with ``@fenced``.
        state: the state passed as its first argument.
        fence: ``"held"`` (token 1), ``"lost"`` (taken over: the fence refuses with
            ``ExecutionFencedError``), or an int: held at that token.
        effect: the effect of a plain ``node`` (default ``READ_ONLY``); a decorated one
            keeps its own, and a different ``effect`` for it is refused.
        config: extra run config merged into the node's config.
        tenant_id: the lease's tenant.
        thread_id: the thread (and execution) id; unique by default.
        **kwargs: extra keyword arguments for the node (``store``, ``writer``, ...).
    """
    from langchain_core.runnables.config import var_child_runnable_config

    from langgraph_fence.lease.memory import MemoryLeaseRepository

    declared = getattr(node, EFFECT_ATTRIBUTE, None)
    if declared is None:
        from langgraph_fence.steps.nodes import fenced

        node = fenced(effect=as_effect(effect if effect is not None else "read_only"))(node)
    elif effect is not None and as_effect(effect) is not declared:
        raise ValueError(
            f"effect={effect!r} but the node is decorated with @fenced(effect={declared}): "
            "declare it in one place"
        )
    if fence not in ("held", "lost") and (
        isinstance(fence, bool) or not isinstance(fence, int) or fence < 1
    ):
        raise ValueError(f"fence must be 'held', 'lost' or a token >= 1, got {fence!r}")
    clock = ManualClock()
    store = MemoryLeaseRepository(clock=clock)
    thread = thread_id or f"unit-{uuid.uuid4().hex[:8]}"
    key = LeaseKey(tenant_id, thread)
    token = fence if isinstance(fence, int) else 1
    lease: Lease | None = None
    for _ in range(token):
        clock.advance(60.0)  # each earlier holder's lease has expired
        lease = await store.acquire(key, "unit-runner", 30.0)
    assert lease is not None
    handle = RunHandle(store, lease, 30.0, clock=clock)
    if fence == "lost":
        clock.advance(60.0)
        newer = await store.acquire(key, "another-instance", 30.0)
        handle.record(fenced_error(lease, newer, action="run_node"))
    base = dict(config or {})
    configurable = {
        **dict(base.get("configurable") or {}),
        "thread_id": thread,
        "checkpoint_ns": "",
        CONFIG_KEY_TASK_ID: f"unit:{getattr(node, '__name__', 'node')}",
        FENCE_CONFIG_KEY: handle,
        "tenant_id": tenant_id,
        "execution_id": thread,
    }
    run_config: dict[str, Any] = {**base, "configurable": configurable}
    if "config" in inspect.signature(node).parameters:
        kwargs["config"] = run_config
    reset = var_child_runnable_config.set(run_config)  # type: ignore[arg-type]
    try:
        if inspect.iscoroutinefunction(node):
            return await node(state, **kwargs)
        # Sync nodes run in a worker thread, as LangGraph runs them (context copied).
        return await asyncio.to_thread(node, state, **kwargs)
    finally:
        var_child_runnable_config.reset(reset)
