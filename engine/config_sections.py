"""EngineConfig's sections, one per concern. A new knob is one line in one of these classes:
`name: type = knob(default, "help", check=...)`; EngineConfig's flat keyword and attribute,
and the `--name` flag of `streamgate serve`, `chat` and the benchmarks, follow from it."""

from __future__ import annotations

from dataclasses import dataclass

from .config_fields import NONNEGATIVE, NONNEGATIVE_INT, POSITIVE, POSITIVE_INT, Check, Section, _is_int, _is_num, knob

POLICIES = ("fcfs", "priority", "cost", "fair")
BATCHING = ("continuous", "static")
PREEMPTION_MODES = ("auto", "recompute", "swap")
DTYPES = ("float32", "bfloat16", "float16", "auto")   # "auto": see dtypes.resolve_dtype
ATTENTION_BACKENDS = ("auto", "kernel", "torch")
QUANTIZATIONS = ("int8",)                             # weight-only, engine/quantization.py
KV_CACHE_DTYPES = ("int8",)                           # engine/kv_cache.py, csrc/kv_int8.h


@dataclass(frozen=True)
class ModelConfig(Section):
    """model: which weights, where, in which dtype"""

    model: str = knob("default", "'default' (SmolLM2-135M-Instruct), a local HF directory or a hub id",
                      check=Check(lambda v: isinstance(v, str) and bool(v), "must be a non-empty string"))
    device: str = knob("cpu", "cpu or cuda[:N]", check=Check(
        lambda v: isinstance(v, str) and (v == "cpu" or v.startswith("cuda")), "must be 'cpu' or 'cuda[:N]'"))
    # One default for the library and every command: float32, the one dtype whose tokens do not
    # depend on the host (auto is bfloat16 on one CPU and float32 on the next) and the dtype of
    # the engine's parity contract with HF generate. Serving, `--dtype auto` is the fast choice.
    dtype: str = knob("float32", "float32, bfloat16, float16, or auto: bfloat16 on CUDA, on CPUs with "
                      "AVX512-BF16 or AMX, and on other AVX-512 CPUs where the fused forward runs the model, else "
                      "float32 (faster; tokens then depend on the host)", choices=DTYPES)
    max_model_len: int | None = knob(None, "longest prompt + output a request may have",
                                     check=Check(lambda v: _is_int(v) and v > 1, "must be an int > 1"),
                                     none="auto: the model's max_position_embeddings")
    quantization: str | None = knob(None, "int8: weight-only int8 linear layers (CPU, eager, one process)",
                                    choices=QUANTIZATIONS, none="none: the checkpoint's weights")


@dataclass(frozen=True)
class CacheConfig(Section):
    """cache: the paged KV cache and its host swap pool"""

    block_size: int = knob(16, "tokens per KV block", check=POSITIVE_INT)
    num_kv_blocks: int | None = knob(None, "KV blocks on the device", check=POSITIVE_INT,
                                     none="auto: sized from kv_cache_memory_gb")
    kv_cache_memory_gb: float | None = knob(None, "memory for the KV cache, GiB", check=POSITIVE,
                                            none="auto: 1 GiB on CPU, 90% of free memory on CUDA")
    watermark: float = knob(0.01, "share of KV blocks kept free at admission",
                            check=Check(lambda v: isinstance(v, (int, float)) and 0.0 <= v < 1.0, "must be in [0, 1)"))
    enable_prefix_caching: bool = knob(True, "share the KV blocks of a common prompt prefix between requests")
    num_swap_blocks: int = knob(0, "KV blocks in the host swap pool (preemption by swap)", check=NONNEGATIVE_INT)
    kv_cache_populate: bool = knob(True, "fault the CPU KV pool's pages in from the start, in the background "
                                   "on idle CPU, so steps do not (off: a page is resident once first written)")
    kv_cache_dtype: str | None = knob(None, "int8: keys and values as int8 with a scale per token and head "
                                      "(half the bytes decode attention reads, twice the tokens per GiB; "
                                      "CPU, eager; tokens may differ from the model dtype's)",
                                      choices=KV_CACHE_DTYPES, none="auto: the model's dtype")


