"""Model families: KV blocks a long conversation holds on sliding-window models, and the
decode step's cost per family in the fused and generic forwards, with the MoE blocks' share.

    python -m bench.engine.families kv [--tokens 4096] [--prompt 3584] [--block-size 16]
    python -m bench.engine.families speed [--families llama,mistral,...] [--seqs 8] [--steps 24] [--smol]

Each mode writes its JSON with its provenance to bench/results/families-MODE.json (`--json-out`);
docs/BENCHMARKS.md §11 renders it (bench/renderers/families.py).

`kv` drives the real block manager (engine/block_manager.py) the way the scheduler does (the
prompt allocated at admission, computed in 512-token chunks, then one token per step) for
layer layouts of real models, with the sliding groups freeing (engine/kv_groups.py) and with
one table for every layer (no freeing). A block holds `rows` layers, so the memory held is
blocks x rows ("layer-blocks"); no model is loaded and the numbers are exact.

`speed` builds each family's tiny random model (tests/families.py: 2 layers, hidden 64, the
SmolLM2 vocabulary) and times decode-only steps of `--seqs` sequences (median), in the fused
forward where it applies and in transformers' forward with the engine's attention
(`fused_layers=False`); the MoE families' MLP blocks are timed with forward hooks, beside the
dense MLPs of Llama's generic path, for the paper estimate of an expert-grouped GEMM.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

# (name, per-layer windows) of real layouts: Mistral-7B-v0.1 (all 32 layers over 4096 would
# not free below 4k, so a 512 window stands for an all-sliding model), Gemma 3 1B (26 layers,
# 5 sliding over 512 : 1 full), gpt-oss-20b (24 layers alternating, sliding over 128).
LAYOUTS = {
    "all-sliding-512 (32 layers)": (512,) * 32,
    "gemma3-1b (5:1, window 512)": tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26)),
    "gpt-oss-20b (1:1, window 128)": tuple(128 if i % 2 == 0 else None for i in range(24)),
}


def kv_held(windows: tuple, tokens: int, prompt: int, block_size: int, free: bool, chunk: int = 512) -> dict:
    """Blocks (and layer-blocks) one conversation holds: at the prompt's admission, the most
    while decoding, and at its last token."""
    from engine.block_manager import BlockManager
    from engine.config import SamplingParams
    from engine.kv_groups import plan_groups
    from engine.sequence import Sequence

    groups = plan_groups(windows if free else (None,) * len(windows))
    # A pool just big enough for every group to hold the whole conversation (a block to spare):
    # what it holds does not depend on the pool's size, and building a pool of 2^20 blocks was
    # ~95% of this benchmark's time. Too small a pool would raise, not miscount.
    num_blocks = groups.num_groups * (-(-tokens // block_size) + 1)
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True, windows=groups.windows)
    seq = Sequence("conv", list(range(prompt)), SamplingParams(max_tokens=tokens - prompt))
    bm.allocate(seq)
    peak_prefill = bm.num_used_blocks
    while seq.num_computed_tokens < prompt:
        seq.num_computed_tokens = min(prompt, seq.num_computed_tokens + chunk)
        bm.commit(seq)
    decode_peak = bm.num_used_blocks
    while seq.num_tokens < tokens:
        seq.output_token_ids.append(7)
        bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
        decode_peak = max(decode_peak, bm.num_used_blocks)
    end = bm.num_used_blocks
    rows = groups.rows
    return {"groups": groups.num_groups, "rows": rows, "admission": peak_prefill, "decode_peak": decode_peak,
            "end": end, "layer_blocks_admission": peak_prefill * rows, "layer_blocks_end": end * rows}


def run_kv(args) -> dict:
    out = {}
    print(f"KV held by a {args.tokens}-token conversation ({args.prompt}-token prompt), blocks of {args.block_size}")
    print(f"{'layout':32} {'freeing':8} {'groups':>6} {'rows':>4} {'admission':>10} {'decode max':>10} {'end':>6} "
          f"{'layer-blocks admission':>22} {'layer-blocks end':>16}")
    for name, windows in LAYOUTS.items():
        for free in (True, False):
            r = kv_held(windows, args.tokens, args.prompt, args.block_size, free)
            out[f"{name} / {'free' if free else 'keep'}"] = r
            print(f"{name:32} {'yes' if free else 'no':8} {r['groups']:>6} {r['rows']:>4} {r['admission']:>10} "
                  f"{r['decode_peak']:>10} {r['end']:>6} {r['layer_blocks_admission']:>22} {r['layer_blocks_end']:>16}")
    return out


# -- speed ------------------------------------------------------------------------------------------
SPEED_FAMILIES = ("llama", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3", "smollm3", "olmo2", "granite",
                  "qwen3_moe", "gpt_oss", "mixtral")


def _model_dir(family: str, root: Path, tokenizer_dir: str) -> str:
    from tests.families import FAMILIES, build_family_model
    from tests.models import build_tiny_model

    if family in FAMILIES:
        return build_family_model(family, root / family, tokenizer_dir)
    return build_tiny_model(family, root / family, tokenizer_dir)


class _MLPTimer:
    """Wall time spent inside every decoder layer's `mlp` module (forward hooks)."""

    def __init__(self, model):
        self.total = 0.0
        self._start = 0.0
        for layer in model.model.layers:
            layer.mlp.register_forward_pre_hook(self._pre)
            layer.mlp.register_forward_hook(self._post)

    def _pre(self, *_):
        self._start = time.perf_counter()

    def _post(self, *_):
        self.total += time.perf_counter() - self._start


