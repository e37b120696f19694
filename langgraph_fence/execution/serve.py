"""The takeover loop: find expired or handed-back executions, take them over, resume them.

:class:`Server` is what :meth:`Instance.serve <langgraph_fence.Instance.serve>` runs. One look
at the store is :meth:`Server.poll_once` (tests call it directly, with no wall clock); the
loop (:meth:`Server.run`) repeats it, pausing on the server's injected ``sleep`` between
looks, backing off while the store cannot be read, until ``stop`` is set; then it drains
its runs at their next superstep boundary and hands them back ``pending``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, NamedTuple

from langchain_core.runnables import RunnableConfig
from langgraph.errors import GraphDrained

from langgraph_fence._compat import finished_tasks
from langgraph_fence.database.retry import is_connection_error
from langgraph_fence.events import EventKind
from langgraph_fence.execution.callbacks import (
    DEFAULT_CALLBACK_RETRY,
    Deliveries,
    RunEndCallback,
    check_callbacks,
)
from langgraph_fence.execution.keeper import Sleep
from langgraph_fence.execution.retries import RunRetry
from langgraph_fence.execution.run import DEFAULT_GRAPH_NAME, Run, announce_dead_letter, running
from langgraph_fence.execution.sleeps import ExecutionSleeping
from langgraph_fence.execution.streams import StreamRecorder
from langgraph_fence.lease import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.records import ExecutionHead, ExecutionRecord, SqlExecutionRecords
from langgraph_fence.lease.run_config import restore_run, run_allowlist
from langgraph_fence.lease.transitions import validate_max_takeovers
from langgraph_fence.queue import ANNOUNCE_EVERY, WorkerHold
from langgraph_fence.queue.notifications import ENDS_CHANNEL
from langgraph_fence.redact import failure_reason
from langgraph_fence.validate import positive_int, positive_seconds, text_id

if TYPE_CHECKING:
    from langgraph.checkpoint.base import CheckpointTuple

    from langgraph_fence.execution.host import InstanceHost
    from langgraph_fence.queue import Pinned, SubmittedRuns

__all__ = ["MAX_SERVE_BACKOFF", "Server", "check_budget", "progress_mark"]

logger = logging.getLogger("langgraph_fence.serve")

#: The longest pause serve() takes between looks while the store cannot be read.
MAX_SERVE_BACKOFF = 10.0

#: How often, at most, a busy loop sweeps (seconds): a look that a run's end woke takes
#: work at once, but fires schedules, promotes queued runs, admits flow keys' runs, wakes
#: yielded trees and delivers callbacks only if this long has passed since the last sweep
#: (or with its pause cut to what is left of it). A look the poll timer or a NOTIFY woke
#: always sweeps.
SWEEP_EVERY = 0.1


class Server:
    """One instance's takeover loop over ``graphs`` (see :meth:`Instance.serve`).

    Args:
        host: what the loop uses of the instance whose runs it starts.
        graphs: graph name -> graph compiled with the instance's checkpointer (checked).
        concurrency: how many executions the loop runs at once.
        poll_interval: seconds between looks at the store.
        max_takeovers: the takeover budget (checked).
        kwargs: passed to each ``graph.ainvoke``; a run's recorded options win.
        sleep: how the loop pauses between looks (default ``asyncio.sleep``).
        listen: on PostgreSQL, wake at once when an execution becomes runnable (a
            submit, a hand-back: LISTEN/NOTIFY); ``False``: poll only.
    """

    def __init__(
        self,
        host: InstanceHost,
        graphs: Mapping[str, Any],
        *,
        concurrency: int,
        poll_interval: float,
        max_takeovers: int,
        kwargs: Mapping[str, Any],
        sleep: Sleep | None = None,
        listen: bool = True,
        run_retries: Mapping[str, RunRetry] | None = None,
        callbacks: Mapping[str, RunEndCallback] | None = None,
        callback_retry: RunRetry | None = None,
    ) -> None:
        from langgraph_fence.saver.checkpoint import FencedCheckpointer

        if not isinstance(graphs, Mapping) or not graphs:
            raise ValueError("graphs must be a non-empty mapping of graph name -> graph")
        for name, graph in graphs.items():
            text_id("graphs' names", name, what="the graph name executions are recorded under")
            if not isinstance(getattr(graph, "checkpointer", None), FencedCheckpointer):
                raise ValueError(
                    f"graphs[{name!r}] was compiled without a fenced checkpointer: compile it "
                    "with builder.compile(checkpointer=instance.checkpointer)"
                )
            own = getattr(graph, "name", None)
            if own not in (name, DEFAULT_GRAPH_NAME):
                # Runs started with this graph and no graph_name are recorded under its own
                # name: this loop would never find them.
                logger.warning(
                    "graph %r is served as %r: runs started with it and no graph_name are "
                    "recorded as %r, which this loop does not serve; serve it as %r, or "
                    "start its runs with graph_name=%r",
                    own,
                    name,
                    own,
                    own,
                    name,
                )
        positive_int("concurrency", concurrency, what="how many executions serve() runs at once")
        self.poll = positive_seconds(
            "poll_interval", poll_interval, what="between looks at the store"
        )
        self.budget = check_budget(max_takeovers)
        self.host = host
        self.graphs = graphs
        self.concurrency = concurrency
        self.kwargs = kwargs
        self._sleep: Sleep = sleep or asyncio.sleep
        self.listen = listen
        self.run_retries = check_run_retries(run_retries, graphs)
        registered = check_callbacks(callbacks)
        if callback_retry is not None and not isinstance(callback_retry, RunRetry):
            raise ValueError(
                "callback_retry must be a RunRetry (attempts, backoff, ...), got "
                f"{callback_retry!r}"
            )
        queue = host.queue_or_none()
        if registered and queue is None:
            raise TypeError(
                "callbacks are of submitted runs, which need a SQL database: open the "
                "instance with Instance.open('sqlite+aiosqlite:///...' or "
                "'postgresql+asyncpg://...')"
            )
        #: The deliveries of completion callbacks (webhooks, and ``callbacks``).
        self.deliveries = (
            None
            if queue is None
            else Deliveries(
                queue,
                registered,
                callback_retry or DEFAULT_CALLBACK_RETRY,
                allow=self._output_allowlist,
            )
        )
        #: The runs this loop started, by the task that runs each.
        self.running: dict[asyncio.Task[None], list[Run]] = {}
        #: The ends of submitted runs being told to their waiters (NOTIFY), beside the
        #: slots the runs freed.
        self.telling: set[asyncio.Task[None]] = set()
        # Executions of graphs this loop does not serve, by key, with the epoch seen.
        self._unserved: dict[LeaseKey, int] = {}
        self.failures = 0  # looks in a row that the store refused: the loop backs off
        # The tenant this loop claimed for last: the next claims start after it (the store's
        # claim order, transitions.fair_order).
        self._claimed_for: str | None = None
        self._announced_at = -ANNOUNCE_EVERY  # monotonic; never yet
        self._swept_at = -SWEEP_EVERY  # monotonic; never yet
        # The takeover budget's last take runs alone: while such a run goes on, or while the
        # loop waits to be idle for one, it takes nothing else (:meth:`_last_chance`).
        self._alone: asyncio.Task[None] | None = None
        self._isolating = False

    async def poll_once(self, *, sweep: bool = True) -> float:
        """One look: forget the runs that ended, take work if a slot is free; returns the
        pause before the next look (``poll_interval``, longer while the store fails).

        Without ``sweep`` the look only takes work: it fires no schedule, promotes no
        queued run, admits no flow key's run, wakes no yielded tree and delivers no
        callback (a busy loop does those every :data:`SWEEP_EVERY` seconds).
        """
        for task in [t for t in self.running if t.done()]:
            self.running.pop(task)
        if sweep:
            self._swept_at = time.monotonic()
            await self._fire_schedules()
        # No more than the instance can renew in time: at its max_held, takeovers wait
        # (other instances may take them meanwhile).
        free = min(self.concurrency - len(self.running), self.host.keeper.free)
        if free > 0 or sweep:
            try:
                if free > 0:
                    await self.take_work(free, sweep=sweep)
                else:
                    # A full loop's sweep still makes runs takeable: under a steady load
                    # its sweeps may all fall on full looks, and the looks a run's end
                    # wakes do not sweep (queued runs would wait for the backlog to drain).
                    await self._make_takeable()
                self.failures = 0
            except Exception as exc:
                self.failures += 1
                logger.warning(
                    "serve: the store could not be read (%s); looking again in %.1fs",
                    failure_reason(exc),
                    serve_backoff(self.poll, self.failures),
                )
        # After the takes, and not while the store fails: callbacks never delay a take,
        # nor add their own retries to a look during an outage.
        if sweep and not self.failures:
            await self._deliver_callbacks()
        await self._announce()
        return serve_backoff(self.poll, self.failures)

    async def _fire_schedules(self) -> None:
        """Submit the runs of the schedules' due ticks (each tick once, whichever worker
        fires it): before the takes, so a look can take what it fired. Never fails the
        loop: a tick left due is fired by the next look of any worker."""
        queue = self.host.queue_or_none()
        if queue is None:
            return
        try:
            await queue.schedules.fire_due()
        except Exception as exc:
            logger.warning(
                "serve: could not fire the schedules' due ticks (%s); looking again at the "
                "next look",
                failure_reason(exc),
            )

    def _output_allowlist(self, graph: str | None) -> frozenset[tuple[str, ...]]:
        """What a run of ``graph``'s output may construct: the served graph's own types."""
        served = self.graphs.get(graph) if graph is not None else None
        return frozenset() if served is None else run_allowlist(served)

    async def _deliver_callbacks(self) -> None:
        """Begin the due deliveries of ended runs' completion callbacks; never fails the
        loop: one left due is delivered by a later look of any worker."""
        if self.deliveries is None:
            return
        try:
            await self.deliveries.look()
        except Exception as exc:
            logger.warning(
                "serve: could not look for due callbacks (%s); looking again at the next look",
                failure_reason(exc),
            )

    async def _announce(self) -> None:
        """Say which graphs this loop serves (``langgraph-fence runs`` shows a pending run
        of a graph nobody serves as unserved), at most every ``ANNOUNCE_EVERY`` seconds;
        never fails the loop."""
        queue = self.host.queue_or_none()
        now = time.monotonic()
        if queue is None or now < self._announced_at + ANNOUNCE_EVERY:
            return
        keeper = self.host.keeper
        hold = WorkerHold(
            held=keeper.held,
            max_held=keeper.max_held,
            lease_ttl=keeper.ttl,
            renewal_late=round(keeper.lateness(self.host.clock() - ANNOUNCE_EVERY), 3),
        )
        try:
            await queue.announce(self.host.instance_id, self.graphs, hold)
            self._announced_at = now
        except Exception as exc:
            logger.info(
                "serve: could not record its graphs in fence_workers (%s)", failure_reason(exc)
            )

    async def _retire(self) -> None:
        queue = self.host.queue_or_none()
        if queue is None or self._announced_at == -ANNOUNCE_EVERY:
            return
        try:
            await queue.retire(self.host.instance_id)
        except Exception as exc:
            logger.info(
                "serve: could not remove its row of fence_workers (%s)", failure_reason(exc)
            )

    async def run(self, stop: asyncio.Event, *, handle_signals: bool = False) -> None:
        """Look, pause, look again until ``stop`` is set (a run that ends cuts the pause
        short; ``handle_signals``: SIGTERM and SIGINT set it); then drain the runs and wait
        for them to hand back."""
        remove_signals = on_signals(stop) if handle_signals else (lambda: None)
        logger.info("instance %s serves %s", self.host.instance_id, sorted(self.graphs))
        queue = self.host.queue_or_none()
        # On PostgreSQL a submit or a hand-back wakes the loop at once (LISTEN/NOTIFY);
        # polling stays.
        wake = asyncio.Event()
        try:
            listening = queue is not None and self.listen
            async with queue.wakeups(wake) if listening and queue else nullcontext(False):
                sweep = True
                while not stop.is_set():
                    wake.clear()
                    pause = await self.poll_once(sweep=sweep)
                    if not sweep:
                        pause = min(pause, max(0.0, self._sweep_left()))
                    waiters: list[asyncio.Future[Any]] = [
                        asyncio.ensure_future(stop.wait()),
                        asyncio.ensure_future(self._sleep(pause)),
                        asyncio.ensure_future(wake.wait()),
                    ]
                    waiters.extend(self.running)
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                    # Only a run's end woke the loop: it takes work at once, and sweeps
                    # no more often than every SWEEP_EVERY seconds.
                    sweep = any(w.done() for w in waiters[:3]) or self._sweep_left() <= 0
                    for waiter in waiters[:3]:
                        waiter.cancel()
        finally:
            remove_signals()
            await self.stop_runs()
            if self.deliveries is not None:
                await self.deliveries.stop()
            await self._retire()
            logger.info("instance %s stopped serving", self.host.instance_id)

    async def stop_runs(self) -> None:
        """Drain every run of the loop at its next superstep boundary and wait for them."""
        for runs in self.running.values():
            for run in runs:
                reason = "langgraph-fence: the instance is stopping"
                run.handle.request_stop(reason)  # confirm_now() refuses from here on
                run.control.request_drain(reason)
        if self.running:
            await asyncio.gather(*self.running, return_exceptions=True)
        if self.telling:
            await asyncio.gather(*self.telling, return_exceptions=True)

    async def _make_takeable(self) -> None:
        """Make the runs takeable that wait for a look rather than for a worker: queued
        runs, flow keys' runs, yielded trees whose children all ended."""
        queue = self.host.queue_or_none()
        if queue is None:
            return
        # A thread whose run ended begins its next queued run (on_busy="enqueue"): it is
        # then a pending candidate like any submitted run. One read when none is queued.
        await queue.promote()
        # Runs of flow keys the keys' limits now allow: admitted (pending, takeable).
        await queue.flows.admit()
        # A yielded tree whose children all ended without waking it: woken (one
        # statement; its waiter, if alive, takes it again within the TTL).
        await queue.wake_all_yielded(self.host.lease_ttl)

    def _sweep_left(self) -> float:
        """Seconds until the loop's next sweep is due (0 or less: due; a monotonic clock)."""
        return self._swept_at + SWEEP_EVERY - time.monotonic()

    async def take_work(self, free: int, *, sweep: bool = True) -> None:
        """Take up to ``free`` candidates over; a failed take never stops the serve loop
        (a failed look raises, and the loop backs off). With ``sweep``, queued runs are
        promoted, flow keys' runs admitted and yielded trees woken first.

        An execution of a graph this loop does not serve is remembered with its epoch
        (``unserved``) and costs no read on the polls after: its record is never loaded, its
        input never decoded. A record is decoded only once its execution is taken, and a
        record that cannot be decoded dead-letters its execution (guarded by the epoch just
        taken) with the reason, instead of failing the loop. So does a latest checkpoint that
        cannot be read (taken, then dead-lettered: two statements, once). Candidates settled
        or passed over in a look are looked past in the same look, so no number of them
        delays the takeover of a healthy execution behind them.
        """
        host, graphs, unserved = self.host, self.graphs, self._unserved
        if self._alone is not None and not self._alone.done():
            return  # an execution's last take of its budget runs with nothing beside it
        self._alone = None
        if self._isolating and not self._idle():
            return  # draining to idle, to run an execution's last take alone
        self._isolating = False
        if sweep:
            await self._make_takeable()
        window = free * 4
        # The candidates this look took, settled or passed over: a window full of rows that
        # cannot run here (dead-lettered now, moved on) is looked past at once, not one
        # window per poll.
        seen: set[LeaseKey] = set()
        while free > 0:
            # A store that cannot be read raises out of here: the loop logs it and backs
            # off. Unserved executions stay candidates: widen the window by as many, or
            # they would hide the ones this loop can run.
            limit = window + len(unserved) + len(seen)
            # In claim order (round-robin by tenant), from after the tenant claimed for last.
            candidates = await host.repository.takeover_candidates(
                limit=limit, after_tenant=self._claimed_for
            )
            # Forget the ones that are no longer candidates (ended, or taken by their
            # servers); a new epoch is a new run, whose record may name another graph.
            current = {candidate.key: candidate.epoch for candidate in candidates}
            for key in [k for k, epoch in unserved.items() if current.get(k) != epoch]:
                del unserved[key]
            fresh = [c for c in candidates if c.key not in unserved and c.key not in seen]
            heads = await host.records.heads_of([c.key for c in fresh]) if fresh else {}
            found_unserved = passed = False
            for candidate in fresh:
                if free <= 0:
                    return
                seen.add(candidate.key)
                head = heads.get(candidate.key)
                graph_name = None if head is None else head.graph
                if head is None or head.graph not in graphs:
                    # Once per execution (and epoch): remembered in ``unserved`` from here on.
                    unserved[candidate.key] = candidate.epoch
                    found_unserved = True
                    logger.warning(
                        "execution %s is expired but its graph %r is not served here (this "
                        "loop serves %s): left untouched; to take it over, serve a graph "
                        "under the name %r (serve({%r: graph}), or a worker whose --graphs "
                        "factory returns that key)",
                        candidate.scope_key,
                        graph_name,
                        sorted(graphs),
                        graph_name,
                        graph_name,
                    )
                    continue
                if not host.keeper.try_admit():
                    return  # the instance is full: the rest wait for a free slot
                try:
                    started = await self._take_one(graphs[head.graph], candidate, head)
                except Exception:
                    host.keeper.leave()
                    logger.warning("could not take %s over", candidate.scope_key, exc_info=True)
                    passed = True
                    continue
                if started:
                    free -= 1
                    self._claimed_for = candidate.key.tenant_id
                else:
                    host.keeper.leave()
                    passed = True
                if self._alone is not None or self._isolating:
                    return  # a last take runs alone, or the loop drains to run one
            if len(candidates) < limit or not (found_unserved or passed):
                return
            # A full window of newly found unserved executions (or of rows just settled or
            # passed over) may hide servable ones behind it: look again at once, past them
            # (doubling, so N of them take log N looks, once; later polls skip the unserved
            # without a read, and the settled are no longer candidates).
            window *= 2

    async def _take_one(self, graph: Any, candidate: Lease, head: ExecutionHead) -> bool:
        """Take ``candidate`` over and start its run; whether a run was started (it then
        owns the slot the caller took for it).

        The recorded input is read only when the run needs it (no checkpoint yet), decoded
        with the graph's own allow-list; a record that cannot be, dead-letters the execution.
        """
        host = self.host
        # The tenant names the thread too (another tenant's thread of the same id is another).
        config: RunnableConfig = {
            "configurable": {"thread_id": head.thread_id, "tenant_id": candidate.key.tenant_id}
        }
        # The thread's progress, for the takeover budget, read before the take (the take
        # statement compares it with the mark the last take stored). The expired holder may
        # still land a checkpoint between this read and the take: that progress is then seen
        # by the next take, one take late.
        try:
            latest = await graph.checkpointer.aget_tuple(config)
            mark = await progress_mark(graph.checkpointer, latest)
        except Exception as exc:
            if is_connection_error(exc):
                raise  # the store blinked: nothing is wrong with the checkpoint
            await self._settle_unreadable(candidate, exc)
            return False
        alone = self._last_chance(candidate, mark)
        if alone and not self._idle():
            # Left for now (another instance may take it); this loop takes nothing more
            # until its runs have ended, then takes it alone.
            self._isolating = True
            return False
        host.events.describe(candidate.key.scope_key, head.thread_id, head.graph)
        taken = await host.repository.take_over(
            candidate,
            host.instance_id,
            host.lease_ttl,
            progress_mark=mark,
            max_takeovers=self.budget,
        )
        if taken is None:
            return False  # renewed by its holder or taken by another instance meanwhile
        if taken.status is LeaseStatus.DEAD_LETTERED:
            # Who held it is told too: the journal of a worker killed mid-write may never
            # have been written.
            before = f"from {candidate.holder or 'no holder'} at token {candidate.epoch}"
            told = f"{taken.reason} ({before})"
            announce_dead_letter(host.events, taken.scope_key, taken.epoch, told)
            return False
        host.events.emit(
            EventKind.TAKEN_OVER,
            taken.scope_key,
            taken.epoch,
            f"from {candidate.holder or 'no holder'} at token {candidate.epoch}",
        )
        # The record cannot change under us now: a new run of the key takes a new epoch.
        # None found before the take is read again now the take fenced the old holder (it
        # may have landed its first one in between); a submitted run reads it again below
        # in any case, for its pin. A candidate with no holder (a new run, a hand-back) had
        # nobody who could write since the read (every write is guarded by its holder, and
        # the take by the epoch read): the read stands, and costs no second one.
        settled = candidate.holder is None
        # Whether ``now_latest`` was read where nothing could have written since (then the
        # run's own first read is answered with it: FencedCheckpointer.primed).
        fresh = settled or latest is None
        now_latest = (
            latest if latest is not None or settled else await graph.checkpointer.aget_tuple(config)
        )
        from_input = now_latest is None
        submitted = False
        told_run: str | None = None  # the submitted run whose callbacks its end arms
        read_back: Mapping[str, Any] | None = None  # the record, as the pin read it back
        stream: StreamTake | None = None
        queue = host.queue_or_none()
        # Only a submitted run (its head says so: read with it, no statement more) pays for
        # the pin: a takeover of a run started by ainvoke reads and writes nothing for it.
        if queue is not None and head.submitted:
            # A submitted run: the first claimer pins the checkpoint its input follows; a
            # later taker runs the input again only if the thread is still there.
            if latest is not None and not settled:
                now_latest = await graph.checkpointer.aget_tuple(config)
                fresh = True
            mark_now = "" if now_latest is None else _checkpoint_id(now_latest.config)
            pinned = await queue.pin(taken, mark_now)
            if pinned is not None:
                submitted = True
                read_back = pinned.record
                # Its end arms the run's callbacks only if it has any (else no statement).
                told_run = pinned.run_id if pinned.told else None
                from_input = pinned.input_after == mark_now
                if pinned.run_id is not None and pinned.stream_modes:
                    stream = await _stream_take(queue, taken, pinned, now_latest, from_input)
        try:
            records = host.records
            if read_back is not None and isinstance(records, SqlExecutionRecords):
                record: ExecutionRecord | None = records.decode(
                    taken.key, read_back, allow=run_allowlist(graph), with_input=from_input
                )
            else:
                record = await records.get(
                    taken.key, allow=run_allowlist(graph), with_input=from_input
                )
            if record is None:
                raise LookupError(f"the record of execution {taken.scope_key!r} is gone")
        except Exception as exc:
            if is_connection_error(exc):
                # A store call, so a connection error is the store's: it blinked (its
                # retries ran out) and nothing is wrong with the record. Handed back for
                # the next look (or, if the store is still gone, left to expire): an
                # infrastructure error is never a dead letter.
                logger.warning(
                    "the record of %s could not be read (%s): handed back",
                    taken.scope_key,
                    failure_reason(exc),
                )
                with contextlib.suppress(Exception):
                    await host.repository.release(taken, LeaseStatus.PENDING)
                return False
            # Ours now (epoch + 1): left as it is, every instance would fail on it, poll
            # after poll. It cannot run anywhere: dead-letter it, saying why.
            reason = failure_reason(exc, prefix="its execution record cannot be loaded: ")
            await host.repository.dead_letter(taken.key, reason, epoch=taken.epoch)
            announce_dead_letter(host.events, taken.scope_key, taken.epoch, reason)
            return False
        # The run as it was started: its configurable keys, context, limits and options
        # (serve()'s own options are the defaults under them).
        config, options = restore_run(record.run, head.thread_id, candidate.key.tenant_id)
        runs: list[Run] = []
        task = asyncio.create_task(
            self._resume(
                graph,
                config,
                record.input,
                taken,
                runs,
                {**self.kwargs, **options},
                submitted,
                self.run_retries.get(head.graph),
                stream,
                told_run,
                (now_latest,) if fresh else None,
            ),
            name=f"resume {taken.scope_key}",
        )
        self.running[task] = runs
        if alone:
            self._alone = task
        return True

    def _last_chance(self, candidate: Lease, mark: str | None) -> bool:
        """Whether this take is an execution's last within the takeover budget: its holder
        crashed, no checkpoint landed since the last take, and the count would reach
        ``max_takeovers``. Such a run goes on alone (this loop runs nothing else, and takes
        nothing else until it ends): if it kills its worker, it was the cause, and the next
        take dead-letters it; a healthy execution that only shared workers with a poison
        pill ends here instead of being blamed for their deaths."""
        if candidate.status is not LeaseStatus.RUNNING:
            return False  # handed back or never started: nobody crashed, nothing counts
        count = (candidate.takeovers if candidate.progress_mark == mark else 0) + 1
        return count == self.budget

    def _idle(self) -> bool:
        """Whether this loop runs nothing. Runs its instance makes for callers
        (``ainvoke``) are not waited for: they may never pause, and a loop waiting for
        them would never serve again."""
        return all(task.done() for task in self.running)

    async def _settle_unreadable(self, candidate: Lease, exc: Exception) -> None:
        """Dead-letter ``candidate``, whose latest checkpoint cannot be read (``exc``), once.

        Left as it is, it would stay ``running`` with a dead holder, every look of every
        instance would fail on it again, and a window full of such rows would hide the
        healthy candidates behind them. It is taken first (one guarded take: fenced from its
        old holder, and only one instance ends it), then dead-lettered under the token just
        taken, with a reason naming what could not be read: two statements, once.
        """
        host = self.host
        reason = failure_reason(exc, prefix="its latest checkpoint cannot be loaded: ")
        taken = await host.repository.take_over(
            candidate, host.instance_id, host.lease_ttl, max_takeovers=self.budget
        )
        if taken is None:
            return  # renewed by its holder or taken by another instance meanwhile
        if taken.status is not LeaseStatus.DEAD_LETTERED:
            taken = await host.repository.dead_letter(taken.key, reason, epoch=taken.epoch)
        announce_dead_letter(host.events, taken.scope_key, taken.epoch, taken.reason)

    async def _resume(
        self,
        graph: Any,
        config: RunnableConfig,
        input: Any,
        taken: Lease,
        runs: list[Run],
        kwargs: Mapping[str, Any],
        submitted: bool = False,
        retry: RunRetry | None = None,
        stream: StreamTake | None = None,
        told_run: str | None = None,
        latest: tuple[CheckpointTuple | None] | None = None,
    ) -> None:
        """Run a taken execution: from its last checkpoint (``input`` None), or its input;
        a submitted run's output is kept with its execution under its lease, its failure
        retried as ``retry`` says, its stream recorded as ``stream`` says, and the callbacks
        of ``told_run`` made due when it ends. ``latest``: the thread's latest checkpoint as
        read since the take, which the run's own first read is answered with."""
        try:
            logger.info(
                "resuming %s at token %d from its %s",
                taken.scope_key,
                taken.epoch,
                "last checkpoint" if input is None else "recorded input",
            )
            async with running(
                self.host,
                graph,
                input,
                config,
                taken.key.tenant_id,
                taken.key.execution_id,
                kwargs,
                taken=taken,
                retry=retry if submitted else None,
            ) as run:
                runs.append(run)
                queue = self.host.queue_or_none()
                # Every served graph's checkpointer is a FencedCheckpointer (__init__ checks).
                with (
                    graph.checkpointer.primed(run.config, latest[0])
                    if latest is not None
                    else nullcontext()
                ):
                    if stream is None or queue is None:
                        output = await graph.ainvoke(
                            input, run.config, control=run.control, **kwargs
                        )
                    else:
                        output = await _recorded(graph, input, run, kwargs, queue, stream)
                if submitted and queue is not None:
                    await queue.store_output(run.handle, output)
        except GraphDrained:
            logger.info("run %s drained and handed back", taken.scope_key)
        except ExecutionSleeping as sleeping:
            logger.info("run %s: %s", taken.scope_key, sleeping)
        except Exception:
            logger.warning("resumed run %s ended with an error", taken.scope_key, exc_info=True)
        finally:
            queue = self.host.queue_or_none()
            if submitted and queue is not None:
                # Its lease is released now: its callbacks are due if it ended (a run that
                # goes on is not told), and a result() waiting for it looks at once, told in
                # a task of its own: the run's slot is free for the next take meanwhile.
                if told_run is not None:
                    with contextlib.suppress(Exception):  # the sweep makes them due then
                        await queue.callbacks.arm(told_run)
                telling = asyncio.ensure_future(queue.notify(ENDS_CHANNEL, taken.scope_key))
                self.telling.add(telling)
                telling.add_done_callback(self.telling.discard)