@dataclass(frozen=True)
class SchedulerConfig(Section):
    """scheduler: what each step runs, who goes first, who is preempted"""

    max_num_seqs: int = knob(64, "sequences running at once", check=POSITIVE_INT)
    max_num_batched_tokens: int | None = knob(512, "a step's token budget (>= max_num_seqs: each running "
                                              "sequence needs its decode token)", check=POSITIVE_INT,
                                              none="auto: measured at start, the smallest step whose prompt "
                                              "tokens cost within 2% of a full step's (a fit of the measured "
                                              "curve: budget_probe.py), at most a 1 s step")
    chunked_prefill: bool = knob(True, "split long prompts over steps (off: prefill-first, unchunked, "
                                 "for comparison)")
    batching: str = knob("continuous", "static: request-level batches (for comparison)", choices=BATCHING)
    policy: str = knob("fcfs", "who is served first", choices=POLICIES)
    aging_rate: float = knob(0.1, "priority classes a waiting request gains per second", check=NONNEGATIVE)
    preemption_mode: str = knob("auto", "how KV blocks are freed when they run low", choices=PREEMPTION_MODES)
    preempt_for_priority: bool | None = knob(None, "let an arrival preempt running sequences",
                                             none="auto: on for policy priority and fair (by seat share)")
    swap_min_tokens: int = knob(256, "preemption_mode auto: swap sequences at least this long, recompute "
                                "shorter ones", check=NONNEGATIVE_INT)
    max_queued_requests: int = knob(4096, "waiting requests past which add_request refuses (overloaded)",
                                    check=POSITIVE_INT)
    max_queued_tokens: int = knob(4 * 1024 * 1024, "waiting prompt tokens past which add_request refuses",
                                  check=POSITIVE_INT)
    starvation_threshold_s: float = knob(30.0, "seconds of waiting after which a request counts as starving",
                                         check=POSITIVE)
    itl_target_ms: float | None = knob(None, "let a step grow past max_num_batched_tokens (up to max_step_tokens, "
                                       "and while streams decode within 2x their decode-only step) while its "
                                       "measured time stays under this", check=POSITIVE,
                                       none="off: a fixed budget, so batches never depend on wall-clock time")
    max_step_tokens: int = knob(4096, "cap on an adaptive step's tokens (>= max_num_batched_tokens)",
                                check=POSITIVE_INT)
    seat_quantum_steps: int = knob(2, "steps a sequence runs after (re)admission before it may lose its seat",
                                   check=NONNEGATIVE_INT)
    max_seat_preemptions: int = knob(2, "times a sequence may lose its seat to an arrival", check=NONNEGATIVE_INT)
    fair_burst_tokens: int = knob(1024, "fair: service a light tenant may bank for its bursts (0: VTC's own lift)",
                                  check=NONNEGATIVE_INT)
    isolate_prompts: bool = knob(True, "priority: a less urgent class's prompts wait a step rather than share "
                                 "the step of a more urgent class's prompt")
    yielding_prompt_tokens: int = knob(64, "prompt tokens a step for prompts that yield (priority: less urgent "
                                       "classes while a more urgent one arrived in the last minute; fair: a tenant "
                                       "served ahead of one that has) (0: off)", check=NONNEGATIVE_INT)

    def check(self) -> None:
        if self.max_num_batched_tokens is None:
            self.need(self.chunked_prefill and self.batching == "continuous", "max_num_batched_tokens",
                      "may be None (auto: measured at start) only with chunked_prefill on and batching "
                      "'continuous' (the comparison modes' budget must hold a whole prompt)")
            return
        self.need(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
                  "must be an int >= max_num_seqs (every running sequence needs its decode token)")
        self.need(self.max_step_tokens >= self.max_num_batched_tokens, "max_step_tokens",
                  "must be an int >= max_num_batched_tokens")

    @property
    def priority_preemption(self) -> bool:
        if self.preempt_for_priority is None:
            return self.policy in ("priority", "fair")
        return self.preempt_for_priority


