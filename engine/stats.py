"""The engine's statistics snapshot: queues, KV usage, the last step and running counters.

`EngineStats` is frozen and built on the engine thread (`collect(engine)`), only when
someone asks: `LLMEngine.snapshot()`, `AsyncEngine.stats()` (a subscriber's tick, a
scrape). Readers use its fields; `as_dict()` is the wire format of `GET /v1/stats` and
`LLMEngine.stats()` (DESIGN.md's plain-dict snapshot), converted at that edge only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

_EMPTY: Mapping = MappingProxyType({})


@dataclass(frozen=True)
class EngineStats:
    # queues
    waiting: int = 0                 # queued, not yet scheduled (AsyncEngine: with pending_adds)
    running: int = 0
    swapped: int = 0
    pending_adds: int = 0            # AsyncEngine: sent to the engine thread, not yet queued
    starving: int = 0                # waiting longer than starvation_threshold_s
    batch_occupancy: float = 0.0     # running / max_num_seqs
    # KV cache
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_cache_usage: float = 0.0
    kv_slots_used: int = 0
    host_blocks_used: int = 0
    host_blocks_total: int = 0
    block_size: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_rate: float = 0.0
    # the last step
    num_batched_tokens: int = 0
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_seqs_scheduled: int = 0
    token_budget_usage: float = 0.0
    token_budget: int = 0
    step_time_s: float = 0.0
    forward_time_s: float = 0.0
    # running counters
    num_steps: int = 0
    seat_preemptions: int = 0
    num_preemptions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0
    recomputed_tokens: int = 0
    swapped_bytes: int = 0
    deadline_drops: int = 0
    deadline_finishes: int = 0
    rejections: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    tenant_served_tokens: Mapping[str, tuple[int, int]] = field(default_factory=lambda: _EMPTY)   # (input, output)
    fair_counters: Mapping[str, float] = field(default_factory=lambda: _EMPTY)                   # the fair policy's VTC
    max_model_len: int = 0
    # speculative decoding (speculative.py): drafts proposed and accepted, verified rows
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_verified_rows: int = 0
    spec_acceptance_rate: float = 0.0

    def as_dict(self) -> dict:
        """The wire format: every field by name, mappings as plain dicts."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["tenant_served_tokens"] = dict(self.tenant_served_tokens)
        d["fair_counters"] = dict(self.fair_counters)
        return d


def collect(engine) -> EngineStats:
    """Build a snapshot of `engine` (an LLMEngine), on its thread."""
    bm, sched, last, c = engine.block_manager, engine.scheduler, engine.scheduler.last_output, engine.scheduler.counters
    cfg, now = engine.config, engine.clock()
    filled: dict[int, int] = {}
    for seq in sched.running:
        for table in seq.block_tables:
            for i, bid in enumerate(table):
                if bid < 0:                          # returned by the sliding window
                    continue
                filled[bid] = max(filled.get(bid, 0), min(bm.block_size, seq.num_computed_tokens - i * bm.block_size))
    fair = getattr(sched.policy, "counters", {})
    return EngineStats(
        waiting=len(sched.waiting),
        running=len(sched.running),
        swapped=len(sched.swapped),
        starving=sum(1 for s in sched.waiting if now - s.arrival_time > cfg.starvation_threshold_s),
        batch_occupancy=len(sched.running) / cfg.max_num_seqs,
        kv_blocks_used=bm.num_used_blocks,
        kv_blocks_total=bm.num_blocks,
        kv_cache_usage=bm.num_used_blocks / bm.num_blocks,
        kv_slots_used=sum(max(0, f) for f in filled.values()),
        host_blocks_used=bm.num_host_blocks - len(bm.host_free) - len(bm.host_pending),
        host_blocks_total=bm.num_host_blocks,
        block_size=bm.block_size,
        prefix_cache_hit_tokens=bm.prefix_hit_tokens,
        prefix_cache_query_tokens=bm.prefix_query_tokens,
        prefix_cache_hit_rate=bm.prefix_hit_tokens / max(1, bm.prefix_query_tokens),
        num_batched_tokens=last.num_batched_tokens,
        num_decode_tokens=last.num_decode_tokens,
        num_prefill_tokens=last.num_prefill_tokens,
        num_seqs_scheduled=len(last.seqs),
        token_budget_usage=last.num_batched_tokens / max(1, last.token_budget),
        token_budget=last.token_budget,
        step_time_s=engine.step_time_s,
        forward_time_s=engine.forward_time_s,
        num_steps=engine.num_steps,
        seat_preemptions=c.seat_preemptions,
        num_preemptions=c.preemptions,
        preemptions_recompute=c.preemptions_recompute,
        preemptions_swap=c.preemptions_swap,
        recomputed_tokens=c.recomputed_tokens,
        swapped_bytes=engine.swapped_bytes,
        deadline_drops=c.deadline_drops,
        deadline_finishes=c.deadline_finishes,
        rejections=c.rejections,
        prompt_tokens=c.prompt_tokens,
        generation_tokens=c.generation_tokens,
        tenant_served_tokens=MappingProxyType({t: tuple(v) for t, v in c.served.items()}),
        fair_counters=MappingProxyType({str(t or ""): v for t, v in dict(fair).items()}),
        max_model_len=engine.max_model_len,
        **sched.speculator.stats(),
    )
