"""Every served family (engine/families.py) against Hugging Face: the description read from
the config, the refusal of families the engine cannot serve (naming the config field), and
greedy parity with HF `generate` (eager attention: the reference for soft-capping and sinks)
under staggered arrivals, chunked prefill, prefix caching and recompute / swap preemption,
with prompts crossing the 24-token sliding windows several times."""

from __future__ import annotations

import random

import pytest
import transformers

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_manager import FREED
from engine.families import UnsupportedModel, describe
from tests.bf16 import SKIP_REASON as BF16_SKIP
from tests.bf16 import assert_tokens_within_noise
from tests.bf16 import runs_here as bf16_runs_here
from tests.families import WINDOW, build_family_model, load_eager_reference
from tests.models import TEST_POOL, assert_greedy_parity, pool, run_to_completion

TOL = 1e-4                     # fp32: exact up to near-ties, as tests/test_parity.py


@pytest.fixture(scope="session")
def family_model(tmp_path_factory, tokenizer_dir):
    made: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in made:
            made[family] = build_family_model(family, tmp_path_factory.mktemp(f"fam-{family}"), tokenizer_dir)
        return made[family]

    return make


# -- the description --------------------------------------------------------------------------
def test_description_reads_windows_softcaps_and_sinks_per_layer():
    g2 = describe(transformers.Gemma2Config(num_hidden_layers=4, sliding_window=32, attn_logit_softcapping=50.0,
                                            final_logit_softcapping=30.0))
    assert [layer.window for layer in g2.layers] == [32, None, 32, None]
    assert {layer.softcap for layer in g2.layers} == {50.0} and g2.final_softcap == 30.0 and not g2.fused
    oss = describe(transformers.GptOssConfig(num_hidden_layers=2, sliding_window=16))
    assert [(layer.window, layer.sinks) for layer in oss.layers] == [(16, True), (None, True)] and oss.moe
    mistral = describe(transformers.MistralConfig(num_hidden_layers=3, sliding_window=40))
    assert [layer.window for layer in mistral.layers] == [40] * 3 and mistral.fused
    qwen2 = describe(transformers.Qwen2Config(num_hidden_layers=2, sliding_window=40, use_sliding_window=False))
    assert all(layer.plain for layer in qwen2.layers) and qwen2.fused
    assert not describe(transformers.Qwen3MoeConfig(num_hidden_layers=2)).fused     # MoE: transformers' blocks


@pytest.mark.parametrize("config, field", [
    (lambda: transformers.Qwen3NextConfig(num_hidden_layers=4), "config.layer_types[0] = 'linear_attention'"),
    (lambda: transformers.Lfm2Config(num_hidden_layers=4, full_attn_idxs=[1]), "config.layer_types[0] = 'conv'"),
    (lambda: transformers.FalconH1Config(num_hidden_layers=2), "config.layer_types[0] = 'hybrid'"),
    (lambda: transformers.GraniteMoeHybridConfig(num_hidden_layers=2), "config.layer_types[0]"),
    (lambda: transformers.BloomConfig(n_layer=2), "'bloom' (config.model_type)"),
    (lambda: transformers.GPT2Config(n_layer=2, add_cross_attention=True), "config.add_cross_attention"),
])
def test_unservable_families_are_refused_at_load_naming_the_field(tmp_path, config, field):
    config().save_pretrained(tmp_path)                # the refusal comes before any weights load
    with pytest.raises(UnsupportedModel) as err:
        LLMEngine(EngineConfig(model=str(tmp_path)))
    assert field in str(err.value)


# -- greedy parity ----------------------------------------------------------------------------
def workload(seed: int = 0, max_new: int = 16) -> dict[int, list[tuple]]:
    """Prompts of 3..100 tokens arriving over several steps; later ones share a 56-token
    prefix with the first (prefix hits: 7 blocks of 8, past two windows)."""
    rng = random.Random(seed)
    shared = [rng.randrange(100, 40_000) for _ in range(56)]
    arrivals: dict[int, list[tuple]] = {}
    for i, n in enumerate([100, 3, 37, 60, 17]):
        prompt = [rng.randrange(100, 40_000) for _ in range(n)]
        if i in (0, 3):
            prompt = shared + prompt[:30]
        params = SamplingParams(max_tokens=max_new - (i % 3) * 3, temperature=0.0, ignore_eos=True)
        arrivals.setdefault(i * 3, []).append((f"r{i}", prompt, params))
    arrivals[40] = [("again", shared + [7, 8, 9], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))]
    return arrivals


