"""Engine and sampling configuration: frozen, validated at construction or admission.

EngineConfig composes one section per concern (engine/config_sections.py): ModelConfig,
CacheConfig, SchedulerConfig, ForwardConfig, ParallelConfig, SpeculativeConfig. Its flat keywords and attributes
(`EngineConfig(model=..., max_num_seqs=...)`, `config.max_num_seqs`) are DESIGN.md's engine
contract, kept as an adapter: each flat name is exactly one section's field."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import Field, dataclass, fields, replace
from operator import attrgetter

from .config_fields import _is_int, _is_num, fail
from .config_sections import (ATTENTION_BACKENDS, BATCHING, DTYPES, POLICIES, PREEMPTION_MODES, QUANTIZATIONS,
                              CacheConfig, ForwardConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                              SpeculativeConfig)
from .grammar import Grammar

MAX_LOGPROBS = 20                       # OpenAI's top_logprobs limit

SECTIONS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
            "forward_config": ForwardConfig, "parallel_config": ParallelConfig,
            "speculative_config": SpeculativeConfig}


@dataclass(frozen=True, init=False)
class EngineConfig:
    """Everything the engine needs to start. Invalid values raise ValueError naming the field.

    `EngineConfig(max_num_seqs=8, policy="fair")` and `EngineConfig(scheduler_config=...)` both
    work (a flat keyword overrides its section's field); `dataclasses.replace(config, device=...)`
    too. Every section field reads flat: `config.max_num_seqs`."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    forward_config: ForwardConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig

    def __init__(self, **kw: object) -> None:
        unknown = sorted(set(kw) - set(SECTIONS) - set(_SECTION_OF))
        if unknown:
            raise TypeError(f"EngineConfig got an unexpected keyword argument {unknown[0]!r}")
        for attr, cls in SECTIONS.items():
            section = kw.get(attr) or cls()
            if not isinstance(section, cls):
                raise TypeError(f"EngineConfig.{attr} must be a {cls.__name__} (got {type(section).__name__})")
            own = {name: kw[name] for name in kw if _SECTION_OF.get(name) == attr}
            object.__setattr__(self, attr, replace(section, **own) if own else section)
        self._check_across()

    def _check_across(self) -> None:
        """Relations between fields of different sections."""
        def need(ok: bool, name: str, says: str) -> None:
            if not ok:
                fail(name, getattr(self, name), says)

        need(self.preemption_mode != "swap" or self.num_swap_blocks > 0, "num_swap_blocks",
             "must be > 0 when preemption_mode is 'swap'")
        need(self.attention_backend != "kernel" or self.device == "cpu", "attention_backend",
             "'kernel' is the CPU kernel; use 'auto' or 'torch' on CUDA")
        need(self.tensor_parallel_size == 1 or not self.compile, "compile",
             "is not supported with tensor_parallel_size > 1")
        need(self.tensor_parallel_size == 1 or self.device in ("cpu", "cuda"), "device",
             "must be 'cpu' or 'cuda' with tensor_parallel_size > 1 (rank r uses cuda:r)")
        need(self.quantization is None or (self.device == "cpu" and not self.compile and self.tensor_parallel_size == 1),
             "quantization", "int8 runs on CPU, eager (compile off), with tensor_parallel_size 1")
        need(self.kv_cache_dtype is None or (self.device == "cpu" and not self.compile), "kv_cache_dtype",
             "int8 runs on CPU, eager (compile off)")
        if not self.chunked_prefill and self.max_model_len is not None:
            need(self.max_num_batched_tokens >= self.max_model_len, "max_num_batched_tokens",
                 "must be >= max_model_len when chunked_prefill is off (a whole prompt runs in one step)")

    @staticmethod
    def knobs() -> Iterator[tuple[str, Field]]:
        """(section attribute, field) for every flat field, in section order."""
        for attr, cls in SECTIONS.items():
            for f in fields(cls):
                yield attr, f

    def flat(self) -> dict[str, object]:
        """{field: value} for every flat field (for logs and benchmark results)."""
        return {f.name: getattr(self, f.name) for _, f in self.knobs()}

    @property
    def priority_preemption(self) -> bool:
        return self.scheduler_config.priority_preemption


assert [f.name for f in fields(EngineConfig)] == list(SECTIONS), "EngineConfig's fields are SECTIONS' keys"
_SECTION_OF = {f.name: attr for attr, f in EngineConfig.knobs()}
assert len(_SECTION_OF) == sum(len(fields(c)) for c in SECTIONS.values()), "a field name in two sections"
for _name, _attr in _SECTION_OF.items():
    assert not hasattr(EngineConfig, _name), f"EngineConfig.{_name} is taken"
    setattr(EngineConfig, _name, property(attrgetter(f"{_attr}.{_name}")))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. temperature 0 means greedy.

    Validated by `validate()`, which `LLMEngine.add_request` calls, so a bad value is
    reported at admission with the field's name.
    """

    max_tokens: int = 16                # 0 (with prompt_logprobs): score the prompt, generate nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True    # False: special tokens' text is output (gpt-oss's harmony markers)
    # -- the OpenAI/vLLM sampling surface (issue 27); the sampler's order is in sampler.py --
    presence_penalty: float = 0.0       # OpenAI: minus this for a token generated at least once
    frequency_penalty: float = 0.0      # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0     # HF/vLLM: logits of prompt+output tokens / (or *) this
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias in [-100, 100]); a dict is accepted
    min_p: float = 0.0                  # drop tokens below min_p * the most likely token's probability
    logprobs: int | None = None         # None: none; 0: the chosen token's; k <= 20: and the top k
    prompt_logprobs: int | None = None  # None: none; k <= 20: each prompt token's and the top k (prompt_logprobs.py)
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
        if not _is_int(self.max_tokens) or self.max_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_tokens must be a positive integer, or 0 with prompt_logprobs (got {self.max_tokens!r})")
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
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}] "
                             f"(got {self.prompt_logprobs!r})")
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise ValueError(f"grammar must be an engine.Grammar or None (got {type(self.grammar).__name__})")
            if self.ignore_eos:
                raise ValueError("grammar: cannot be combined with ignore_eos (the grammar ends the output with EOS)")
            if self.max_tokens == 0:
                raise ValueError("grammar: cannot be combined with max_tokens 0 (nothing is generated)")
            self.grammar.check()



def _short(x: object) -> str:
    r = repr(x)
    return r if len(r) <= 120 else r[:117] + "..."


__all__ = ["EngineConfig", "SamplingParams", "SECTIONS", "ModelConfig", "CacheConfig", "SchedulerConfig",
           "ForwardConfig", "ParallelConfig", "SpeculativeConfig", "POLICIES", "PREEMPTION_MODES", "DTYPES", "BATCHING",
           "ATTENTION_BACKENDS", "QUANTIZATIONS"]
