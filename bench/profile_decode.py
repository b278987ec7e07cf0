"""Where a decode step's time goes: torch.profiler over SmolLM2 decode steps.

    python -m bench.profile_decode [--seqs 32] [--min-ctx 200] [--max-ctx 1000] [--steps 3]
                                   [--dtype auto] [--attention-backend auto|kernel|torch]

Prefills `--seqs` prompts of random length in [min-ctx, max-ctx], then profiles `--steps`
pure decode steps and prints the operators by self CPU time.
"""

from __future__ import annotations

import argparse
import random


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--min-ctx", type=int, default=200)
    ap.add_argument("--max-ctx", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "kernel", "torch"])
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from engine import EngineConfig, LLMEngine, SamplingParams

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
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            eng.step()
    s = eng.stats()
    print(f"{args.seqs} sequences decoding ({eng.runner.dtype}, attention "
          f"{'kernel' if eng.runner.use_kernel else 'torch'}); last step {s['step_time_s'] * 1000:.0f} ms "
          f"(forward {s['forward_time_s'] * 1000:.0f} ms)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
