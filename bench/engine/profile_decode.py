"""Where the engine's time goes: torch.profiler over SmolLM2 steps, and two comparisons.

    python -m bench.engine.profile_decode [--seqs 32] [--min-ctx 200] [--max-ctx 1000] [--steps 3]
                                   [--dtype auto] [--attention-backend auto|kernel|torch]
    python -m bench.engine.profile_decode --offline [--num-requests 16] [--max-prompt 512] [--max-output 32] [--compile]
    python -m bench.engine.profile_decode --serving [--dtypes bfloat16,float32] [--num-requests 16]
                                   [--max-prompt 512] [--max-output 32] [--json-out bench/results/profile-serving.json]
    python -m bench.engine.profile_decode --forwards [--seqs 1,8,32] [--steps 20] [--threads 1,2]
                                   [--json-out bench/results/profile-forwards.json]

Default: prefills `--seqs` prompts of random length in [min-ctx, max-ctx], then profiles
`--steps` pure decode steps and prints the operators by self CPU time. `--offline`: runs
bench.engine.offline's engine workload (same generator and engine settings) to completion under the
profiler and also prints the time by kind (linear layers, attention, gather, ...) and the
share spent outside the model forward. `--serving` (bench/engine/profile_serving.py): eager
against torch.compile on staggered arrivals, each dtype in its own process with a fresh inductor
cache. `--forwards` (bench/engine/profile_forwards.py): decode steps of the three CPU forward
paths at each batch size and thread count. Those two write JSON (`--json-out`) that
`streamgate-bench report` renders into docs/BENCHMARKS.md. `--model-dir`: another model (tests
run a tiny one).
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
    ap.add_argument("--model-dir", default=None, help="a local model directory (default: SmolLM2, the engine's)")
    ap.add_argument("--offline", action="store_true", help="profile bench.engine.offline's engine workload instead")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--threads", default=None,
                    help="torch.set_num_threads (default: torch's); --forwards: comma-separated counts, taken in turn")
    ap.add_argument("--serving", action="store_true", help="eager vs compiled on staggered arrivals (see above)")
    ap.add_argument("--dtypes", default=None, help="--serving: comma-separated dtypes, each in its own process "
                                                   "with a fresh inductor cache (default: --dtype)")
    ap.add_argument("--forwards", action="store_true", help="decode steps: torch vs packed linears vs fused forward")
    ap.add_argument("--json-out", default=None, help="--serving / --forwards: where the JSON goes "
                                                     "(default: bench/results/profile-MODE.json)")
    ap.add_argument("--serving-child", default=None, help=argparse.SUPPRESS)   # one dtype's run, for --serving
    args = ap.parse_args(argv)

    threads = [int(t) for t in args.threads.split(",")] if args.threads else []
    if len(threads) > 1 and not args.forwards:
        ap.error("--threads takes one count except with --forwards")
    if args.json_out is None and (args.serving or args.forwards):
        args.json_out = f"bench/results/profile-{'serving' if args.serving else 'forwards'}.json"
    if args.serving:
        from bench.engine.profile_serving import run_serving
        return run_serving(args, argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from engine import EngineConfig, LLMEngine, SamplingParams

    if args.forwards:
        from bench.engine.profile_forwards import run_forwards
        return run_forwards(args, argv, threads or [torch.get_num_threads()])
    if threads:
        torch.set_num_threads(threads[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    if args.offline:
        return profile_offline(args, activities)
    args.seqs = int(args.seqs)
    eng = LLMEngine(EngineConfig(model=args.model_dir or "default", device=args.device, dtype=args.dtype,
                                 max_num_batched_tokens=2048, max_num_seqs=max(64, args.seqs),
                                 enable_prefix_caching=False, attention_backend=args.attention_backend))
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

    model_dir = resolve_model(args.model_dir or "default")
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


if __name__ == "__main__":
    raise SystemExit(main())
