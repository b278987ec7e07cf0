"""This host's roofline for a model: what its matmuls and memory allow, and each workload's bound.

    python -m bench.engine.roofline [--model default] [--dtype bfloat16|float32|int8] [--threads N]
                             [--reps 20] [--measured 1=29.8,8=138.1,32=234.8]

Measures bf16 and fp32 matmul throughput (`F.linear` through oneDNN/MKL, and in bf16 oneDNN on
a prepacked weight, at the model's own linear shapes, at 1, 8, 32 and 512 rows; best of --reps: the host may be shared) and memory read
bandwidth (a large tensor's sum, best of --reps), prints the CPU model, its ISA flags and
whether oneDNN may use AMX (and, unless --no-isa-probe, the ISA oneDNN reports with
ONEDNN_VERBOSE=1), then computes from the model's HF config:
- a one-row decode step: every linear weight read once, bytes / bandwidth;
- a B-row decode step: max(weight bytes / bandwidth, B x FLOPs per token / peak throughput);
- a 512-token prefill chunk: its FLOPs / peak throughput;
- the GuideLLM-like serving workload (prompts of --prompt-tokens, --output-tokens each, N
  concurrent streams in waves of N): output tok/s = N x O / (prefill of N prompts + O steps of N rows).
With --measured STREAMS=TOK_S,... it prints each served figure as a fraction of its bound.
"Peak throughput" is the best measured at any row count for the compute dtype (bf16 for
bfloat16 and int8 weights). KV-cache reads and attention FLOPs are counted (they grow with the
context); norms, rotary and sampling are not. Writes --json-out (bench/results/roofline.json),
which other benchmarks take with `--roofline PATH` (same host and model only) to state fractions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


@dataclass(frozen=True)
class Shapes:
    """What the bounds need from a decoder-only model's HF config."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> Shapes:
        heads = cfg["num_attention_heads"]
        return cls(hidden=cfg["hidden_size"], intermediate=cfg["intermediate_size"], layers=cfg["num_hidden_layers"],
                   heads=heads, kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"])

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, out, in) of one layer's linears (q/k/v and gate/up fused) and the lm_head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("q/k/v", q + 2 * kv, h), ("o", h, q), ("gate/up", 2 * self.intermediate, h),
                ("down", h, self.intermediate), ("lm_head", self.vocab, h)]

    @property
    def layer_params(self) -> int:
        return sum(n * k for name, n, k in self.linears() if name != "lm_head")

    @property
    def linear_params(self) -> int:
        """Every linear weight, lm_head included (tied or not: it is read every step)."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def attention_flops(self, context: float) -> float:
        """One query token over `context` keys: q.k and p.v, all layers."""
        return 4.0 * self.layers * self.heads * self.head_dim * context


@dataclass(frozen=True)
class Rates:
    """The host's measured limits: FLOP/s of the compute dtype, bytes/s of memory reads."""

    flops: float
    bandwidth: float


def decode_step_s(s: Shapes, r: Rates, rows: int, weight_bytes: int, context: float = 0.0, kv_bytes: int = 2) -> float:
    """A decode step of `rows` sequences at `context` tokens each: weights (+ their KV) read once
    vs every row's FLOPs, whichever takes longer."""
    read = s.linear_params * weight_bytes + rows * context * s.kv_bytes_per_token(kv_bytes)
    flops = rows * (2.0 * s.linear_params + s.attention_flops(context))
    return max(read / r.bandwidth, flops / r.flops)


def prefill_s(s: Shapes, r: Rates, tokens: int, sequences: int = 1, start: int = 0) -> float:
    """`tokens` prompt tokens (each of `sequences` prompts of tokens / sequences, from position
    `start`): the layers' FLOPs for every token, the lm_head for each prompt's last only."""
    per_seq = tokens / sequences
    mean_context = start + (per_seq + 1) / 2
    flops = tokens * (2.0 * s.layers * s.layer_params + s.attention_flops(mean_context))
    flops += sequences * 2.0 * s.vocab * s.hidden
    return flops / r.flops


def serving_tok_s(s: Shapes, r: Rates, streams: int, prompt: int, output: int, weight_bytes: int,
                  kv_bytes: int = 2) -> float:
    """Output tok/s of N concurrent streams, each request `prompt` tokens in, `output` out, in waves
    of N: the N prompts' prefill then `output` decode steps of N rows (mean context mid-output)."""
    pre = prefill_s(s, r, streams * prompt, streams)
    steps = output * decode_step_s(s, r, streams, weight_bytes, prompt + output / 2, kv_bytes)
    return streams * output / (pre + steps)


