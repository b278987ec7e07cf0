"""Issue 25 item 11: the prefix cache is salted per tenant, so one tenant's prompt never
hits another's cached blocks (no probing by time to first token or the hit rate); the
same tenant still hits, and requests without a tenant behave as before."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SamplingParams
from engine.sequence import Sequence

P = SamplingParams(max_tokens=8)


def computed(bm: BlockManager, rid: str, tenant: str | None) -> Sequence:
    s = Sequence(rid, list(range(40)), P, tenant=tenant)
    bm.allocate(s)
    s.num_computed_tokens = 40
    bm.commit(s)
    return s


def probe(bm: BlockManager, rid: str, tenant: str | None) -> int:
    s = Sequence(rid, list(range(32)) + [99], P, tenant=tenant)
    bm.allocate(s)
    return s.num_cached_tokens


def test_another_tenant_does_not_hit_a_tenants_cached_prefix():
    bm = BlockManager(40, 16)
    computed(bm, "a", "acme")
    assert probe(bm, "b", "other") == 0
    assert probe(bm, "c", "acme") == 32
    computed(bm, "d", None)
    assert probe(bm, "e", None) == 32 and probe(bm, "f", "acme") == 32
