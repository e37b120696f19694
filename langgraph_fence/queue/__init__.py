"""Runs any worker can take: submit, claim, output, cancel, and what a busy thread does.

``await instance.submit(graph_name, input, config, tenant_id=...)`` records the execution
(graph name, thread, input, and the run config as :mod:`langgraph_fence.lease.run_config`
records it) and sets its lease ``pending`` with no holder, in one transaction, and returns
a :class:`SubmittedRun` at once. A pending lease with no holder is a takeover candidate: any
instance's :meth:`~langgraph_fence.Instance.serve` that serves the graph takes it in its one
guarded take statement (the next token), runs the recorded input under that lease, and
stores the output with the execution under the same guard before it releases the lease
``done``. Nothing here adds a second way to run: a claimed run is a taken-over run, so a
claimed-then-killed run is an expired lease like any other, and its takeover decides its
standing stamps as every takeover does (a non-idempotent write is never repeated).

Which checkpoint the input follows is pinned by the first claimer, under its lease, before
the input runs (:meth:`SubmittedRuns.pin`): a later taker that finds the thread still at that
checkpoint runs the input again (the first one died before its first checkpoint); one that
finds a newer checkpoint resumes from it. The input is never applied twice and never lost.

A thread's execution that is pending or running is busy: a submit of the same graph, input
and run config is the same submit again (idempotent: it returns that run, nothing written);
any other input is handled by ``on_busy``: ``"reject"`` (default) raises
:class:`~langgraph_fence.errors.ExecutionBusyError`; ``"interrupt"`` fences the run in flight
(its epoch moves on in the same transaction, so its next write, renewal or release is
refused as any stale writer's, and it drains) and leaves the new input pending for the next
claimer; ``"enqueue"`` keeps the new input in the run's own row of ``fence_runs``, queued
behind the thread's run: once that run has ended, a worker's look begins the next queued run
of the thread (in submit order) in one transaction (the ended run keeps its outcome in its
row, the queued one becomes the execution's record and its lease is set pending), and it is
claimed like any submitted run. A worker gone between two runs leaves the queue as it was:
the next look of any worker begins the next run, once. Every submit has its own run id, so
each handle reads its own run's end, never a later run's output. Cancelling a run is the
same fence, ending the execution ``failed`` (a queued run: it never begins).

Only over a SQL lease store (SQLite or PostgreSQL, :meth:`Instance.open`): the queue is the
lease table every worker reads.
"""

from __future__ import annotations

from langgraph_fence.queue._callbacks import (
    CALLBACK,
    ENDED,
    SWEEP_EVERY,
    WEBHOOK,
    CallbackState,
    DueCallback,
    callback_targets,
    shown_target,
)
from langgraph_fence.queue._checks import ON_BUSY, OnBusy
from langgraph_fence.queue._flows import HELD_BACK, Flow
from langgraph_fence.queue._handle import SubmittedRun
from langgraph_fence.queue._not_before import NotBefore, check_not_before
from langgraph_fence.queue._schedules import MISSED, OVERLAP, Missed, Overlap, Schedule, Schedules
from langgraph_fence.queue._state import (
    ANNOUNCE_EVERY,
    ANNOUNCED_FOR,
    RunState,
    WorkerHold,
    list_runs,
    served_graphs,
)
from langgraph_fence.queue._streams import NS_SEP, STREAM_MODES, check_stream_mode, keep_tuples
from langgraph_fence.queue._streams import PREAMBLE as STREAM_PREAMBLE
from langgraph_fence.queue._submitted_runs import Pinned, SubmittedRuns

# LangGraph is imported by what submits and runs (run_config, serde), not by what lists:
# `langgraph-fence runs` reads this package without it (benchmarks/README.md, start-up).

__all__ = [
    "ANNOUNCED_FOR",
    "ANNOUNCE_EVERY",
    "CALLBACK",
    "ENDED",
    "HELD_BACK",
    "MISSED",
    "NS_SEP",
    "ON_BUSY",
    "OVERLAP",
    "STREAM_MODES",
    "STREAM_PREAMBLE",
    "SWEEP_EVERY",
    "WEBHOOK",
    "CallbackState",
    "DueCallback",
    "Flow",
    "Missed",
    "NotBefore",
    "OnBusy",
    "Overlap",
    "Pinned",
    "RunState",
    "Schedule",
    "Schedules",
    "SubmittedRun",
    "SubmittedRuns",
    "WorkerHold",
    "callback_targets",
    "check_not_before",
    "check_stream_mode",
    "keep_tuples",
    "list_runs",
    "served_graphs",
    "shown_target",
]