def bounds(s: Shapes, r: Rates, weight_bytes: int, rows: list[int], streams: list[int], prompt: int,
           output: int, chunk: int = 512) -> dict:
    return {
        "decode_step_ms": {str(b): decode_step_s(s, r, b, weight_bytes) * 1e3 for b in rows},
        "prefill_chunk_ms": prefill_s(s, r, chunk) * 1e3,
        "prefill_chunk_tokens": chunk,
        "serving_tok_s": {str(n): serving_tok_s(s, r, n, prompt, output, weight_bytes) for n in streams},
    }


def fractions(serving_bound: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    return {n: tok / serving_bound[n] for n, tok in measured.items() if n in serving_bound}


def load_roofline(path: str, model_dir: str, run: dict | None = None) -> dict:
    """What a run embeds of a roofline JSON written on THIS host (or on the host of `run`, a
    finished run's provenance) for the same model (its rates and shapes, and where they came
    from), so its renderer can print speeds as fractions of the bound. A roofline from another
    host or model is refused: such a fraction is meaningless."""
    from bench.provenance import provenance

    data = json.loads(Path(path).read_text())
    theirs, ours = data.get("provenance") or {}, run if run is not None else provenance("engine.roofline", [])
    if (theirs.get("host"), theirs.get("cpu")) != (ours.get("host"), ours.get("cpu")):
        where = "the run's host" if run is not None else "this host"
        raise SystemExit(f"--roofline {path}: measured on {theirs.get('host')!r} ({theirs.get('cpu')}), "
                         f"not {where} {ours.get('host')!r} ({ours.get('cpu')}): its bounds do not apply there")
    if Path(data["model_dir"]).resolve() != Path(model_dir).resolve():
        raise SystemExit(f"--roofline {path}: computed for {data['model_dir']}, not {model_dir}")
    return {"source": str(path), "provenance": theirs, "shapes": data["shapes"], "threads": data.get("threads"),
            "matmul_flops": data["matmul_flops"], "read_bandwidth": data["read_bandwidth"],
            "workload": data.get("workload")}


def embedded_rates(roof: dict, dtype: str) -> tuple[Shapes, Rates]:
    """The shapes and the rates (peak FLOP/s of DTYPE's compute, read bandwidth) of a roofline
    embedded by `load_roofline`."""
    compute = "float32" if dtype == "float32" else "bfloat16"
    return Shapes(**roof["shapes"]), Rates(flops=max(roof["matmul_flops"][compute].values()),
                                           bandwidth=roof["read_bandwidth"])


# -- measuring the host ---------------------------------------------------------------------
def best_s(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_flops(s: Shapes, dtype, rows: int, reps: int) -> float:
    """FLOP/s of `F.linear` over the decoder layers' linear shapes at `rows` rows, each best of
    `reps`; in bf16 also oneDNN's matmul on a prepacked weight (what the engine's bf16 forward
    runs), the faster of the two per shape. The lm_head is left out: a prefill chunk (where the
    peak bounds the time) runs it on each prompt's last row only, and its one very wide GEMM at
    512 rows ran at 0.78 TFLOP/s on the AMX host against 1.5-2.0 for the layers' shapes, which
    put the peak at 1.02 TFLOP/s while the engine's own prefill linears ran at ~1.57."""
    import torch
    import torch.nn.functional as F

    packs = dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    flops = seconds = 0.0
    with torch.inference_mode():
        for _, n, k in [shape for shape in s.linears() if shape[0] != "lm_head"]:
            w, x = torch.randn(n, k, dtype=dtype), torch.randn(rows, k, dtype=dtype)
            t = best_s(lambda: F.linear(x, w), reps)
            if packs:
                pw = torch.ops.mkldnn._reorder_linear_weight(w, rows)
                t = min(t, best_s(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""), reps))
            seconds += t
            flops += 2.0 * rows * n * k
    return flops / seconds


def read_bandwidth(mb: int, reps: int, tensor=None) -> float:
    """Bytes/s of summing an fp32 tensor of `mb` MiB (reads it once), best of `reps`: a new one, or
    `tensor` (of that size) where the caller keeps one to reread the same pages."""
    import torch

    t = torch.ones(mb * 2**20 // 4) if tensor is None else tensor
    with torch.inference_mode():
        return t.numel() * 4 / best_s(t.sum, reps)


def cpu_info() -> dict:
    info = {"model": "unknown", "flags": []}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and info["model"] == "unknown":
                info["model"] = value.strip()
            elif key.strip() == "flags" and not info["flags"]:
                info["flags"] = value.split()
    except OSError:
        pass
    info["isa"] = [f for f in ISA_FLAGS if f in info["flags"]]
    info["cores"] = os.cpu_count()
    return info


def onednn_info(probe: bool) -> dict:
    import torch

    out = {"mkldnn": torch.backends.mkldnn.is_available(),
           "bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
           "amx_tile": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())}
    if probe:                               # oneDNN names the ISA it dispatches to on its first primitive
        code = "import torch; torch.nn.functional.linear(torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16())"
        env = dict(os.environ, ONEDNN_VERBOSE="1")
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        out["verbose_isa"] = next((ln.split("isa:", 1)[1].strip() for ln in res.stdout.splitlines() if "isa:" in ln), None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a model dir ('default': SmolLM2-135M)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(WEIGHT_BYTES), help="weights the bounds assume")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rows", default="1,8,32,512")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--prompt-tokens", type=int, default=286)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--bandwidth-mb", type=int, default=512, help="size of the tensor read for bandwidth")
    p.add_argument("--no-isa-probe", action="store_true", help="skip the ONEDNN_VERBOSE subprocess")
    p.add_argument("--measured", default="", help="served output tok/s per stream count: 1=29.8,8=138.1")
    p.add_argument("--json-out", default="bench/results/roofline.json")
    args = p.parse_args(argv)

    import torch

    from bench.provenance import provenance, write_json
    from engine.models import resolve_model

    prov = provenance("engine.roofline", argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    shapes = Shapes.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    cpu, onednn = cpu_info(), onednn_info(not args.no_isa_probe)
    print(f"CPU: {cpu['model']} ({cpu['cores']} logical CPUs, {torch.get_num_threads()} torch threads)")
    print(f"ISA flags: {' '.join(cpu['isa']) or 'none of ' + ', '.join(ISA_FLAGS)}")
    print(f"oneDNN: {onednn}")

    rows = [int(r) for r in args.rows.split(",")]
    matmul = {name: {str(m): matmul_flops(shapes, dt, m, args.reps) for m in rows}
              for name, dt in (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
    for name, per_rows in matmul.items():
        print(f"{name:>8} matmul GFLOP/s: " + ", ".join(f"{m} rows {v / 1e9:.1f}" for m, v in per_rows.items()))
    bandwidth = read_bandwidth(args.bandwidth_mb, max(3, args.reps // 4))
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s (sum of {args.bandwidth_mb} MiB, best of {max(3, args.reps // 4)})")

    compute = "float32" if args.dtype == "float32" else "bfloat16"
    rates = Rates(flops=max(matmul[compute].values()), bandwidth=bandwidth)
    streams = [int(n) for n in args.streams.split(",")]
    result = bounds(shapes, rates, WEIGHT_BYTES[args.dtype], [1, 8, 32], streams, args.prompt_tokens,
                    args.output_tokens)
    print(f"{args.model} ({shapes.linear_params / 1e6:.1f} M linear params, {args.dtype} weights: "
          f"{shapes.linear_params * WEIGHT_BYTES[args.dtype] / 1e6:.0f} MB a step); peak {compute} "
          f"{rates.flops / 1e9:.0f} GFLOP/s")
    print("decode step bound: " + ", ".join(f"{b} rows {ms:.2f} ms" for b, ms in result["decode_step_ms"].items()))
    print(f"prefill chunk of {result['prefill_chunk_tokens']} tokens: {result['prefill_chunk_ms']:.1f} ms")
    measured = {n: float(v) for n, v in (kv.split("=") for kv in args.measured.split(",") if kv)}
    frac = fractions(result["serving_tok_s"], measured)
    for n, tok in result["serving_tok_s"].items():
        extra = f"; measured {measured[n]:.1f} = {frac[n]:.0%} of it" if n in frac else ""
        print(f"serving {n} streams ({args.prompt_tokens} in / {args.output_tokens} out): bound {tok:.0f} tok/s{extra}")
    write_json(args.json_out, prov, args=vars(args), model_dir=model_dir, shapes=asdict(shapes), dtype=args.dtype,
               cpu=cpu, onednn=onednn, threads=torch.get_num_threads(), reps=args.reps, matmul_flops=matmul,
               read_bandwidth=bandwidth, rates=asdict(rates), bounds=result, measured_tok_s=measured,
               fraction_of_bound=frac,
               workload={"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens})
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