class StreamTake(NamedTuple):
    """How a take records its submitted run's stream."""

    run_id: str
    modes: tuple[str, ...]
    #: The checkpoint the take begins from ("": none).
    after: str
    #: Whether its events before its first step are left out.
    skip_preamble: bool
    #: The nodes of the tasks of its first step whose stored writes it applies and whose
    #: updates an older holder streamed.
    replayed: tuple[str, ...]


async def _stream_take(
    queue: SubmittedRuns,
    taken: Lease,
    pinned: Pinned,
    latest: CheckpointTuple | None,
    from_input: bool,
) -> StreamTake:
    """Withdraw what older holders streamed of what this take runs again (all after the
    checkpoint it begins from, but the events of the tasks whose writes it keeps), and say
    how the take records the rest."""
    after = "" if latest is None else _checkpoint_id(latest.config)
    try:
        finished = finished_tasks(latest.pending_writes if latest is not None else ())
    except Exception:  # LangGraph moved its reading: those tasks' events are withdrawn
        logger.warning("the finished tasks of %s cannot be read", taken.scope_key, exc_info=True)
        finished = frozenset()
    assert pinned.run_id is not None
    kept = await queue.withdraw_stream(taken, pinned.run_id, after, finished)
    # A take resuming from a checkpoint of the run begins with a state the run streamed;
    # one beginning from the run's input again, with one an older holder may have.
    skip = not from_input or kept.preamble
    return StreamTake(pinned.run_id, pinned.stream_modes, after, skip, kept.replayed)


