"""The synchronous engine: `add_request()` then `step()` until nothing is unfinished.

    batch  = scheduler.schedule()     # a sequence whose grammar compiles is not sampled yet
    masks  = grammars.masks(...)      # constrained rows' token masks, on a thread during the forward
    logits = runner.run(batch)
    tokens, logprobs = sample_step(logits, batch.sampling_seqs, masks)   # sampler.py, logits_processors.py
    grammars.advance(...)             # each constrained row's matcher consumes its token
    scheduler.update(batch, tokens)   # catch up, commit, charge, stop tokens, length, free
    outputs: detokenize (stop strings), logprobs, metrics

The step's time feeds the scheduler's token budget (budget.py), which keeps steps under
the inter-token latency target.
"""

from __future__ import annotations

import logging
import math
import time

from .block_manager import BlockManager
from .config import EngineConfig, SamplingParams
from .detokenizer import IncrementalDetokenizer
from .grammar_runtime import GrammarRuntime
from .metrics import EngineMetrics
from .model_runner import ModelRunner
from .sampler import sample_step
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestOutput, Sequence, SequenceStatus

log = logging.getLogger("streamgate.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, clock=time.monotonic):
        """`clock` (seconds, monotonic) times arrivals, deadlines and latencies; tests pass a
        fake one."""
        self.config = config
        self.clock = clock
        if config.tensor_parallel_size == 1:
            self.runner = ModelRunner(config)
        else:
            from .tp_runner import TPModelRunner

            self.runner = TPModelRunner(config)
        self.tokenizer = self.runner.tokenizer
        self.vocab_size = self.runner.vocab_size
        # One sequence must always fit alone with the watermark left free, or a long
        # preempted sequence could never be readmitted.
        # A hybrid model's prompt takes blocks in every KV-cache group at allocation.
        groups = self.runner.kv_groups
        usable = self.runner.num_blocks - int(config.watermark * self.runner.num_blocks)
        capacity = usable // groups.num_groups * config.block_size
        self.max_model_len = min(config.max_model_len or self.runner.max_position_embeddings or capacity, capacity)
        if not config.chunked_prefill:           # a whole (re)computed prompt must fit one step
            self.max_model_len = min(self.max_model_len, config.max_num_batched_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_host_blocks=config.num_swap_blocks,
                                          windows=groups.windows)
        self.scheduler = Scheduler(config, self.block_manager, clock, self.max_model_len)
        self.metrics = EngineMetrics(self.stats)
        self._swapped_bytes = 0
        self.eos_token_ids = _eos_ids(self.tokenizer, self.runner.model)
        self.grammars = GrammarRuntime(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []       # outputs of requests ended outside a step
        self._step_time = self._forward_time = 0.0
        self._num_steps = 0

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None:
        """Raise ValueError naming the bad field; touches no engine state."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string (got {request_id!r})")
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams (got {type(params).__name__})")
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must hold token ids in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt_token_ids: the prompt has {len(prompt_token_ids)} tokens but the "
                             f"context is {self.max_model_len} (max_model_len), including at least one output token")
        params.validate(self.vocab_size)
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be a 32-bit integer (got {priority!r})")
        if deadline is not None and (not isinstance(deadline, (int, float)) or not math.isfinite(deadline)):
            raise ValueError(f"deadline must be a finite time.monotonic() value or None (got {deadline!r})")
        if not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
            raise ValueError(f"weight must be a finite number > 0 (got {weight!r})")
        blocks = self.block_manager.blocks_for_all(len(prompt_token_ids) + 1)
        usable = self.block_manager.num_blocks - self.scheduler.watermark_blocks
        if blocks > usable:
            raise ValueError(f"prompt_token_ids: the prompt needs {blocks} KV blocks but only {usable} "
                             f"can ever be free (num_kv_blocks={self.block_manager.num_blocks})")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                    weight: float = 1.0, arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError (bad input, naming the field) or
        EngineOverloaded (a queue limit is reached); either way nothing changes."""
        self.validate_request(request_id, prompt_token_ids, params, priority, deadline, weight)
        self.scheduler.check_capacity(len(prompt_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, tenant=tenant,
                       deadline=deadline, arrival_time=self.clock() if arrival_time is None else arrival_time,
                       eos_token_ids=self.eos_token_ids,
                       weight=weight)
        self.seqs[request_id] = seq
        self.detoks[request_id] = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop)
        if params.grammar is not None:
            self.grammars.start(seq, self.clock())     # compiles while the prompt prefills
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        """End a request now and free its blocks; its final output comes with the next step.
        Unknown (or already finished) ids are ignored."""
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.status.finished:
            self.scheduler.finish(seq, "abort")
            self._pending.append(self._retire(seq))

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel rank failed)."""
        self.runner.check_health()

    def close(self) -> None:
        """Stop what the engine runs besides this thread (tensor-parallel ranks)."""
        self.runner.close()
        self.grammars.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs, self._pending = self._pending, []
        for seq, error in self.grammars.failures(self.clock()):
            self.scheduler.finish(seq, "error")
            outputs.append(self._retire(seq))
            outputs[-1].error = error
        batch = self.scheduler.schedule()
        outputs += [self._retire(seq) for seq in batch.finished]      # deadlines
        self.runner.last_forward_time = 0.0
        try:
            self._swapped_bytes += self.runner.swap(batch)
            if not batch.is_empty:
                masks = self.grammars.masks(batch.sampling_seqs)      # computed during the forward
                logits = self.runner.run(batch)
                tokens, logprobs = sample_step(logits, batch.sampling_seqs, masks and masks.result(logits.device))
                self.grammars.advance(batch.sampling_seqs, tokens)
                now = self.clock()
                for j, seq in enumerate(self.scheduler.update(batch, tokens)):
                    outputs.append(self._emit(seq, now))
                    outputs[-1].logprobs = None if logprobs is None or logprobs[j] is None else [logprobs[j]]
            elif self.grammars.pending:
                self.grammars.wait(0.01)        # nothing to run but compiles: do not spin
        except Exception as exc:                        # fail this batch, keep serving the rest
            log.exception("step failed; failing %d requests", len(batch.seqs))
            outputs += self._fail(batch, exc)
        self._step_time = time.perf_counter() - start
        self._forward_time = self.runner.last_forward_time
        self._num_steps += 1
        self.scheduler.budget.observe(batch.num_decode_tokens, batch.num_prefill_tokens, self._step_time)
        return outputs

    def _emit(self, seq: Sequence, now: float) -> RequestOutput:
        """The output for the token `seq` just sampled: its text (none for a stop token),
        ending the request here if a stop string appeared (which outranks 'length')."""
        token = seq.output_token_ids[-1]
        self.metrics.on_token(seq, now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        detok = self.detoks[seq.request_id]
        text = "" if seq.finish_reason == "stop" else detok.add_token(token)
        if detok.stopped:
            if seq.status.finished:
                seq.finish_reason = "stop"
            else:
                self.scheduler.finish(seq, "stop")
        if seq.status.finished:
            text += self._retire(seq).new_text
        return self._output(seq, [token], text)

    def _fail(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        outputs = []
        # Sequences swapped out this step may hold a half-copied host image: fail them too.
        swapped = [s for s in batch.preempted if s.status is SequenceStatus.SWAPPED]
        for seq in batch.seqs + swapped:
            if seq.request_id not in self.seqs:
                continue                                 # already retired (its final output is out)
            if not seq.status.finished:
                self.scheduler.finish(seq, "error")
            out = self._retire(seq)
            out.error = f"{type(exc).__name__}: {exc}"
            outputs.append(out)
        return outputs

    def _retire(self, seq: Sequence) -> RequestOutput:
        """Forget a finished sequence; returns its final output (for requests the scheduler
        ended, e.g. by deadline). Any text still held back is released."""
        self.metrics.on_finish(seq, self.clock())
        del self.seqs[seq.request_id]
        detok = self.detoks.pop(seq.request_id)
        text = "" if detok.stopped or seq.finish_reason in ("abort", "error") else detok.flush()
        return self._output(seq, [], text)

    def _output(self, seq: Sequence, new_token_ids: list[int], text: str) -> RequestOutput:
        done = seq.status is SequenceStatus.FINISHED
        queued = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
        return RequestOutput(seq.request_id, new_token_ids, text, done, seq.finish_reason if done else None,
                             seq.num_prompt_tokens, seq.num_output_tokens, queue_time_s=queued,
                             num_computed_prompt_tokens=min(seq.num_computed_tokens, seq.num_prompt_tokens))

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict:
        """A plain-dict snapshot of queues, KV usage, the last step and cumulative counters."""
        bm, sched, last, c = self.block_manager, self.scheduler, self.scheduler.last_output, self.scheduler.counters
        cfg, now = self.config, self.clock()
        filled: dict[int, int] = {}
        for seq in list(sched.running):
            for table in list(seq.block_tables):
                for i, bid in enumerate(list(table)):
                    if bid < 0:                          # returned by the sliding window
                        continue
                    filled[bid] = max(filled.get(bid, 0), min(bm.block_size, seq.num_computed_tokens - i * bm.block_size))
        fair = getattr(sched.policy, "counters", {})
        return {
            "waiting": len(sched.waiting),
            "running": len(sched.running),
            "swapped": len(sched.swapped),
            "batch_occupancy": len(sched.running) / cfg.max_num_seqs,
            "kv_blocks_used": bm.num_used_blocks,
            "kv_blocks_total": bm.num_blocks,
            "kv_cache_usage": bm.num_used_blocks / bm.num_blocks,
            "kv_slots_used": sum(max(0, f) for f in filled.values()),
            "host_blocks_used": bm.num_host_blocks - len(bm.host_free) - len(bm.host_pending),
            "host_blocks_total": bm.num_host_blocks,
            "block_size": bm.block_size,
            "prefix_cache_hit_tokens": bm.prefix_hit_tokens,
            "prefix_cache_query_tokens": bm.prefix_query_tokens,
            "prefix_cache_hit_rate": bm.prefix_hit_tokens / max(1, bm.prefix_query_tokens),
            "num_batched_tokens": last.num_batched_tokens,
            "num_decode_tokens": last.num_decode_tokens,
            "num_prefill_tokens": last.num_prefill_tokens,
            "num_seqs_scheduled": len(last.seqs),
            "token_budget_usage": last.num_batched_tokens / max(1, last.token_budget),
            "token_budget": last.token_budget,
            "seat_preemptions": c.seat_preemptions,
            "num_preemptions": c.preemptions,
            "preemptions_recompute": c.preemptions_recompute,
            "preemptions_swap": c.preemptions_swap,
            "recomputed_tokens": c.recomputed_tokens,
            "swapped_bytes": self._swapped_bytes,
            "deadline_drops": c.deadline_drops,
            "deadline_finishes": c.deadline_finishes,
            "rejections": c.rejections,
            "starving": sum(1 for s in list(sched.waiting) if now - s.arrival_time > cfg.starvation_threshold_s),
            "prompt_tokens": c.prompt_tokens,
            "generation_tokens": c.generation_tokens,
            "tenant_served_tokens": {t: tuple(v) for t, v in dict(c.served).items()},
            "fair_counters": {str(t or ""): v for t, v in dict(fair).items()},
            "step_time_s": self._step_time,
            "forward_time_s": self._forward_time,
            "num_steps": self._num_steps,
            "max_model_len": self.max_model_len,
        }


def _eos_ids(tokenizer, model) -> frozenset[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(eos)
    return frozenset(ids)
