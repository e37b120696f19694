"""A graph whose stream has every recorded mode's events: custom events from sync steps, an
interrupt, and a step a test can hold (``hold``) to take the run over in the middle."""

from __future__ import annotations

import operator
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langchain_core.runnables import RunnableConfig
from langgraph.config import get_stream_writer
from langgraph.graph import END, START, StateGraph
from langgraph.types import Interrupt, interrupt

from langgraph_fence import Instance, fence_graph

MODES = ["values", "updates", "custom"]


class Order(TypedDict, total=False):
    item: str
    approved: str
    log: Annotated[list[str], operator.add]


class Hold:
    """Holds the first ``charge`` step of a thread until ``release()``; ``entered`` is set
    when it is held (the steps run in worker threads: these are thread events)."""

    def __init__(self, thread: str) -> None:
        self.thread = thread
        self.entered = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def release(self) -> None:
        self.released.set()

    def charge(self, thread: str) -> None:
        if thread == self.thread:
            self.calls += 1
            if self.calls == 1:
                self.entered.set()
                self.released.wait(20)


#: Where a worker process's ``charge`` marks that it holds a thread's first charge.
HOLD_DIR_ENV = "LGF_STREAM_HOLD_DIR"


class FileHold:
    """In worker processes: the first ``charge`` of each thread (across processes) writes
    ``<thread>.held`` in ``directory`` and waits there until its process is killed."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def charge(self, thread: str) -> None:
        try:
            (self.directory / f"{thread}.held").open("x").close()
        except FileExistsError:
            return  # a later attempt: it goes on
        time.sleep(120)  # killed meanwhile


def stream_graphs(instance: Instance) -> dict[str, Any]:
    """``--graphs`` factory of the stream chaos workers: ``orders``, its first charge of
    each thread held where ``LGF_STREAM_HOLD_DIR`` is set."""
    directory = os.environ.get(HOLD_DIR_ENV)
    return {"orders": orders(instance, FileHold(Path(directory)) if directory else None)}


def orders(instance: Instance, hold: Hold | FileHold | None = None) -> Any:
    """plan -> approve (interrupt) -> charge -> notify."""

    def plan(state: Order) -> dict[str, Any]:
        get_stream_writer()({"planned": state["item"]})
        return {"log": ["plan"]}

    def approve(state: Order) -> dict[str, Any]:
        answer = interrupt({"approve": state["item"]})
        get_stream_writer()({"approved": answer})
        return {"approved": answer, "log": ["approve"]}

    def charge(state: Order, config: RunnableConfig) -> dict[str, Any]:
        get_stream_writer()({"charging": state["item"]})
        if hold is not None:
            hold.charge(config["configurable"]["thread_id"])
        return {"log": ["charge"]}

    def notify(state: Order) -> dict[str, Any]:
        get_stream_writer()({"notified": state["approved"]})
        return {"log": ["notify"]}

    builder: StateGraph[Any] = StateGraph(Order)
    for step in (plan, approve, charge, notify):
        builder.add_node(step.__name__, step)
    builder.add_edge(START, "plan")
    builder.add_edge("plan", "approve")
    builder.add_edge("approve", "charge")
    builder.add_edge("charge", "notify")
    builder.add_edge("notify", END)
    return fence_graph(builder).compile(checkpointer=instance.checkpointer, name="orders")


def plain(event: Any) -> Any:
    """``event`` with each interrupt's id left out: the id names the thread's task, and
    two threads' streams are compared."""
    if isinstance(event, Interrupt):
        return ("Interrupt", event.value)
    if isinstance(event, dict):
        return {k: plain(v) for k, v in event.items()}
    if isinstance(event, (list, tuple)):
        return type(event)(plain(v) for v in event)
    return event


def noted(instance: Instance, store: Any) -> Any:
    """One step that writes to the graph's ``store`` and streams what it reads back."""
    from langgraph.config import get_store

    def note(state: Order) -> dict[str, Any]:
        get_store().put(("notes",), state["item"], {"seen": True})
        found = get_store().get(("notes",), state["item"])
        get_stream_writer()({"noted": None if found is None else found.value})
        return {"log": ["note"]}

    builder: StateGraph[Any] = StateGraph(Order)
    builder.add_node("note", note)
    builder.add_edge(START, "note")
    builder.add_edge("note", END)
    return fence_graph(builder).compile(
        checkpointer=instance.checkpointer, store=store, name="noted"
    )
