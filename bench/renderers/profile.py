"""docs/BENCHMARKS.md §1's decode steps in process and §8's `torch.compile` table
(`bench.engine.profile_decode --forwards` and `--serving`)."""

from __future__ import annotations

from bench.renderers.common import caption, table

SHORT = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}


def _vs(compiled: float, eager: float) -> str:
    """'1.68× slower' / '1.04× faster': the compiled time against the eager one."""
    if not compiled or not eager:
        return "—"
    return f"{compiled / eager:.2f}× slower" if compiled >= eager else f"{eager / compiled:.2f}× faster"


def _steps(run: dict, kind: str) -> str:
    e, c = run["steps"]["eager"][kind], run["steps"]["compiled"][kind]
    return f"{e} steps" if e == c else f"{c} / {e} steps"


def render_serving(data: dict, name: str) -> str:
    a, runs = data["args"], data["runs"]
    threads = sorted({r["threads"] for r in runs})
    extra = (f"; {a['num_requests']} requests (prompts 16–{a['max_prompt']}, outputs 4–{a['max_output']} tokens, "
             f"greedy) arriving one per step, at most 32 running, 256-token steps, an eager and a compiled engine "
             f"stepping in turn; {'/'.join(map(str, threads))} threads; each dtype in its own process with a fresh "
             "(cold) inductor cache; times are the steps' forward passes, compiled / eager")
    rows = []
    for r in runs:
        fw = r["forward_s"]
        c_dec, c_pre = fw["compiled"]["decode-only"], fw["compiled"]["with prefill"]
        e_dec, e_pre = fw["eager"]["decode-only"], fw["eager"]["with prefill"]
        rows.append([SHORT.get(r["dtype"], r["dtype"]), f"{r['compile_time_s']:.0f} s",
                     f"{c_dec:.2f} / {e_dec:.2f} s, {_steps(r, 'decode-only')} (**{_vs(c_dec, e_dec)}**)",
                     f"{c_pre:.2f} / {e_pre:.2f} s, {_steps(r, 'with prefill')} ({_vs(c_pre, e_pre)})",
                     f"{r['graphs_startup']} / {r['graphs_after_startup']}", r["graph_breaks"],
                     f"{r['greedy_equal']} / {r['requests']}"])
    head = ["dtype", "compile time", "decode-only steps", "steps with prefill", "graphs at start-up / after",
            "graph breaks", "greedy outputs equal"]
    return "\n".join([caption(data, name, extra), "", *table(head, rows)])


def render_forwards(data: dict, name: str) -> str:
    """A line per batch size; each cell holds the thread counts' figures in turn ("12.5 / 8.8")."""
    a, paths = data["args"], data["paths"]
    by = {(r["rows"], r["threads"], r["path"]): r["median_s"] for r in data["rows"]}
    threads = sorted({t for _, t, _ in by})
    others = [k for k in paths if k != "fused"]
    extra = (f"; decode steps of sequences with {a['min_ctx']:,}–{a['max_ctx']:,} tokens of context each, the median "
             f"of {a['steps']} whole engine steps per path and thread count, the engines and the thread counts "
             f"taking turns (adaptive threads off); {data.get('kernels') or 'no C++'} kernels; each cell gives "
             f"{' / '.join(map(str, threads))} threads; the transformers columns give their step over the fused one's")

    def cells(n: int, fmt) -> str:
        return " / ".join(fmt(n, t) if (n, t, "fused") in by else "—" for t in threads)

    rows = []
    for n in sorted({n for n, _, _ in by}):
        rows.append([n, SHORT.get(data["dtype"], data["dtype"]),
                     cells(n, lambda n, t: f"{by[n, t, 'fused'] * 1e3:.1f}"),
                     cells(n, lambda n, t: f"{n / by[n, t, 'fused']:,.0f}"),
                     *(cells(n, lambda n, t, k=k: f"{by[n, t, k] / by[n, t, 'fused']:.2f}×") for k in others)])
    head = ["rows", "dtype", f"{paths['fused']}: ms per step", "tok/s", *(paths[k] for k in others)]
    return "\n".join([caption(data, name, extra), "", *table(head, rows)])


RENDERERS = {"engine.profile_decode serving": render_serving, "engine.profile_decode forwards": render_forwards}
