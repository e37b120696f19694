"""A graph whose stream has every recorded mode's events: custom events from sync steps, an
interrupt, and a step a test can hold (``hold``) to take the run over in the middle."""

from __future__ import annotations

import operator
import threading
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


def orders(instance: Instance, hold: Hold | None = None) -> Any:
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
        thread = config["configurable"]["thread_id"]
        if hold is not None and thread == hold.thread:
            hold.calls += 1
            if hold.calls == 1:
                hold.entered.set()
                hold.released.wait(20)
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