def check_parity(model_dir: str, arrivals, **cfg) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=model_dir, block_size=8, max_num_batched_tokens=32, max_num_seqs=8,
                                    **pool(cfg), **cfg))
    outputs = run_to_completion(engine, arrivals)
    ref = load_eager_reference(model_dir)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_greedy_parity(ref, prompt, outputs[rid], TOL)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["running"] == stats["waiting"] == 0
    return engine


FAMILIES = ["mistral", "gemma2", "gemma3_text", "phi3", "smollm3", "olmo2", "granite", "qwen3_moe", "gpt_oss",
            "mixtral", "qwen3-sliding"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_greedy_parity_chunked_with_prefix_hits(family_model, family):
    """The default path (the C++ kernel on CPU, the fused forward where it applies): every
    output equals HF greedy, and the prompts that share a prefix hit the cache."""
    engine = check_parity(family_model(family), workload())
    assert engine.stats()["prefix_cache_hit_tokens"] >= 2 * 56 - 8


MORE_FAMILIES = ["ministral", "olmo3", "exaone4", "cohere2", "starcoder2", "gemma", "phi", "glm4", "helium",
                 "seed_oss", "cohere", "arcee", "qwen2_moe", "olmoe", "granitemoe", "gpt2"]


@pytest.mark.parametrize("family", MORE_FAMILIES)
def test_more_families_greedy_parity(family_model, family):
    """Families whose differences all live in transformers' modeling code (parallel blocks,
    LayerNorm, biases, partial rotary, logit scales, shared experts, GPT-2's learned absolute
    positions read at the engine's position ids) or in their sliding layers: a lighter workload (a prompt crossing the window twice, one sharing its prefix,
    a short one), chunked, staggered."""
    rng = random.Random(4)
    first = [rng.randrange(100, 40_000) for _ in range(60)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", first, params)], 2: [("b", [7, 8, 9], params)], 6: [("c", first[:48] + [1, 2], params)]}
    check_parity(family_model(family), arrivals)


@pytest.mark.parametrize("family", ["llama-rope-llama3", "qwen3-rope-yarn", "phi3-rope-longrope"])
def test_rope_scaling_greedy_parity(family_model, family):
    """Rope scaling types, `llama3` and `yarn` on the fused forward scaled from 64 original
    positions (prompts and outputs on both sides of them), `longrope` on Phi-3's forward
    within its original length (its short factors)."""
    rng = random.Random(5)
    first = [rng.randrange(100, 40_000) for _ in range(60)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    arrivals = {0: [("a", first, params)], 2: [("b", [7, 8, 9], params)], 6: [("c", first[:48] + [1, 2], params)]}
    check_parity(family_model(family), arrivals)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_family_greedy_parity_on_the_torch_backend(family_model, family):
    """The torch reference path: windows in the masks, soft-capping and sinks written out."""
    check_parity(family_model(family), workload(seed=1), attention_backend="torch")


@pytest.mark.skipif(not bf16_runs_here(), reason=BF16_SKIP)
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_family_bf16_on_the_kernel(family_model, family):
    """bf16 weights and pool: Mistral's window on the fused bf16 forward, Gemma 2's window and
    soft-cap and gpt-oss's sinks and MoE on transformers' bf16 forward, all through the
    kernel's bf16 paths; every token within the bf16 contract (tests/bf16.py) of HF's fp32
    eager forward."""
    arrivals = workload(seed=3)
    model_dir = family_model(family)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", attention_backend="kernel", block_size=8,
                                    max_num_batched_tokens=32, max_num_seqs=8, **TEST_POOL))
    outputs = run_to_completion(engine, arrivals)
    for reqs in arrivals.values():
        for rid, prompt, params in reqs:
            assert_tokens_within_noise(model_dir, prompt, outputs[rid],
                                       load=lambda dtype: load_eager_reference(model_dir, dtype))


@pytest.mark.parametrize("family, mode, blocks", [("gpt_oss", "recompute", 40), ("gemma3_text", "swap", 40),
                                                  ("gpt_oss", "swap", 40), ("gemma3_text", "recompute", 40),
                                                  ("mistral", "swap", 15), ("qwen3-sliding", "recompute", 15)])
def test_family_greedy_parity_under_preemption(family_model, family, mode, blocks):
    """A pool too small for every request: sequences are preempted (recomputed, or swapped
    to the host pool and back) mid-generation, and still equal HF. Every family here returns
    blocks that left the window (the hybrids from their sliding layers' tables, kv_groups.py;
    their blocks are half the size, so twice as many hold the same memory); the requests
    arrive together so that the pool runs short even so, and are swapped or recomputed with
    those entries returned."""
    arrivals = workload(seed=2, max_new=24)
    arrivals = {0: [r for step, reqs in sorted(arrivals.items()) if step < 40 for r in reqs], 40: arrivals[40]}
    engine = check_parity(family_model(family), arrivals, num_kv_blocks=blocks, watermark=0.0,
                          preemption_mode=mode, num_swap_blocks=64, swap_min_tokens=1)
    assert engine.stats()["num_preemptions"] > 0


# -- chat templates and generation config ---------------------------------------------------------
# Gemma 2's template, as shipped: it raises on a system message.
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_system_role_is_merged_where_the_template_rejects_it(family_model, tmp_path):
    """A Gemma-2-style template that raises on the system role renders a system message as
    the start of the first user turn; the engine also reads every EOS id of the model's
    generation_config.json; a template that accepts system messages is left as shipped."""
    import shutil

    from transformers import GenerationConfig

    model_dir = tmp_path / "gemma2"
    shutil.copytree(family_model("gemma2"), model_dir)
    (model_dir / "chat_template.jinja").write_text(GEMMA2_TEMPLATE)
    GenerationConfig(eos_token_id=[2, 107]).save_pretrained(model_dir)
    engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=32))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n"
                         "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"), text
    assert {2, 107} <= engine.eos_token_ids
    plain = LLMEngine(EngineConfig(model=family_model("mistral"), num_kv_blocks=32))
    assert "Be brief." in plain.tokenizer.apply_chat_template(messages, tokenize=False)
    assert "raise_exception" not in plain.tokenizer.chat_template and "set messages" not in plain.tokenizer.chat_template


