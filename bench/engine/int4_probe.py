"""Would int4 weight-only linears pay? Their accuracy, probed before any kernel is built.

    python -m bench.engine.int4_probe [--model default] [--groups 16,32,64] [--ppl-tokens 4096]
                               [--window 512] [--json-out bench/results/int4-probe.json]

Perplexity on bench.engine.int8's held-out text (README.md then docs/ENGINE.md, in windows of
`--window`), transformers' bf16 forward, for: bf16; the engine's int8 (engine/quantization.py,
per-output scales); and round-to-nearest int4 in groups of `--groups` inputs per output, each
group with an fp16 scale, symmetric (codes -8..7, scale max|w| / 7) or asymmetric (codes 0..15,
scale (max - min) / 15 and a zero point), the decoder layers' linears only or the lm_head too
(a tied lm_head gets its own quantized copy, as the engine packs it). The int4 weights are
quantized and put back as bf16 ("fake" quantization): the same numbers an int4 kernel would
multiply, so accuracy is known before the kernel is written. Also the bytes a one-row step
would stream: codes plus one fp16 scale (and zero point) a group.
"""

from __future__ import annotations

import argparse


def fake_int4(w, group: int, symmetric: bool):
    """w [N, K] (K % group == 0) -> (round-to-nearest int4 of w in groups of `group` along K,
    dequantized to w's dtype; the codes; the fp16-rounded scales [N, K / group])."""
    import torch

    n, k = w.shape
    wf = w.float().reshape(n, k // group, group)
    if symmetric:
        scale = (wf.abs().amax(-1) / 7).clamp(min=1e-8).half().float()
        codes = torch.clamp(torch.round(wf / scale[..., None]), -8, 7)
        deq = codes * scale[..., None]
    else:
        lo, hi = wf.amin(-1), wf.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        zero = torch.round(-lo / scale)
        codes = torch.clamp(torch.round(wf / scale[..., None]) + zero[..., None], 0, 15)
        deq = (codes - zero[..., None]) * scale[..., None]
    return deq.reshape(n, k).to(w.dtype), codes.reshape(n, k), scale


def _variants(groups: list[int]) -> list[tuple[str, int, bool, bool]]:
    out = []
    for g in groups:
        for symmetric in (True, False):
            for head in (False, True):
                out.append((f"int4 g{g} {'sym' if symmetric else 'asym'}{' + head' if head else ''}", g, symmetric, head))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--groups", default="16,32,64", help="int4 group sizes (inputs per scale)")
    p.add_argument("--ppl-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--json-out", default="bench/results/int4-probe.json")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.engine.int8 import held_out_ids, perplexity
    from bench.provenance import provenance, write_json
    from engine.models import resolve_model
    from engine.quantization import quantize_linears

    prov = provenance("engine.int4_probe", argv)
    model_dir = str(resolve_model(args.model))
    ids = held_out_ids(AutoTokenizer.from_pretrained(model_dir), args.ppl_tokens)
    rows, layer_params, head_params = [], 0, 0
    for name, group, symmetric, head in [("bf16", 0, True, False), ("int8", 0, True, True)] + \
            _variants([int(g) for g in args.groups.split(",")]):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        with torch.no_grad():
            linears = [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
            layer_params = sum(m.weight.numel() for m in linears)
            head_params = model.lm_head.weight.numel()
            if name == "int8":
                quantize_linears(model)
            elif group:
                for m in linears:
                    m.weight.copy_(fake_int4(m.weight, group, symmetric)[0])
                if head:
                    lm = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=False,
                                         dtype=torch.bfloat16)
                    lm.weight = torch.nn.Parameter(fake_int4(model.lm_head.weight.detach().clone(), group, symmetric)[0])
                    model.lm_head = lm
        ppl = perplexity(model, ids, args.window)
        # Bytes a one-row step streams: int4 codes (half a byte) + an fp16 scale (and zero) a group;
        # a layer-only variant keeps the lm_head in bf16; int8: codes + an fp32 scale an output.
        if name == "bf16":
            nbytes = 2 * (layer_params + head_params)
        elif name == "int8":
            nbytes = layer_params + head_params
        else:
            per = 0.5 + (2 if symmetric else 4) / group
            nbytes = per * layer_params + (per if head else 2) * head_params
        rows.append({"name": name, "group": group, "symmetric": symmetric, "head": head or name == "int8",
                     "perplexity": ppl, "stream_bytes": nbytes})
        print(f"{name:26s} perplexity {ppl:8.3f}  ({ppl / rows[0]['perplexity'] - 1:+.1%})  "
              f"one-row stream {nbytes / 1e6:6.1f} MB", flush=True)
        del model
    path = write_json(args.json_out, prov, args=vars(args), model=model_dir, tokens=len(ids), rows=rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