def _param_counts(model_dir: str) -> tuple[int, int]:
    """(all parameters, embedding + LM head) from the checkpoint (the engine repacks linears)."""
    from safetensors import safe_open

    total = embed = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
                embed += n if ("embed" in name or "lm_head" in name) else 0
    return total, embed


PROMPT_TOKENS = 32          # each sequence's prompt in `speed`; the steps timed are decode-only


def time_decode(model_dir: str, fused: bool, seqs: int, steps: int, threads: int, mlp: bool = False,
                profile: bool = False) -> dict | None:
    """Median decode-only step of `seqs` sequences (None: the fused forward does not apply).
    With `profile`, the operators of the decode steps by self CPU time (torch.profiler)."""
    import torch

    from engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine(EngineConfig(model=model_dir, fused_layers=None if fused else False, max_num_seqs=seqs,
                                    num_kv_blocks=seqs * 8 + 8, block_size=16, adaptive_threads=False))
    is_fused = engine.runner.forward is not engine.runner.model
    if fused and not is_fused:
        return None
    timer = _MLPTimer(engine.runner.model) if mlp and not is_fused else None
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", [100 + i + j for j in range(PROMPT_TOKENS)], params)
    times, mlp_times = [], []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile else None
    while engine.has_unfinished():
        before = timer.total if timer else 0.0
        if prof is not None and len(times) == 2:
            prof.__enter__()                                         # decode steps 3.. profiled
        start = time.perf_counter()
        engine.step()
        took = time.perf_counter() - start
        s = engine.stats()
        if s["num_prefill_tokens"] == 0 and s["num_decode_tokens"] == seqs:
            times.append(took)
            mlp_times.append((timer.total - before) if timer else 0.0)
    top = None
    if prof is not None and len(times) > 2:
        prof.__exit__(None, None, None)
        top = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10)
    total, embed = _param_counts(model_dir)
    step = statistics.median(times)
    on_kernel = list(engine.runner.on_kernel)
    attention = "kernel" if all(on_kernel) else "torch" if not any(on_kernel) else "kernel+torch"
    return {"dtype": str(engine.runner.dtype).removeprefix("torch."), "attention": attention,
            "step_ms": step * 1e3, "tokens_per_s": seqs / step, "params": total, "non_embedding_params": total - embed,
            "mlp_ms": statistics.median(mlp_times) * 1e3 if timer else None, "steps": len(times), "profile": top}


def moe_estimate(config, dense_mlp_ms: float, dense_config, moe_mlp_ms: float, rows: int) -> dict:
    """Paper estimate of an expert-grouped GEMM: the active experts' FLOPs run at the dense
    MLP's measured time per FLOP (one GEMM per projection for all rows, as a grouped GEMM
    would approach), and never below the dense MLP's own time (as many calls: at these sizes
    their fixed cost dominates), against the MoE blocks' measured time. transformers 5 already
    runs Qwen3-MoE's and Mixtral's experts as `torch._grouped_mm` (`use_experts_implementation`);
    gpt-oss's as a loop over the experts hit."""
    hidden = config.hidden_size
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    top_k = config.num_experts_per_tok
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    moe_flops = rows * (top_k * 3 * 2 * hidden * inter + 2 * hidden * experts)
    dense_flops = rows * 3 * 2 * dense_config.hidden_size * dense_config.intermediate_size
    grouped_ms = dense_mlp_ms * max(1.0, moe_flops / dense_flops)
    return {"moe_mlp_ms": moe_mlp_ms, "grouped_gemm_ms_estimate": grouped_ms,
            "saving_ms_per_step": max(0.0, moe_mlp_ms - grouped_ms)}


