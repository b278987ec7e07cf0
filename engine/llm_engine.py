"""The synchronous engine: `add_request()` then `step()` until nothing is unfinished.

    batch  = scheduler.schedule()     # a sequence whose grammar compiles is not sampled yet
    masks  = grammars.masks(...)      # constrained rows' token masks, on a thread during the forward
    logits = runner.run(batch)
    tokens, logprobs = sample_step(logits, batch.sampling_seqs, masks)   # sampler.py, logits_processors.py
    grammars.advance(...)             # each constrained row's matcher consumes its token
    scheduler.update(batch, tokens)   # catch up, commit, charge, stop tokens, length, free
                                      # and text: stop strings finish there too
    outputs: logprobs, metrics

The step's time feeds the scheduler's token budget (budget.py), which keeps steps under
the inter-token latency target.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from . import spec_decode
from .block_manager import BlockManager
from .budget_probe import LADDER, BudgetProbe, measure
from .config import EngineConfig, SamplingParams
from .detokenizer import IncrementalDetokenizer
from .grammar_runtime import GrammarRuntime
from .metrics import EngineMetrics
from .model_runner import ModelRunner
from .prompt_logprobs import record as record_prompt_logprobs
from .prompt_logprobs import rows as prompt_logprob_rows
from .port import EngineLimits, check_request
from .sampler import sample_step
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestOutput, Sequence, SequenceStatus
from .stats import EngineStats, collect

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
        usable = self.runner.num_blocks - int(config.watermark * self.runner.num_blocks)
        capacity = usable // self.runner.kv_groups.num_groups * config.block_size
        self.max_model_len = min(config.max_model_len or self.runner.max_position_embeddings or capacity, capacity)
        if not config.chunked_prefill:           # a whole (re)computed prompt must fit one step
            self.max_model_len = min(self.max_model_len, config.max_num_batched_tokens)
        self.eos_token_ids = _eos_ids(self.tokenizer, self.runner.model)
        self.grammars = GrammarRuntime(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.budget_probe: BudgetProbe | None = None
        self._build(config if config.max_num_batched_tokens is not None else self._measure_budget(config))

    def _build(self, config: EngineConfig) -> None:
        """The scheduler's side of the engine, empty: blocks, queues, limits, metrics."""
        self.config = config
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_host_blocks=config.num_swap_blocks,
                                          windows=self.runner.kv_groups.windows)
        self.scheduler = Scheduler(config, self.block_manager, self.clock, self.max_model_len)
        self.limits = EngineLimits(
            max_model_len=self.max_model_len, vocab_size=self.vocab_size, block_size=config.block_size,
            num_kv_blocks=self.block_manager.num_blocks,
            usable_kv_blocks=self.block_manager.num_blocks - self.scheduler.watermark_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_queued_requests=config.max_queued_requests, max_queued_tokens=config.max_queued_tokens,
            kv_groups=self.block_manager.num_groups)
        self.metrics = EngineMetrics(self.snapshot)
        self.swapped_bytes = 0
        self.seqs: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []       # outputs of requests ended outside a step
        self.step_time_s = self.forward_time_s = 0.0   # the last step's
        self.num_steps = 0

    def _measure_budget(self, config: EngineConfig) -> EngineConfig:
        """`max_num_batched_tokens` "auto": time the budget ladder (budget_probe.py) on an
        engine whose budget holds its largest size, and return the config with the budget
        chosen; `_build` then starts the scheduler afresh."""
        floor = config.max_num_seqs
        ceiling = min(LADDER[-1], config.max_step_tokens, self.max_model_len - 1)
        if ceiling <= floor:
            self.budget_probe = BudgetProbe(floor)
        else:
            self._build(replace(config, max_num_batched_tokens=ceiling))
            self.budget_probe = measure(self, floor, ceiling)
        log.info(self.budget_probe.describe())
        return replace(config, max_num_batched_tokens=self.budget_probe.tokens)

    # -- requests ---------------------------------------------------------------------------
    def validate_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         priority: int = 0, deadline: float | None = None, weight: float = 1.0) -> None:
        """Raise ValueError naming the bad field; touches no engine state."""
        check_request(self.limits, request_id, prompt_token_ids, params, priority, deadline, weight)
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    priority: int = 0, tenant: str | None = None, deadline: float | None = None,
                    weight: float = 1.0, arrival_time: float | None = None, checked: bool = False) -> None:
        """Queue a request. Raises ValueError (bad input, naming the field) or
        EngineOverloaded (a queue limit is reached); either way nothing changes.
        `checked=True`: the caller ran `port.check_request` against `self.limits` already
        (AsyncEngine); the id and the queue limits are still checked here."""
        if not checked:
            check_request(self.limits, request_id, prompt_token_ids, params, priority, deadline, weight)
        if request_id in self.seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.scheduler.check_capacity(len(prompt_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, tenant=tenant,
                       deadline=deadline, arrival_time=self.clock() if arrival_time is None else arrival_time,
                       eos_token_ids=self.eos_token_ids,
                       weight=weight)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop,
                                                  params.skip_special_tokens)
        self.seqs[request_id] = seq
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
            if batch.swap_out or batch.swap_in:         # (the runner's swap enters inference mode: ~30 us cold)
                self.swapped_bytes += self.runner.swap(batch)
            if batch.drafted:
                outputs += spec_decode.step(self, batch)      # verifies proposals (speculative.py)
            elif not batch.is_empty:
                masks = self.grammars.masks(batch.sampling_seqs)      # computed during the forward
                plan = prompt_logprob_rows(batch)
                logits = self.runner.run(batch)
                if plan:                                # prompt positions' rows follow the sampled ones
                    k = len(batch.sampling_seqs)
                    record_prompt_logprobs(batch, plan, logits[k:])
                    logits = logits[:k]
                tokens, logprobs = sample_step(logits, batch.sampling_seqs, masks and masks.result(logits.device))
                self.grammars.advance(batch.sampling_seqs, tokens)
                now = self.clock()
                for j, seq in enumerate(self.scheduler.update(batch, tokens)):
                    outputs.append(self._emit(seq, now))
                    if logprobs is not None and logprobs[j] is not None and outputs[-1].new_token_ids:
                        outputs[-1].logprobs = [logprobs[j]]
            elif self.grammars.pending:
                self.grammars.wait(0.01)        # nothing to run but compiles: do not spin
        except Exception as exc:                        # fail this batch, keep serving the rest
            log.exception("step failed; failing %d requests", len(batch.seqs))
            outputs += self._fail(batch, exc)
        self.step_time_s = time.perf_counter() - start
        self.forward_time_s = self.runner.last_forward_time
        self.num_steps += 1
        self.scheduler.budget.observe(batch.num_decode_tokens, batch.num_prefill_tokens, self.step_time_s)
        return outputs

    def _emit(self, seq: Sequence, now: float) -> RequestOutput:
        """The output for the token `seq` just sampled, with the text `Scheduler.update`
        gave it (and, if that ended the request, the text still held back)."""
        if seq.params.max_tokens == 0:                  # prompt logprobs only: finished, no token
            return self._retire(seq)
        self.metrics.on_token(seq, now)
        if seq.first_token_time is None:
            seq.first_token_time = now
        text = seq.new_text
        retired = self._retire(seq) if seq.status.finished else None
        out = self._output(seq, [seq.output_token_ids[-1]], text + (retired.new_text if retired else ""))
        if retired is not None and retired.prompt_logprobs is not None:
            out.prompt_logprobs = retired.prompt_logprobs            # (taken by the retiring output)
        return out

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
        detok, seq.detokenizer = seq.detokenizer, None
        text = "" if detok.stopped or seq.finish_reason in ("abort", "error") else detok.flush()
        return self._output(seq, [], text)

    def _output(self, seq: Sequence, new_token_ids: list[int], text: str) -> RequestOutput:
        done = seq.status is SequenceStatus.FINISHED
        queued = None if seq.first_scheduled_time is None else seq.first_scheduled_time - seq.arrival_time
        out = RequestOutput(seq.request_id, new_token_ids, text, done, seq.finish_reason if done else None,
                            seq.num_prompt_tokens, seq.num_output_tokens, queue_time_s=queued,
                            num_computed_prompt_tokens=seq.num_computed_prompt_tokens)
        lps = seq.prompt_logprobs
        if lps is not None and not seq.prompt_logprobs_sent and len(lps) == seq.num_prompt_tokens:
            out.prompt_logprobs, seq.prompt_logprobs_sent = lps, True
        return out

    # -- introspection ----------------------------------------------------------------------
    def snapshot(self) -> EngineStats:
        """Queues, KV usage, the last step and the running counters, built now."""
        return collect(self)

    def stats(self) -> dict:
        """`snapshot()` as a plain dict (DESIGN.md's contract; the wire format of /v1/stats)."""
        return self.snapshot().as_dict()


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