async def _recorded(
    graph: Any,
    input: Any,
    run: Run,
    kwargs: Mapping[str, Any],
    queue: SubmittedRuns,
    stream: StreamTake,
) -> Any:
    """``graph.ainvoke`` for ``run``, its events in ``stream.modes`` recorded: each before
    the task writes or checkpoint after it, the rest before the run's end is written."""
    recorder = StreamRecorder(
        queue,
        run.handle,
        stream.run_id,
        stream.modes,
        after=stream.after,
        skip_preamble=stream.skip_preamble,
        replayed=stream.replayed,
    )
    run.handle.before_root_write = recorder.flush
    try:
        output = await graph.ainvoke(
            input,
            recorder.config(run.config, store=getattr(graph, "store", None)),
            control=run.control,
            **kwargs,
        )
    except BaseException:
        # What the run streamed before its error, as an in-process stream shows it; a
        # fenced run's write is refused (its taker records those steps again).
        with contextlib.suppress(Exception):
            await recorder.flush()
        raise
    finally:
        run.handle.before_root_write = None
    await recorder.flush()
    return output


def _checkpoint_id(config: Any) -> str:
    """The id of the checkpoint a checkpoint config names (``CheckpointTuple.config``,
    ``.parent_config``)."""
    return str(config["configurable"]["checkpoint_id"])