# -- sliding-window block freeing ---------------------------------------------------------------
@pytest.mark.parametrize("family, blocks", [("qwen3-sliding", 24), ("mistral", 24), ("gemma3_text", 48),
                                            ("gpt_oss", 48)])
def test_sliding_window_blocks_return_to_the_pool(family_model, family, blocks):
    """Every layer slides over 24 tokens (Mistral, the sliding Qwen3), or every other one (the
    hybrids Gemma 3 and gpt-oss, whose full-attention layers keep their own table): during a
    150-token generation the sliding tables hold at most the blocks the window spans (KV flat
    once the window fills: all of it, or all but the full group's one block per 8 tokens),
    never read a returned block (outputs equal HF). A 90-token prompt then evicts the oldest
    returned blocks, and later requests sharing the first prompt's prefix still hit the cache
    where every group holds what its window sees, and equal HF."""
    from engine.block_manager import block_hash

    rng = random.Random(11)
    prompt = [rng.randrange(100, 40_000) for _ in range(40)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    arrivals = {0: [("long", prompt, SamplingParams(max_tokens=150, **greedy))],
                50: [("filler", [rng.randrange(100, 40_000) for _ in range(90)], SamplingParams(max_tokens=4, **greedy))],
                60: [("hit", prompt + [5, 6, 7], SamplingParams(max_tokens=30, **greedy))],
                64: [("hit2", prompt[:33] + [9] * 20, SamplingParams(max_tokens=30, **greedy))]}
    engine = LLMEngine(EngineConfig(model=family_model(family), block_size=8, num_kv_blocks=blocks,
                                    max_num_batched_tokens=32, max_num_seqs=8, watermark=0.0))
    bm = engine.block_manager
    sliding = [g for g, w in enumerate(bm.windows) if w is not None]
    assert sliding and all(bm.windows[g] == WINDOW for g in sliding)
    held: list[int] = []
    outputs: dict[str, list[int]] = {}
    first_block = block_hash(b"", prompt[:8])
    for step in range(400):
        for rid, p, params in arrivals.get(step, []):
            engine.add_request(rid, p, params)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        running = list(engine.scheduler.running)
        bm.check_invariants(running)
        if step < 50:
            long = running[0]
            full = sum(len(t) for g, t in enumerate(long.block_tables) if g not in sliding)
            held.append(bm.num_used_blocks - full)
        if step == 60:
            hit = engine.seqs["hit"]
            # The prompt's first block left every sliding index (evicted by the filler), yet the
            # hit holds 5 blocks: the sliding tables start FREED.
            assert all(first_block not in bm.pool.indexes[g] for g in sliding)
            assert hit.num_cached_tokens == 40
            assert all(hit.block_tables[g][0] == FREED for g in sliding)
        if not engine.has_unfinished() and step > 64:
            break
    # The window spans at most ceil((24 - 1) / 8) + 1 = 4 blocks, plus the next token's, per group.
    assert max(held) <= 5 * len(sliding) and held[-1] <= 5 * len(sliding), held
    ref = load_eager_reference(family_model(family))
    for reqs in arrivals.values():
        for rid, p, params in reqs:
            assert len(outputs[rid]) == params.max_tokens
            assert_greedy_parity(ref, p, outputs[rid], TOL)
    assert bm.num_used_blocks == 0
    assert engine.stats()["kv_blocks_used"] == 0
