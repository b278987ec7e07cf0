"""Where the engine's time goes: torch.profiler over SmolLM2 steps.

    python -m bench.engine.profile_decode [--seqs 32] [--min-ctx 200] [--max-ctx 1000] [--steps 3]
                                   [--dtype auto] [--attention-backend auto|kernel|torch]
    python -m bench.engine.profile_decode --offline [--num-requests 16] [--max-prompt 512] [--max-output 32] [--compile]
    python -m bench.engine.profile_decode --serving [--num-requests 64] [--max-prompt 512] [--max-output 64]
    python -m bench.engine.profile_decode --forwards [--seqs 1,8,32] [--steps 20]

Default: prefills `--seqs` prompts of random length in [min-ctx, max-ctx], then profiles
`--steps` pure decode steps and prints the operators by self CPU time. `--offline`: runs
bench.engine.offline's engine workload (same generator and engine settings) to completion under the
profiler and also prints the time by kind (linear layers, attention, gather, ...) and the
share spent outside the model forward. `--serving`: requests arrive one per step (decode
batches of 1..32 beside chunked prefill) on an eager and a compiled engine stepping in turn (the
host is shared: alternating steps gives both the same load); prints each one's forward time by
step kind, the graphs torch.compile made (start-up and during the run) and whether the greedy
outputs agree. `--forwards`: decode steps (no profiler) of three engines stepping in turn:
transformers' forward on MKL linears (packed_linear off), transformers' forward on the packed
linear kernel (fused_layers off), and the default fused Llama forward; median step per engine
for each batch size in `--seqs`.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

from engine.config_cli import add_engine_args

# aten operator -> the kind of work it is, for the --offline summary.
KINDS = {"aten::mm": "linear layers", "aten::addmm": "linear layers", "mkldnn::_linear_pointwise": "linear layers",
         "streamgate::linear": "linear layers",
         **{f"streamgate::{op}": "fused layer ops" for op in ("silu_and_mul", "add_rms_norm", "rms_norm", "rotary")},
         "aten::_scaled_dot_product_flash_attention_for_cpu": "attention: SDPA",
         "aten::_scaled_dot_product_efficient_attention": "attention: SDPA",
         "streamgate::paged_attention": "attention: C++ kernel",
         "aten::index_select": "gather (index_select)", "aten::index_copy_": "KV write",
         "aten::argmax": "sampling", "aten::sort": "sampling"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="32", help="decoding sequences (--forwards: comma-separated sizes)")
    ap.add_argument("--min-ctx", type=int, default=200)
    ap.add_argument("--max-ctx", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3)
    add_engine_args(ap, only=("device", "dtype", "attention_backend", "compile"))
    ap.add_argument("--offline", action="store_true", help="profile bench.engine.offline's engine workload instead")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--serving", action="store_true", help="eager vs compiled on staggered arrivals (see above)")
    ap.add_argument("--forwards", action="store_true", help="decode steps: MKL vs packed linears vs fused forward")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import EngineConfig, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    if args.offline:
        return profile_offline(args, activities)
    if args.serving:
        return compare_serving(args)
    if args.forwards:
        return compare_forwards(args)
    args.seqs = int(args.seqs)
    eng = LLMEngine(EngineConfig(model="default", device=args.device, dtype=args.dtype, max_num_batched_tokens=2048,
                                 max_num_seqs=max(64, args.seqs), enable_prefix_caching=False,
                                 attention_backend=args.attention_backend))
    rng = random.Random(0)
    for i in range(args.seqs):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_ctx, args.max_ctx))]
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 10, temperature=0.0, ignore_eos=True))
    while eng.stats()["waiting"] or any(s.is_prefill for s in eng.scheduler.running):
        eng.step()
    eng.step()                                                   # one warm decode step
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            eng.step()
    s = eng.stats()
    print(f"{args.seqs} sequences decoding ({eng.runner.dtype}, attention "
          f"{'kernel' if eng.runner.use_kernel else 'torch'}); last step {s['step_time_s'] * 1000:.0f} ms "
          f"(forward {s['forward_time_s'] * 1000:.0f} ms)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


def profile_offline(args, activities) -> int:
    """bench.engine.offline's engine run (its workload, KV budget and step budget) under the profiler."""
    from torch.profiler import profile
    from transformers import AutoTokenizer

    from bench.engine.offline import BLOCK_SIZE
    from bench.workload import make_workload
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.models import resolve_model

    model_dir = resolve_model("default")
    requests = make_workload(AutoTokenizer.from_pretrained(model_dir), num_requests=args.num_requests, seed=0,
                             min_prompt=min(16, args.max_prompt), max_prompt=args.max_prompt,
                             min_output=min(16, args.max_output), max_output=args.max_output)
    eng = LLMEngine(EngineConfig(model=model_dir, device=args.device, dtype=args.dtype, block_size=BLOCK_SIZE,
                                 num_kv_blocks=24576 // BLOCK_SIZE, max_num_seqs=64, max_num_batched_tokens=512,
                                 attention_backend=args.attention_backend, compile=args.compile))
    greedy = dict(temperature=0.0, ignore_eos=True)
    eng.add_request("warmup", list(requests[0].prompt_ids[:8]), SamplingParams(max_tokens=2, **greedy))
    while eng.has_unfinished():
        eng.step()
    for r in requests:
        eng.add_request(r.request_id, list(r.prompt_ids), SamplingParams(max_tokens=r.max_tokens, **greedy))
    forward, steps, start = 0.0, 0, time.perf_counter()
    with profile(activities=activities) as prof:
        while eng.has_unfinished():
            eng.step()
            forward += eng.runner.last_forward_time
            steps += 1
    wall = time.perf_counter() - start
    kinds = Counter()
    for e in prof.key_averages():
        kinds[KINDS.get(e.key, "other operators")] += e.self_cpu_time_total / 1e6
    print(f"{args.num_requests} requests (prompts <= {args.max_prompt}, outputs <= {args.max_output}), "
          f"{eng.runner.dtype}, attention {'kernel' if eng.runner.use_kernel else 'torch'}"
          f"{f', compiled in {eng.runner.compile_time_s:.0f} s' if args.compile else ''}: "
          f"{steps} steps, wall {wall:.1f} s, model forward {forward:.1f} s")
    for kind, seconds in kinds.most_common():
        print(f"  {kind:24s} {seconds:8.2f} s {seconds / wall:7.1%}")
    print(f"  {'outside the forward':24s} {wall - forward:8.2f} s {(wall - forward) / wall:7.1%}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


def compare_forwards(args) -> int:
    """Median decode step of three forward paths, side by side (engines step in turn)."""
    import statistics

    from engine import EngineConfig, LLMEngine, SamplingParams

    paths = {"transformers + MKL linears": dict(packed_linear=False),
             "transformers + packed linears": dict(fused_layers=False),
             "fused Llama forward (default)": {}}
    for n in (int(x) for x in args.seqs.split(",")):
        blocks = n * (args.max_ctx + args.steps + 16) // 16 + 8
        engines = {name: LLMEngine(EngineConfig(model="default", device=args.device, dtype=args.dtype,
                                                max_num_batched_tokens=2048, max_num_seqs=max(64, n),
                                                enable_prefix_caching=False, num_kv_blocks=blocks, **cfg))
                   for name, cfg in paths.items()}
        rng = random.Random(0)
        prompts = [[rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_ctx, args.max_ctx))] for _ in range(n)]
        times = {name: [] for name in engines}
        for name, eng in engines.items():
            for i, prompt in enumerate(prompts):
                eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=args.steps + 4, temperature=0.0, ignore_eos=True))
            while eng.stats()["waiting"] or any(s.is_prefill for s in eng.scheduler.running):
                eng.step()
            eng.step()                                               # one warm decode step
        for _ in range(args.steps):
            for name, eng in engines.items():
                start = time.perf_counter()
                eng.step()
                times[name].append(time.perf_counter() - start)
        base = statistics.median(times["transformers + MKL linears"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{n:3d} rows  {name:30s} {med * 1000:7.1f} ms  {base / med:5.2f}x")
        del engines
    return 0


def compare_serving(args) -> int:
    """One request arrives per step into an eager and a compiled engine that step in turn."""
    from torch._dynamo.utils import counters

    from engine import EngineConfig, LLMEngine, SamplingParams

    cfg = dict(model="default", device=args.device, dtype=args.dtype, max_num_seqs=32, max_num_batched_tokens=256,
               attention_backend=args.attention_backend)
    engines = {"eager": LLMEngine(EngineConfig(**cfg))}
    engines["compiled"] = LLMEngine(EngineConfig(**cfg, compile=True))
    startup_graphs = counters["stats"]["unique_graphs"]
    rng = random.Random(0)
    requests = [([rng.randrange(1000, 40000) for _ in range(rng.randint(16, args.max_prompt))],
                 SamplingParams(max_tokens=rng.randint(4, args.max_output), temperature=0.0, ignore_eos=True))
                for _ in range(args.num_requests)]
    outputs = {name: {} for name in engines}
    forward = {name: Counter() for name in engines}
    step = 0
    while step < len(requests) or any(e.has_unfinished() for e in engines.values()):
        for name, eng in engines.items():
            if step < len(requests):
                eng.add_request(f"r{step}", *requests[step])
            if not eng.has_unfinished():
                continue
            decode_only = not eng.scheduler.waiting and all(not s.is_prefill for s in eng.scheduler.running)
            for out in eng.step():
                outputs[name].setdefault(out.request_id, []).extend(out.new_token_ids)
            kind = "decode-only steps" if decode_only else "steps with prefill"
            forward[name][kind] += eng.runner.last_forward_time
            forward[name][kind + " (count)"] += 1
        step += 1
    same = sum(outputs["eager"][r] == outputs["compiled"][r] for r in outputs["eager"])
    print(f"{args.num_requests} requests (prompts 16..{args.max_prompt}, outputs 4..{args.max_output}), one per "
          f"step, max 32 running, 256-token steps; compile took {engines['compiled'].runner.compile_time_s:.1f} s")
    for kind in ("decode-only steps", "steps with prefill"):
        e, c = forward["eager"][kind], forward["compiled"][kind]
        print(f"  {kind:20s} eager {e:7.2f} s ({forward['eager'][kind + ' (count)']} steps), compiled {c:7.2f} s "
              f"({forward['compiled'][kind + ' (count)']}): compiled/eager {c / e if e else float('nan'):.3f}")
    print(f"  graphs: {startup_graphs} at start-up, {counters['stats']['unique_graphs'] - startup_graphs} more "
          f"during {step} steps; graph breaks {sum(counters['graph_break'].values())}; "
          f"greedy outputs equal for {same}/{len(outputs['eager'])} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