async def progress_mark(checkpointer: Any, latest: CheckpointTuple | None) -> str | None:
    """The thread's progress as the takeover budget counts it: the id of its ``latest``
    checkpoint (None for none), where the start of a run is no progress.

    A run started on its input writes two checkpoints before any step runs: the input
    checkpoint (``source`` ``"input"``) and the first loop checkpoint, which applies the
    input. A taker that started the run from its recorded input, wrote those and died in
    the first step made no progress; counted as progress, they would start the count again
    and buy a poison pill one more worker. So either counts as the checkpoint the input
    followed. Costs one more read (of the latest checkpoint's parent) when the latest is a
    loop checkpoint; takes are rare.
    """
    if latest is None:
        return None
    start = latest
    if latest.metadata.get("source") == "loop" and latest.parent_config is not None:
        parent = await checkpointer.aget_tuple(latest.parent_config)
        if parent is not None and parent.metadata.get("source") == "input":
            start = parent
    if start.metadata.get("source") == "input":
        before = start.parent_config
        return None if before is None else _checkpoint_id(before)
    return _checkpoint_id(latest.config)


def check_budget(max_takeovers: object) -> int:
    """``max_takeovers`` if an int >= 1, else ``ValueError`` naming it and the fix."""
    if max_takeovers is None:
        raise ValueError(
            "max_takeovers must be an int >= 1 (how many takeovers in a row without a new "
            "checkpoint an execution gets before it is dead-lettered), got None"
        )
    budget = validate_max_takeovers(max_takeovers)  # type: ignore[arg-type]
    assert budget is not None
    return budget


