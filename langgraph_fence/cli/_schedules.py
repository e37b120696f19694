"""``langgraph-fence schedules create|list|pause|resume|delete``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from langgraph_fence.cli._commands import run_request
from langgraph_fence.cli._common import checked_target, iso_time, printable, utc

if TYPE_CHECKING:
    from langgraph_fence.queue import Schedule


async def schedules(args: argparse.Namespace) -> int:
    from rich.console import Console

    from langgraph_fence.instance import Instance

    console = Console()
    checked_target(args, must_exist=args.action != "create")
    async with Instance.open(args.db, schema=args.schema) as instance:
        if args.action == "create":
            payload, config, options = run_request(args)
            end_at = None if args.end_at is None else iso_time("--end-at", args.end_at)
            made = await instance.schedules.create(
                args.schedule_id,
                args.graph,
                payload,
                config,
                tenant_id=args.tenant,
                execution_id=args.execution,
                cron=args.cron,
                timezone=args.timezone,
                overlap=args.overlap,
                missed=args.missed,
                grace=args.grace,
                end_at=end_at,
                replace=args.replace,
                **options,
            )
            console.print(
                f"schedule {made.schedule_id} of tenant {made.tenant_id}: {made.cron} "
                f"({made.timezone}), next tick {utc(made.next_tick) or 'none (ended)'}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
            return 0
        if args.action == "list":
            found = await instance.schedules.list(tenant_id=args.tenant)
            _print(args, console, found)
            return 0
        operation = {
            "pause": instance.schedules.pause,
            "resume": instance.schedules.resume,
            "delete": instance.schedules.delete,
        }[args.action]
        if not await operation(args.schedule_id, tenant_id=args.tenant):
            state = "not found or not paused" if args.action == "resume" else "not found"
            raise ValueError(
                f"schedule {args.schedule_id!r} of tenant {args.tenant!r} is {state}: nothing "
                "changed (langgraph-fence schedules list shows them)"
            )
        done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[args.action]
        console.print(f"{done} {args.schedule_id}", markup=False, highlight=False)
        return 0


def _as_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "tenant_id": schedule.tenant_id,
        "schedule_id": schedule.schedule_id,
        "graph": schedule.graph,
        "thread_id": schedule.thread_id,
        "cron": schedule.cron,
        "timezone": schedule.timezone,
        "overlap": schedule.overlap,
        "missed": schedule.missed,
        "paused": schedule.paused,
        "next_tick": utc(schedule.next_tick),
        "last_tick": utc(schedule.last_tick),
        "end_at": utc(schedule.end_at),
        "fired": schedule.fired,
        "skipped": schedule.skipped,
    }


def _print(args: argparse.Namespace, console: Any, found: list[Schedule]) -> None:
    listed = [_as_dict(s) for s in found]
    if args.json:
        sys.stdout.write(json.dumps(listed, indent=2) + "\n")
        return
    from rich.table import Table

    table = Table(title="schedules" + (f" of tenant {args.tenant}" if args.tenant else ""))
    for column in ("tenant", "id", "graph", "thread", "cron", "next tick", "fired", "skipped"):
        table.add_column(column, overflow="fold")
    for entry in listed:
        next_tick = "paused" if entry["paused"] else entry["next_tick"] or "ended"
        cells = (
            entry["tenant_id"],
            entry["schedule_id"],
            entry["graph"],
            entry["thread_id"],
            f"{entry['cron']} ({entry['timezone']})",
            next_tick,
            str(entry["fired"]),
            str(entry["skipped"]),
        )
        table.add_row(*(printable(str(c)) for c in cells))
    console.print(table)