def run_speed(args) -> dict:
    from transformers import AutoConfig

    from engine.models import resolve_model

    tokenizer_dir = resolve_model("default")
    fams = [f for f in args.families.split(",") if f]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {f: _model_dir(f, Path(tmp), tokenizer_dir) for f in fams}
        if args.smol:
            dirs["smollm2-135m"] = tokenizer_dir
        for name, model_dir in dirs.items():
            moe = name in ("qwen3_moe", "gpt_oss", "mixtral")
            row = {"fused": time_decode(model_dir, True, args.seqs, args.steps, args.threads),
                   "generic": time_decode(model_dir, False, args.seqs, args.steps, args.threads,
                                          mlp=moe or name == "llama")}
            if moe:
                cfg = AutoConfig.from_pretrained(model_dir)
                row["experts"] = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
                row["top_k"] = cfg.num_experts_per_tok
            rows[name] = row
        if "llama" in rows:
            base = rows["llama"]["generic"]
            dense_cfg = AutoConfig.from_pretrained(dirs["llama"])
            for name in ("qwen3_moe", "gpt_oss", "mixtral"):
                if name in rows:
                    rows[name]["moe"] = moe_estimate(AutoConfig.from_pretrained(dirs[name]), base["mlp_ms"], dense_cfg,
                                                     rows[name]["generic"]["mlp_ms"], args.seqs)
        base = rows.get("llama", {}).get("generic")
        for name in [n for n in rows if base and args.profile and rows[n]["generic"]["step_ms"] >= 2 * base["step_ms"]]:
            prof = time_decode(dirs[name], False, args.seqs, args.steps, args.threads, profile=True)
            print(f"-- {name}: generic decode step {rows[name]['generic']['step_ms']:.2f} ms, "
                  f"{rows[name]['generic']['step_ms'] / base['step_ms']:.1f}x Llama's; operators by self CPU time\n"
                  f"{prof['profile']}")
    base = rows.get("llama", {}).get("generic")
    print(f"decode steps of {args.seqs} sequences, median of {args.steps}-ish, {args.threads} thread(s)")
    print(f"{'family':14} {'params':>8} {'non-emb':>8} {'fused ms':>9} {'fused tok/s':>11} {'generic ms':>10} "
          f"{'generic tok/s':>13} {'vs llama':>8}")
    for name, row in rows.items():
        f, g = row["fused"], row["generic"]
        ratio = g["step_ms"] / base["step_ms"] if base else float("nan")
        print(f"{name:14} {g['params'] / 1e6:>7.2f}M {g['non_embedding_params'] / 1e6:>7.3f}M "
              f"{(f['step_ms'] if f else float('nan')):>9.2f} {(f['tokens_per_s'] if f else float('nan')):>11.0f} "
              f"{g['step_ms']:>10.2f} {g['tokens_per_s']:>13.0f} {ratio:>7.2f}x")
        if "moe" in row:
            m = row["moe"]
            print(f"  {name} MoE blocks {m['moe_mlp_ms']:.2f} ms/step; an expert-grouped GEMM at the dense MLP's "
                  f"time per FLOP: {m['grouped_gemm_ms_estimate']:.2f} ms (saves {m['saving_ms_per_step']:.2f} ms, "
                  f"{m['saving_ms_per_step'] / g['step_ms']:.0%} of the step)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    kv = sub.add_parser("kv")
    kv.add_argument("--tokens", type=int, default=4096)
    kv.add_argument("--prompt", type=int, default=3584)
    kv.add_argument("--block-size", type=int, default=16)
    sp = sub.add_parser("speed")
    sp.add_argument("--families", default=",".join(SPEED_FAMILIES))
    sp.add_argument("--seqs", type=int, default=8)
    sp.add_argument("--steps", type=int, default=24)
    sp.add_argument("--threads", type=int, default=1,
                    help="1 by default: on a shared 2-core host, two threads wait on each other's descheduling")
    sp.add_argument("--smol", action="store_true", help="also SmolLM2-135M (the default model)")
    sp.add_argument("--profile", action="store_true", help="profile every family 2x or more slower than Llama")
    for p, mode in ((kv, "kv"), (sp, "speed")):
        p.add_argument("--json-out", default=f"bench/results/families-{mode}.json")
    args = ap.parse_args(argv)
    from bench.provenance import provenance, write_json

    prov = provenance("engine.families", argv)
    if args.mode == "kv":
        result, env = run_kv(args), {}
    else:
        import torch
        import transformers

        from engine.kernels import loaded_variant

        result = run_speed(args)
        env = {"threads": args.threads, "prompt_tokens": PROMPT_TOKENS, "kernels": loaded_variant(), "torch": torch.__version__,
               "transformers": transformers.__version__}
    print(f"wrote {write_json(args.json_out, prov, args=vars(args), env=env, result=result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
