from langgraph_fence import LeaseKey, LeaseStatus, ExecutionFencedError
import pytest
from tests.conftest import unique

async def test_cycle(lease_store, clock):
    key = LeaseKey(unique("t"), unique("e"))
    a = await lease_store.acquire(key, "A", 10)
    assert a.epoch == 1
    assert await lease_store.acquire(key, "B", 10) is None
    clock.advance(11)
    b = await lease_store.acquire(key, "B", 10)
    assert b.epoch == 2
    with pytest.raises(ExecutionFencedError) as ei:
        await lease_store.renew(a, 10)
    assert ei.value.token_seen == 2
    b2 = await lease_store.renew(b, 10)
    r = await lease_store.release(b2, LeaseStatus.DONE)
    assert r.status is LeaseStatus.DONE
    assert await lease_store.acquire(key, "C", 10) is None
    c = await lease_store.acquire(key, "C", 10, reopen=True)
    assert c.epoch == 3
