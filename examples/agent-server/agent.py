"""A payment on LangGraph's Agent Server, fenced by langgraph-fence.

`charge` is a non-idempotent write: it is stamped before it runs, and an attempt of the run
that finds that stamp standing (the server re-dispatched the run while the first attempt
was inside the charge) dead-letters the thread instead of charging again.
"""

from __future__ import annotations

from typing import TypedDict

from langgraph.graph import END, START, StateGraph

from langgraph_fence import Effect, fence_graph, fenced, get_execution_context


class Payment(TypedDict, total=False):
    order: str
    amount_cents: int
    charged_under_token: int
    receipt: str


@fenced(effect=Effect.NON_IDEMPOTENT_WRITE)
async def charge(state: Payment) -> dict[str, object]:
    token = get_execution_context().fence.token
    # Call your payment provider here, passing the token (or the order) as its
    # idempotency key; a provider that checks it makes the charge exactly-once.
    return {"charged_under_token": token}


async def receipt(state: Payment) -> dict[str, object]:
    return {"receipt": f"order {state['order']}: {state['amount_cents']} cents charged"}


builder = StateGraph(Payment)
builder.add_node("charge", charge)
builder.add_node("receipt", receipt)
builder.add_edge(START, "charge")
builder.add_edge("charge", "receipt")
builder.add_edge("receipt", END)
graph = fence_graph(builder).compile()
