"""The host's roofline probed beside each level of a peers run (`bench.peers`, on by default for
synthetic prompts; `--no-probe` leaves it out).

Why: the bound a level is measured against moves with the host. On the shared Zen 4 host the
roofline's read bandwidth measured 49.2, 29.6 and 30.8 GB/s within two minutes (2026-12-06), so a
roofline taken once, minutes from a level, puts that level anywhere between ~60 and ~90 % of
it. Here the bench process measures what bench.engine.roofline does (bf16 matmul GFLOP/s over
the model's decoder linears at 512 rows, the faster of `F.linear` and oneDNN's prepacked weight;
a large tensor's read bandwidth; best of a few reps each, about half a second) before the first
level and after every level: level i lies between probes i and i + 1, and its bound takes the
higher of the two (so it flatters no one).

A probe first waits (up to IDLE_WAIT_S) until the machine's CPUs are idle (under IDLE_BUSY busy
over half a second): a server still finishing a level's last requests, vLLM's workers after its
start, or the elastic pool's spinning helper would otherwise be measured as a slow host (the
first probed run on the Zen 4 host, 2026-12-06, saw 97 GFLOP/s right after vLLM's warm-up, 218
right after a 32-stream level, against 330-447 elsewhere). The busy share it saw is recorded
with the probe. The bound's workload is the served one: the prompt with the model's chat
template as the servers tokenize it, the run's output tokens.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from bench.engine.roofline import WEIGHT_BYTES, Rates, Shapes, matmul_flops, serving_tok_s
from bench.engine.roofline import read_bandwidth as roofline_read_bandwidth

IDLE_BUSY = 0.10    # the machine's CPU share busy below which a probe starts
IDLE_WAIT_S = 20.0  # the longest a probe waits for that (bench.peers --probe-wait)
ROWS = 512          # the roofline's bf16 peak is its 512-row GEMM on every host measured so far
BANDWIDTH_MB = 512  # as bench.engine.roofline


def templated_tokens(model_dir: str, prompt_tokens: int) -> int:
    """Tokens of a `prompt_tokens`-token user message once the model's chat template wraps it
    (a generation prompt added, as the servers do); the message itself where there is no template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tok, "chat_template", None):
        return prompt_tokens
    text = " hello" * prompt_tokens                 # the template's own tokens are what is measured
    plain = len(tok(text, add_special_tokens=False)["input_ids"])
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    wrapped = len(tok(rendered, add_special_tokens=False)["input_ids"])
    return prompt_tokens + max(0, wrapped - plain)


def setup(model_dir: str, prompt_tokens: int, output_tokens: int, reps: int, idle_wait_s: float = IDLE_WAIT_S) -> dict:
    """What the probes and the renderer need: the model's shapes, the bound's workload, the torch
    threads the probes run on, how many reps each takes and how long each waits for an idle machine."""
    import torch

    shapes = Shapes.from_config(json.loads((Path(model_dir) / "config.json").read_text()))
    return {"shapes": asdict(shapes), "threads": torch.get_num_threads(), "reps": reps, "rows": ROWS,
            "idle_wait_s": idle_wait_s,
            "bandwidth_mb": BANDWIDTH_MB, "workload": {"prompt_tokens": templated_tokens(model_dir, prompt_tokens),
                                                       "output_tokens": output_tokens}}


def cpu_busy(interval_s: float = 0.5) -> float | None:
    """The share of all CPUs' time busy over `interval_s` (/proc/stat), None where there is none."""
    def snapshot() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]                      # all, idle + iowait

    try:
        total0, idle0 = snapshot()
        time.sleep(interval_s)
        total1, idle1 = snapshot()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_idle(limit_s: float = IDLE_WAIT_S) -> float | None:
    """Waits until the machine is idle (below IDLE_BUSY), at most `limit_s`; the last busy share."""
    deadline = time.monotonic() + limit_s
    while True:
        busy = cpu_busy()
        if busy is None or busy < IDLE_BUSY or time.monotonic() >= deadline:
            return busy


_buffer: dict[int, object] = {}


def read_bandwidth(mb: int, reps: int) -> float:
    """bench.engine.roofline's read bandwidth (bytes/s of summing `mb` MiB of fp32, best of `reps`),
    on one tensor kept for the process's probes, so that every probe reads the same pages (one
    variable fewer). In the first three probed runs on the Zen 4 host (2026-12-06) a fresh tensor
    a probe read 26-31 GB/s beside every streamgate level and 30-62 beside vLLM's. The fourth,
    recording both: the kept tensor 30.2-35.1 GB/s at most probes and 61-63 at three (after a
    level of each server), a fresh one 27.9-53.6. So the host's memory itself moves by 2x within
    minutes, whatever the pages; `probe` records both figures."""
    import torch

    if mb not in _buffer:
        _buffer[mb] = torch.ones(mb * 2**20 // 4)
    return roofline_read_bandwidth(mb, reps, tensor=_buffer[mb])


def probe(info: dict) -> dict:
    """One probe, once the machine is idle: when, the busy share it waited for, bf16 and fp32 matmul
    FLOP/s at ROWS rows and read bandwidth (bytes/s; of the probes' one tensor, and of a fresh one as
    bench.engine.roofline reads), best of reps."""
    import torch

    shapes, reps = Shapes(**info["shapes"]), info["reps"]
    busy = wait_idle(info["idle_wait_s"])
    return {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "busy": busy,
            "bf16_flops": matmul_flops(shapes, torch.bfloat16, info["rows"], reps),
            "fp32_flops": matmul_flops(shapes, torch.float32, info["rows"], reps),
            "read_bandwidth": read_bandwidth(info["bandwidth_mb"], reps),
            "fresh_read_bandwidth": roofline_read_bandwidth(info["bandwidth_mb"], reps)}


def level_rates(row: dict) -> Rates | None:
    """The higher of the probes before and after a level's row (None where it has none)."""
    p = row.get("roofline_probe")
    if not p:
        return None
    return Rates(flops=max(best_flops(p["before"]), best_flops(p["after"])),
                 bandwidth=max(p["before"]["read_bandwidth"], p["after"]["read_bandwidth"]))


def best_flops(probe: dict) -> float:
    """A probe's matmul peak: the faster of its bf16 and fp32 GEMMs. Where the CPU has no bf16 dot
    products (an AVX-512 host without AVX512-BF16, an AVX2 one) oneDNN emulates bf16 at a fraction
    of its fp32 rate, and a bound on that rate would flatter every server; a bf16 model's weights
    can still be read as bf16 and multiplied in fp32. Probes before 2026-12-07 measured bf16 only."""
    return max(probe["bf16_flops"], probe.get("fp32_flops", 0.0))


def level_bound(info: dict, row: dict) -> float | None:
    """A level's bound in output tok/s (bench.engine.roofline's serving model, bf16 weights) from
    its own probes, or None."""
    r = level_rates(row)
    if r is None:
        return None
    w = info["workload"]
    return serving_tok_s(Shapes(**info["shapes"]), r, row["concurrency"], w["prompt_tokens"], w["output_tokens"],
                         WEIGHT_BYTES["bfloat16"])
