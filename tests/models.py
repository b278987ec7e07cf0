"""Building tiny models and checking an engine's greedy output against Hugging Face."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2,
            tie_word_embeddings=False)
# "llama-slow": a deeper, wider Llama (12 layers, head_dim 64: the bf16 dot-product decode
# paths, logits spread wider) for the parity and bf16-contract tests. A test
# whose stream must outlast a wait holds it on tests/held_engine.py instead (an event, not
# a model slow enough to outlast a timer on one host).
SLOW = dict(TINY, hidden_size=256, intermediate_size=1024, num_hidden_layers=12)


def build_tiny_model(family: str, out: Path, tokenizer_dir: str) -> str:
    """A ~4M-parameter random model of `family` with the default model's vocabulary."""
    import transformers

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "llama-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "llama-slow": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
    }[family]
    extra = {"head_dim": 16} if family == "qwen3" else {}
    if family == "gpt2":
        config = config_cls(vocab_size=len(tokenizer), n_embd=64, n_layer=2, n_head=4)
    else:
        base = SLOW if family == "llama-slow" else TINY
        config = config_cls(vocab_size=len(tokenizer), **{**base, "tie_word_embeddings": family.endswith("-tied")},
                            **extra)
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(1234)
    model = model_cls(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)

# A test engine's KV pool when the test does not size it: 64 MiB, thousands of blocks on a
# tiny model and hundreds on SmolLM2, more than any of these workloads of a few hundred
# tokens holds. The default 1 GiB cost ~0.5-1 s per engine while the pool was zeroed at
# start-up (it is mapped lazily since 0e5bef2); the block bookkeeping still scales with it.
TEST_POOL = {"kv_cache_memory_gb": 1 / 16}


def pool(cfg: dict) -> dict:
    """TEST_POOL unless `cfg` sizes the pool itself."""
    return {} if "num_kv_blocks" in cfg or "kv_cache_memory_gb" in cfg else TEST_POOL


@lru_cache(maxsize=6)
def load_reference(model_dir: str, device: str = "cpu", dtype: str = "float32"):
    """The HF model, loaded once per (directory, device, dtype): the parity tests only read it."""
    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa",
                                                dtype=getattr(torch, dtype)).to(device).eval()


# (model directory, device, dtype, prompt, max_new_tokens) -> HF's greedy output. Tests replay
# one workload on several attention paths, preemption modes or engines; HF's answer for the
# same model and request is the same each time, so it is generated once per session.
_GREEDY: dict[tuple, list[int]] = {}


def _key(model, prompt, max_new_tokens: int) -> tuple:
    return model.name_or_path, str(model.device), model.dtype, tuple(prompt), max_new_tokens


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face `generate`, greedy, explicit attention mask, EOS ignored (as the engine's
    `ignore_eos`; `min_new_tokens` would instead mask EOS and change the argmax). One prompt
    alone is hf_greedy_batch without padding."""
    hf_greedy_batch(model, [prompt], max_new_tokens)
    return list(_GREEDY[_key(model, prompt, max_new_tokens)])


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    """`hf_greedy` for many prompts in one left-padded, masked `generate` call (8 SmolLM2
    references: ~35% less CPU than one call each), into the same cache. Padding moves HF's
    logits only by rounding, which can flip a near-tie; `assert_greedy_parity` accepts a
    difference only where it is one, teacher-forcing the engine's own output."""
    todo = [p for p in dict.fromkeys(map(tuple, prompts)) if _key(model, p, max_new_tokens) not in _GREEDY]
    if not todo:
        return
    width = max(map(len, todo))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in todo], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in todo], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, eos_token_id=None,
                         do_sample=False, pad_token_id=0, temperature=None, top_p=None, top_k=None)
    for p, row in zip(todo, out[:, width:].tolist()):
        _GREEDY[_key(model, p, max_new_tokens)] = row


@torch.inference_mode()
def assert_greedy_parity(model, prompt: list[int], got: list[int], tol: float) -> None:
    """`got` must equal HF's greedy output. Where they differ, the first difference must be a
    near-tie (logits within `tol`), and every token the engine chose must be within `tol` of
    the teacher-forced maximum at its position."""
    want = hf_greedy(model, prompt, len(got))
    if got == want:
        return
    ids = torch.tensor([prompt + got], device=model.device)
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()          # [len(got), V]
    first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    row = logits[first]
    assert abs(row[got[first]] - row[want[first]]) <= tol, (
        f"diverged at output {first}: engine {got[first]} vs HF {want[first]}, "
        f"logit gap {float(row[want[first]] - row[got[first]]):.3g} > {tol}\n got={got}\nwant={want}")
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(got, device=logits.device)[:, None])[:, 0]
    worst = int((best - chosen).argmax())
    assert float(best[worst] - chosen[worst]) <= tol, f"token {worst} is {float(best[worst] - chosen[worst]):.3g} below the max"


def run_to_completion(engine, arrivals: dict[int, list[tuple]]) -> dict[str, list[int]]:
    """Step `engine`, adding requests at the given steps: {step: [(id, prompt, params), ...]}.
    Returns each request's output token ids and checks every request ends exactly once."""
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    step = 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            assert out.request_id not in finished, f"{out.request_id} produced output after finishing"
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        step += 1
        assert step < 10_000, "engine did not finish"
    expected = {rid for reqs in arrivals.values() for rid, _, _ in reqs}
    assert set(finished) == expected, f"unfinished: {expected - set(finished)}"
    return outputs
