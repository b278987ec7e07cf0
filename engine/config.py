"""Engine and sampling configuration: frozen, validated at construction or admission."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .grammar import Grammar

POLICIES = ("fcfs", "priority", "cost", "fair")
BATCHING = ("continuous", "static")
PREEMPTION_MODES = ("auto", "recompute", "swap")
DTYPES = ("float32", "bfloat16", "float16", "auto")   # "auto": see dtypes.resolve_dtype
ATTENTION_BACKENDS = ("auto", "kernel", "torch")
QUANTIZATIONS = (None, "int8")                        # weight-only, engine/quantization.py
MAX_LOGPROBS = 20                       # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. Invalid values raise ValueError naming the field."""

    model: str = "default"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None      # None: sized from kv_cache_memory_gb
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None      # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    preemption_mode: str = "auto"
    num_swap_blocks: int = 0
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU, 90% of free memory on CUDA
    watermark: float = 0.01               # share of KV blocks kept free at admission
    chunked_prefill: bool = True          # False: prefill-first, unchunked (for comparison)
    batching: str = "continuous"          # "static": request-level batches (for comparison)
    aging_rate: float = 0.1               # priority classes gained per second of waiting
    preempt_for_priority: bool | None = None  # None: on for "priority" and "fair" (seat share)
    swap_min_tokens: int = 256            # auto mode: swap sequences at least this long
    max_queued_requests: int = 4096       # beyond this add_request raises EngineOverloaded
    max_queued_tokens: int = 4 * 1024 * 1024
    starvation_threshold_s: float = 30.0  # waiting longer than this counts as starving
    seed: int = 0
    # -- engine speed (issue 14, branch `speed`) --
    attention_backend: str = "auto"       # "kernel": C++ paged attention (CPU), "torch": gather + SDPA,
                                          # "auto": the kernel on CPU where it builds, else torch
    packed_linear: bool | None = None     # packed linear layers; None: on for eager fp32 on CPU (§8.12, §8.13)
    fused_layers: bool | None = None      # fused Llama forward (fused_llama.py); None: on where packed linears are
    compile: bool = False                 # torch.compile the model (dynamic batch size; opt-in: see docs/BENCHMARKS.md §8.3)
    cuda_graphs: bool = True              # with compile on CUDA: decode steps replay CUDA graphs per batch bucket
    adaptive_threads: bool = True         # CPU eager: steps of <= 4 tokens on 1 thread or all, whichever measures faster (threads.py)
    # -- scheduling: fair seats and the adaptive token budget (issues 11 and 14) -----------
    # With a target, steps may grow past max_num_batched_tokens while they stay this long
    # (measured) and, while streams decode, within 2x their decode-only step; up to
    # max_step_tokens. Off by default: batch composition then never depends on wall-clock
    # time, and on CPU it gains a burst's TTFT 0-2 % (docs/BENCHMARKS.md §9.7).
    itl_target_ms: float | None = None
    max_step_tokens: int = 4096
    seat_quantum_steps: int = 2           # steps a sequence runs after (re)admission before it may lose its seat
    max_seat_preemptions: int = 2         # times a sequence may lose its seat to an arrival
    fair_burst_tokens: int = 1024         # fair: service a light tenant may bank for its bursts (policy.py)
    # priority: a less urgent class's prompts wait a step rather than join the step that admits a
    # more urgent class's prompt, whose first token would wait for them (Policy.may_share_step;
    # measured under fair too, where it did not pay: docs/BENCHMARKS.md §9.14)
    isolate_prompts: bool = True
    # Prompts that yield compute at most this many tokens a step, together, so an arrival that
    # they yield to waits for a short step, not a 512-token prefill (Policy.prompt_cap;
    # docs/BENCHMARKS.md §9.15). priority: less urgent classes' while a more urgent class
    # has arrived within the last minute; fair: a tenant's served ahead of another tenant
    # that has. 0: off.
    yielding_prompt_tokens: int = 64
    # -- tensor parallelism (issue 13): N ranks, one per device; see docs/ENGINE.md ------------
    tensor_parallel_size: int = 1         # 1: one process, no torch.distributed
    tp_timeout_s: float = 30.0            # a collective (or a silent rank) failing past this fails the engine
    # -- int8 weight-only linears (issue 29, engine/quantization.py): None or "int8"; CPU, eager, one process
    quantization: str | None = None
    # -- speculative decoding without a draft model (issue 29 item 3, engine/speculative.py) ---------
    # n-gram / prompt-lookup proposals from each sequence's own tokens, verified in the step.
    num_speculative_tokens: int = 0      # proposed tokens a step per sequence; 0: off
    speculative_ngram_min: int = 2       # shortest suffix n-gram that may be matched
    speculative_ngram_max: int = 4       # longest suffix n-gram tried first
    speculative_min_acceptance: float = 0.3   # below this recent acceptance a sequence stops proposing a while

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"EngineConfig.{name}: {msg} (got {getattr(self, name)!r})")

        need(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        need(self.device == "cpu" or self.device.startswith("cuda"), "device", "must be 'cpu' or 'cuda[:N]'")
        need(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}")
        need(_is_int(self.block_size) and self.block_size > 0, "block_size", "must be a positive int")
        need(self.num_kv_blocks is None or (_is_int(self.num_kv_blocks) and self.num_kv_blocks > 0),
             "num_kv_blocks", "must be None or a positive int")
        need(_is_int(self.max_num_seqs) and self.max_num_seqs > 0, "max_num_seqs", "must be a positive int")
        need(_is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= self.max_num_seqs,
             "max_num_batched_tokens", "must be an int >= max_num_seqs (every running sequence needs its decode token)")
        need(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len > 1),
             "max_model_len", "must be None or an int > 1")
        need(self.policy in POLICIES, "policy", f"must be one of {POLICIES}")
        need(self.batching in BATCHING, "batching", f"must be one of {BATCHING}")
        need(self.preemption_mode in PREEMPTION_MODES, "preemption_mode", f"must be one of {PREEMPTION_MODES}")
        need(_is_int(self.num_swap_blocks) and self.num_swap_blocks >= 0, "num_swap_blocks", "must be an int >= 0")
        need(self.kv_cache_memory_gb is None or self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", "must be > 0")
        need(0.0 <= self.watermark < 1.0, "watermark", "must be in [0, 1)")
        need(self.aging_rate >= 0, "aging_rate", "must be >= 0")
        need(_is_int(self.swap_min_tokens) and self.swap_min_tokens >= 0, "swap_min_tokens", "must be an int >= 0")
        need(_is_int(self.max_queued_requests) and self.max_queued_requests > 0, "max_queued_requests", "must be > 0")
        need(_is_int(self.max_queued_tokens) and self.max_queued_tokens > 0, "max_queued_tokens", "must be > 0")
        need(self.starvation_threshold_s > 0, "starvation_threshold_s", "must be > 0")
        need(self.itl_target_ms is None or (isinstance(self.itl_target_ms, (int, float)) and self.itl_target_ms > 0),
             "itl_target_ms", "must be None or > 0")
        need(_is_int(self.max_step_tokens) and self.max_step_tokens >= self.max_num_batched_tokens, "max_step_tokens",
             "must be an int >= max_num_batched_tokens")
        need(_is_int(self.seat_quantum_steps) and self.seat_quantum_steps >= 0, "seat_quantum_steps", "must be an int >= 0")
        need(_is_int(self.max_seat_preemptions) and self.max_seat_preemptions >= 0, "max_seat_preemptions",
             "must be an int >= 0")
        need(_is_int(self.fair_burst_tokens) and self.fair_burst_tokens >= 0, "fair_burst_tokens", "must be an int >= 0")
        need(isinstance(self.isolate_prompts, bool), "isolate_prompts", "must be a bool")
        need(_is_int(self.yielding_prompt_tokens) and self.yielding_prompt_tokens >= 0,
             "yielding_prompt_tokens", "must be an int >= 0")
        need(self.preemption_mode != "swap" or self.num_swap_blocks > 0, "num_swap_blocks",
             "must be > 0 when preemption_mode is 'swap'")
        # -- engine speed (issue 14) --
        need(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        need(self.attention_backend != "kernel" or self.device == "cpu", "attention_backend",
             "'kernel' is the CPU kernel; use 'auto' or 'torch' on CUDA")
        need(isinstance(self.compile, bool), "compile", "must be a bool")
        need(self.packed_linear in (None, True, False), "packed_linear", "must be None, True or False")
        need(self.fused_layers in (None, True, False), "fused_layers", "must be None, True or False")
        need(isinstance(self.cuda_graphs, bool), "cuda_graphs", "must be a bool")
        need(_is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1, "tensor_parallel_size",
             "must be an int >= 1")
        need(self.tensor_parallel_size == 1 or not self.compile, "compile",
             "is not supported with tensor_parallel_size > 1")
        need(self.tensor_parallel_size == 1 or self.device in ("cpu", "cuda"), "device",
             "must be 'cpu' or 'cuda' with tensor_parallel_size > 1 (rank r uses cuda:r)")
        need(isinstance(self.tp_timeout_s, (int, float)) and self.tp_timeout_s > 0, "tp_timeout_s", "must be > 0")
        need(self.quantization in QUANTIZATIONS, "quantization", f"must be one of {QUANTIZATIONS}")
        need(self.quantization is None or (self.device == "cpu" and not self.compile and self.tensor_parallel_size == 1),
             "quantization", "int8 runs on CPU, eager (compile off), with tensor_parallel_size 1")
        need(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 16,
             "num_speculative_tokens", "must be an int in [0, 16]")
        need(_is_int(self.speculative_ngram_min) and self.speculative_ngram_min >= 1, "speculative_ngram_min",
             "must be an int >= 1")
        need(_is_int(self.speculative_ngram_max) and self.speculative_ngram_min <= self.speculative_ngram_max <= 16,
             "speculative_ngram_max", "must be an int in [speculative_ngram_min, 16]")
        need(_is_num(self.speculative_min_acceptance) and 0.0 <= self.speculative_min_acceptance <= 1.0,
             "speculative_min_acceptance", "must be a number in [0, 1]")
        need(not self.num_speculative_tokens or self.tensor_parallel_size == 1, "num_speculative_tokens",
             "speculative decoding is not supported with tensor_parallel_size > 1 (set one of them off)")
        if not self.chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 "must be >= max_model_len when chunked_prefill is off (a whole prompt runs in one step)")

    @property
    def priority_preemption(self) -> bool:
        if self.preempt_for_priority is None:
            return self.policy in ("priority", "fair")
        return self.preempt_for_priority


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    Validated by `validate()`, which `LLMEngine.add_request` calls, so a bad value is
    reported at admission with the field's name.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # -- the OpenAI/vLLM sampling surface (issue 27); the sampler's order is in sampler.py --
    presence_penalty: float = 0.0       # OpenAI: minus this for a token generated at least once
    frequency_penalty: float = 0.0      # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0     # HF/vLLM: logits of prompt+output tokens / (or *) this
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict is accepted
    min_p: float = 0.0                  # drop tokens below min_p * the most likely token's probability
    logprobs: int | None = None         # None: none; 0: the chosen token's; k <= 20: and the top k
    prompt_logprobs: int | None = None  # not implemented: validate() refuses anything but None
    grammar: Grammar | None = None      # constrained decoding (engine/grammar.py)

    def __post_init__(self) -> None:
        # Accept lists (JSON bodies) and a single string for `stop`; store tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            bias = tuple(sorted((int(t) if isinstance(t, str) and t.strip().lstrip("-").isdigit() else t, b)
                                for t, b in (bias or ())))
        except (TypeError, ValueError):
            bias = tuple(bias) if isinstance(bias, (list, tuple)) else bias   # validate() names it
        object.__setattr__(self, "logit_bias", bias)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer (got {self.max_tokens!r})")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (got {self.temperature!r})")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        if not _is_int(self.top_k) or not 0 <= self.top_k < 2**31:
            raise ValueError(f"top_k must be an integer in [0, 2**31) (got {self.top_k!r})")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer or None (got {self.seed!r})")
        if self.max_tokens >= 2**31:
            raise ValueError(f"max_tokens must be < 2**31 (got {self.max_tokens!r})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings (got {self.stop!r})")
        limit = vocab_size if vocab_size is not None else float("inf")
        if not all(_is_int(t) and 0 <= t < limit for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {limit}) (got {self.stop_token_ids!r})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2] (got {v!r})")
        if not _is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 100.0:
            raise ValueError(f"repetition_penalty must be a number in (0, 100] (got {self.repetition_penalty!r})")
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > 1024 or not all(
                isinstance(e, tuple) and len(e) == 2 and _is_int(e[0]) and 0 <= e[0] < limit
                and _is_num(e[1]) and -100.0 <= e[1] <= 100.0 for e in bias):
            raise ValueError(f"logit_bias must map at most 1024 token ids in [0, {limit}) to numbers in "
                             f"[-100, 100] (got {_short(bias)})")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError(f"logit_bias names a token id twice (got {_short(bias)})")
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be a number in [0, 1] (got {self.min_p!r})")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (got {self.logprobs!r})")
        if self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported by this engine (got "
                             f"{self.prompt_logprobs!r}; leave it None)")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError(f"grammar must be an engine.Grammar or None (got {type(self.grammar).__name__})")
            if self.ignore_eos:
                raise ValueError("grammar: cannot be combined with ignore_eos (the grammar ends the output with EOS)")
            self.grammar.check()



def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _short(x: object) -> str:
    r = repr(x)
    return r if len(r) <= 120 else r[:117] + "..."


__all__ = ["EngineConfig", "SamplingParams", "POLICIES", "PREEMPTION_MODES", "DTYPES"]
