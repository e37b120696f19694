"""The lease transitions keep the fencing guarantees, for any sequence of steps.

The ``decide_*`` functions are the whole meaning of a lease (every store is held to them by
``tests/contract/test_lease_state_machine.py``). Here hypothesis drives them directly, with
three holders on one key and a clock, and checks after every step what DESIGN.md promises:

1. the token (epoch) never goes back, and every new hold has a token no earlier hold had;
2. at most one hold passes the guard at any time, and it is the newest one handed out;
3. an operation made with any other (superseded) hold is refused and changes nothing;
4. a standing non-idempotent stamp is never taken over into a running hold, and a
   dead-lettered execution runs again only after an operator's retry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from langgraph_fence import (
    Effect,
    ExecutionFencedError,
    Lease,
    LeaseKey,
    LeaseStatus,
    PendingEffect,
)
from langgraph_fence.lease import non_idempotent_standing
from langgraph_fence.lease.guard import holds
from langgraph_fence.lease.transitions import (
    Takeover,
    decide_acquire,
    decide_clear_pending_effects,
    decide_dead_letter,
    decide_mark_pending_effect,
    decide_release,
    decide_renew,
    decide_retry,
    decide_take_over,
)

KEY = LeaseKey("tenant", "execution")
HOLDERS = st.sampled_from(["A", "B", "C"])
TTL = 10.0


@dataclass
class World:
    """The stored lease, every hold ever handed out, and the clock."""

    stored: Lease | None = None
    holds: list[Lease] = field(default_factory=list)
    now: float = 0.0


class Transitions(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w = World()

    def _took(self, taken: Lease | None) -> None:
        if taken is None:
            return
        if taken.status is LeaseStatus.RUNNING:
            before = self.w.stored
            assert all(taken.epoch > h.epoch for h in self.w.holds), "a token was handed out twice"
            assert before is None or taken.epoch > before.epoch, "a take did not move the token"
            if before is not None and before.status is LeaseStatus.DEAD_LETTERED:
                raise AssertionError("a dead-lettered execution was taken without a retry")
            self.w.holds.append(taken)
        self.w.stored = taken

    @rule(holder=HOLDERS, reopen=st.booleans())
    def acquire(self, holder: str, reopen: bool) -> None:
        standing = self.w.stored is not None and non_idempotent_standing(self.w.stored)
        taken = decide_acquire(self.w.stored, KEY, holder, TTL, self.w.now, reopen=reopen)
        if taken is not None and standing:
            assert taken.status is LeaseStatus.DEAD_LETTERED, "acquire resumed a standing stamp"
        if taken is not None and taken.status is LeaseStatus.RUNNING:
            assert taken.pending_effects == (), "acquire took a lease with stamps standing"
        self._took(taken)

    @rule(holder=HOLDERS)
    def take_over(self, holder: str) -> None:
        if self.w.stored is None:
            return
        standing = non_idempotent_standing(self.w.stored)
        taken = decide_take_over(self.w.stored, self.w.stored, Takeover(holder, TTL), self.w.now)
        if taken is not None and standing:
            assert taken.status is LeaseStatus.DEAD_LETTERED, "a standing stamp was resumed"
        self._took(taken)

    @rule(which=st.integers(min_value=0), op=st.sampled_from(["renew", "release", "mark", "clear"]))
    @precondition(lambda self: bool(self.w.holds))
    def holder_op(self, which: int, op: str) -> None:
        hold = self.w.holds[which % len(self.w.holds)]
        before = self.w.stored
        current = holds(hold, before)
        effect = PendingEffect(Effect.NON_IDEMPOTENT_WRITE, "charge", "task", hold.epoch)
        try:
            if op == "renew":
                after = decide_renew(before, hold, TTL, self.w.now)
            elif op == "release":
                after = decide_release(before, hold, LeaseStatus.PENDING)
            elif op == "mark":
                after = decide_mark_pending_effect(before, hold, effect, TTL, self.w.now)
            else:
                after = decide_clear_pending_effects(before, hold)
        except ExecutionFencedError:
            assert not current, f"{op} by the current hold at token {hold.epoch} was refused"
            assert self.w.stored is before, "a refused operation changed the lease"
            return
        assert current, f"{op} by a superseded hold at token {hold.epoch} was accepted"
        assert after.epoch == hold.epoch, f"{op} moved the token"
        self.w.stored = after

    @rule()
    @precondition(lambda self: self.w.stored is not None)
    def dead_letter(self) -> None:
        self.w.stored = decide_dead_letter(self.w.stored, KEY, "operator")

    @rule()
    def retry(self) -> None:
        try:
            retried = decide_retry(self.w.stored, KEY)
        except (ValueError, KeyError):  # not dead-lettered, a stamp stands, or no lease
            return
        assert self.w.stored is not None
        assert not non_idempotent_standing(self.w.stored), "retried over a standing stamp"
        self.w.stored = retried

    @rule(seconds=st.sampled_from([0.5, 5.0, TTL, TTL + 1]))
    def advance(self, seconds: float) -> None:
        self.w.now += seconds

    @invariant()
    def at_most_one_hold_passes_the_guard(self) -> None:
        passing = [h for h in self.w.holds if holds(h, self.w.stored)]
        assert len(passing) <= 1, f"{len(passing)} holds pass the guard at once"
        if passing:
            assert passing[0] is self.w.holds[-1], "an older hold passes the guard"


TestTransitions = Transitions.TestCase
TestTransitions.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