def check_run_retries(
    run_retries: Mapping[str, RunRetry] | None, graphs: Mapping[str, Any]
) -> dict[str, RunRetry]:
    """``run_retries`` checked: each a :class:`RunRetry` of a graph the loop serves.

    Raises:
        ValueError: a name the loop does not serve, or a value that is no ``RunRetry``.
    """
    if run_retries is None:
        return {}
    if not isinstance(run_retries, Mapping):
        raise ValueError(f"run_retries must map graph names to RunRetry, got {run_retries!r}")
    for name, retry in run_retries.items():
        if name not in graphs:
            raise ValueError(
                f"run_retries names {name!r}, which this loop does not serve (it serves "
                f"{sorted(graphs)}): name a served graph"
            )
        if not isinstance(retry, RunRetry):
            raise ValueError(f"run_retries[{name!r}] must be a RunRetry, got {retry!r}")
    return dict(run_retries)


def serve_backoff(poll: float, failures: int) -> float:
    """The pause before serve()'s next look: ``poll``, doubling per failed look in a row up
    to ``MAX_SERVE_BACKOFF`` (never shorter than ``poll``)."""
    if failures <= 0:
        return poll
    return max(poll, min(MAX_SERVE_BACKOFF, poll * float(1 << min(failures, 16))))


def on_signals(stop: asyncio.Event) -> Callable[[], None]:
    """Set ``stop`` on SIGTERM and SIGINT; returns how to undo it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):
            pass

    def remove() -> None:
        for sig in installed:
            loop.remove_signal_handler(sig)

    return remove