@dataclass(frozen=True)
class ForwardConfig(Section):
    """forward: how a step's forward pass runs"""

    attention_backend: str = knob("auto", "kernel: C++ paged attention (CPU); torch: gather + SDPA; auto: the "
                                  "kernel on CPU where it builds, else torch", choices=ATTENTION_BACKENDS)
    packed_linear: bool | None = knob(None, "the packed C++ linear layers (CPU)",
                                      none="auto: on for eager float32 on CPU")
    fused_layers: bool | None = knob(None, "the fused Llama forward (engine/fused_llama.py)",
                                     none="auto: on where packed linears are")
    huge_pages: bool = knob(True, "CPU: the packed linear weights side by side in the order a step reads them, "
                            "in one region advised for transparent huge pages (engine/huge_pages.py)")
    compile: bool = knob(False, "torch.compile the model (start-up takes minutes)")
    cuda_graphs: bool = knob(True, "with compile on CUDA: decode steps replay CUDA graphs per batch bucket")
    adaptive_threads: bool = knob(True, "CPU eager: steps of <= 4 tokens on 1 thread or all, whichever "
                                  "measures faster")
    adaptive_threads_all_steps: bool = knob(False, "with adaptive_threads, steps of every size too, where the "
                                            "kernels split no sum (engine/threads.py)")
    openmp_one_team: bool = knob(False, "served: free the loading thread's OpenMP pool so the engine thread's team "
                                 "spins between regions (one stream's ITL 27 -> 17 ms on a 2-core host; beside a "
                                 "client on the same cores, 8 streams lost throughput: engine/threads.py)")
    elastic_threads: bool | None = knob(None, "CPU bf16: the kernels' loops on an elastic pool whose helpers the "
                                        "stepping thread never waits for (torch's operators on one thread; "
                                        "engine/elastic.py)", none="auto: on when served (AsyncEngine) where the "
                                        "kernels run every step, off in process")


@dataclass(frozen=True)
class ParallelConfig(Section):
    """parallel: tensor parallelism (docs/ENGINE.md)"""

    tensor_parallel_size: int = knob(1, "shard the model over N ranks (processes; one GPU each on CUDA, "
                                     "gloo on CPU; 1: one process)", check=POSITIVE_INT)
    tp_timeout_s: float = knob(30.0, "seconds a tensor-parallel collective may wait before the engine fails",
                               check=POSITIVE)


@dataclass(frozen=True)
class SpeculativeConfig(Section):
    """speculative: n-gram (prompt-lookup) proposals from each sequence's own tokens, verified
    in the step (engine/speculative.py, docs/ENGINE.md)"""

    num_speculative_tokens: int = knob(0, "tokens proposed a step per sequence (0: off)",
                                       check=Check(lambda v: _is_int(v) and 0 <= v <= 16, "must be an int in [0, 16]"))
    speculative_ngram_min: int = knob(2, "shortest suffix n-gram matched for proposals", check=POSITIVE_INT)
    speculative_ngram_max: int = knob(4, "longest suffix n-gram matched (tried first)", check=POSITIVE_INT)
    speculative_min_acceptance: float = knob(0.3, "below this recent acceptance a sequence stops proposing a while",
                                             check=Check(lambda v: _is_num(v) and 0.0 <= v <= 1.0,
                                                         "must be a number in [0, 1]"))
    speculative_disable_by_batch_size: int | None = knob(None, "a step decoding more sequences than this proposes "
                                                         "nothing (vLLM's flag: many rows make a step compute-bound, "
                                                         "where verifying drafts stops paying)", check=POSITIVE_INT,
                                                         none="off: proposals at every batch size")
    speculative_history_tokens: int = knob(0, "tokens of each tenant's finished requests kept to propose from "
                                           "where they match a longer suffix than the sequence's own tokens "
                                           "(engine/ngram_history.py; 0: off)",
                                           check=Check(lambda v: _is_int(v) and v >= 0, "must be an int >= 0"))

    def check(self) -> None:
        self.need(self.speculative_ngram_min <= self.speculative_ngram_max <= 16, "speculative_ngram_max",
                  "must be an int in [speculative_ngram_min, 16]")
