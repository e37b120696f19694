"""The claim order of submitted (and every other) candidates: round-robin by tenant."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from langgraph_fence import Lease, LeaseKey, LeaseStatus
from langgraph_fence.lease.transitions import fair_order


def pending(tenant: str, n: int) -> Lease:
    return Lease(LeaseKey(tenant, f"{tenant}-{n}"), None, 0, None, (), LeaseStatus.PENDING)


def names(leases: list[Lease]) -> list[str]:
    return [lease.key.execution_id for lease in leases]


def test_each_tenants_oldest_first_then_each_ones_second() -> None:
    found = [pending("A", i) for i in range(4)] + [pending("B", 0), pending("B", 1)]
    assert names(fair_order(found, None)) == ["A-0", "B-0", "A-1", "B-1", "A-2", "A-3"]


def test_claims_start_after_the_tenant_claimed_for_last() -> None:
    found = [pending("A", i) for i in range(3)] + [pending("B", 0), pending("C", 0)]
    assert names(fair_order(found, "A"))[:3] == ["B-0", "C-0", "A-0"]
    assert names(fair_order(found, "C"))[:3] == ["A-0", "B-0", "C-0"]


@given(
    st.lists(st.sampled_from("ABCD"), max_size=40),
    st.one_of(st.none(), st.sampled_from("ABCDE")),
)
def test_a_permutation_that_keeps_each_tenants_order(tenants: list[str], last: str | None) -> None:
    found = [pending(t, i) for i, t in enumerate(tenants)]
    ordered = fair_order(found, last)
    assert sorted(names(ordered)) == sorted(names(found))
    for tenant in set(tenants):
        mine = [lease for lease in found if lease.key.tenant_id == tenant]
        assert [lease for lease in ordered if lease.key.tenant_id == tenant] == mine
    # No tenant gets a second claim before every waiting tenant got its first.
    first_round = len(set(tenants))
    assert len({lease.key.tenant_id for lease in ordered[:first_round]}) == first_round
