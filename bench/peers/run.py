"""Peer benchmark (issue 14): streamgate against vLLM for CPU (and optionally Hugging Face's
`transformers serve`) on this machine, one server at a time, each driven by the same
outside client at 1, 8 and 32 concurrent streams of synthetic 256-token prompts and
64-token outputs.

    python -m bench.peers                                   # the default four servers, GuideLLM
    python -m bench.peers --client loadgen                  # this repository's own client instead
    python -m bench.peers --server sg=streamgate:"--dtype bfloat16" \\
        --server vllm-bf16=vllm:"--dtype bfloat16" --concurrency 1,8,32 --peer vllm-bf16
    python -m bench.peers --workload grounded --output-tokens 200 ...   # edit and summarize prompts

Each server is started on 127.0.0.1 (`bench.peers.servers`), warmed up with one short
request, measured at each concurrency (GuideLLM's concurrent profile, or `--client
loadgen`), and stopped before the next starts. vLLM, `transformers serve` and llama.cpp run
from their own venvs or build (`--vllm-python`, `--hf-python`, `--llama-server`; `python -m
bench.peers.setup` makes them under /work/peers); a server whose program is missing is
skipped with a note. Output: a table on stdout with ratios against `--peer`, and JSON +
markdown in `--out-dir`. The machine should be otherwise idle: the 1-minute load average is recorded before each
server and a warning is printed when it is above `--max-load`.

`--roofline PATH` embeds a roofline of this host and model (bench.engine.roofline): the report then
gives each level's bound (bf16 weights) and each server's share of it; `--attach PEERS_JSON
--roofline PATH` adds one measured beside a run already written, without running anything.

`--workload structured` sends bench.engine.speculative's JSON asks (records) with a strict
json_schema `response_format`, each answer ending where the schema closes (no ignore_eos): one
row a level, workload "json".

`--workload grounded` sends, instead of synthetic prompts, bench.engine.speculative's
input-grounded messages (`grounded_messages`: edit a ~1.6k-token document with one word
replaced, summarize it), where n-gram speculation drafts from the prompt: at each
concurrency, the level's requests of edit, then of summarize, one row each, greedy and
exactly `--output-tokens` tokens. Only the loadgen client can send them (the default
client then). Each prompt repeats, so after its first request a server's prefix cache
holds its prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.engine.roofline import load_roofline
from bench.engine.speculative import grounded_messages
from bench.peers import clients as peers_clients
from bench.peers import llamacpp as peers_llamacpp
from bench.peers import probe as peers_probe
from bench.peers import report as peers_report
from bench.peers import servers as peers_servers
from bench.peers.clients import Load
from bench.provenance import provenance, write_json
from engine.config_cli import add_engine_args

# vLLM's CPU layout is set in its environment, so the JSON records it; only these (never a key).
VLLM_LAYOUT_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE")
PEERS_DIR = Path(os.environ.get("STREAMGATE_PEERS_DIR", "/work/peers"))


def _terminate(signum, frame):
    """SIGTERM/SIGHUP unwind like Ctrl-C, so every `finally` stops its server."""
    raise KeyboardInterrupt(f"signal {signum}")


def load_average(max_load: float) -> float:
    """The 1-minute load average, with a warning on stderr when it is above `max_load`."""
    load = os.getloadavg()[0]
    if load > max_load:
        print(f"warning: 1-min load average is {load:.2f} (> {max_load:g}): the machine is not idle, "
              "numbers will be noisy", file=sys.stderr, flush=True)
    return load


def requests_for(concurrency: int, per_stream: float, minimum: int) -> int:
    """Requests sent at one level: `per_stream` per stream, at least `minimum`."""
    return max(minimum, round(per_stream * concurrency))


def peer_python(args) -> dict[str, str]:
    """The python of each peer's own venv (llama.cpp: its llama-server), by kind."""
    return {"vllm": args.vllm_python, "hf": args.hf_python, "llamacpp": args.llama_server}


def available(spec: peers_servers.ServerSpec, args) -> str | None:
    """Why a server cannot run here (its program is missing), else None."""
    python = peer_python(args).get(spec.kind)
    if python and not Path(python).exists():
        return f"{python} not found (python -m bench.peers.setup installs it)"
    return None


def level_rows(args, run: peers_servers.Running, model_dir: str, load: Load, workdir: Path,
               prompts: list[str] | dict[str, str]) -> list[dict]:
    """One level's rows: GuideLLM's or loadgen's synthetic row, or a row per grounded
    message (`prompts` by workload name)."""
    if args.client == "guidellm":
        return [peers_clients.run_guidellm(args.guidellm, run.url, run.model, model_dir, run.api_key, load, workdir)]
    if args.workload == "grounded":
        return [peers_clients.run_grounded(run.url, run.api_key, load, name, [text]) for name, text in prompts.items()]
    if args.workload == "structured":
        return [peers_clients.run_structured(run.url, run.api_key, load)]
    return [peers_clients.run_loadgen(run.url, run.api_key, load, prompts)]


def measure(spec: peers_servers.ServerSpec, args, model_dir: str, loads: list[Load], workdir: Path,
            prompts: list[str] | dict[str, str], probe_info: dict | None = None) -> dict:
    """Start one server, warm it up, run every load level, stop it. With `probe_info` the host's
    roofline is probed (bench/peers/probe.py) before the first level and after each, once the
    machine is idle, and each level's rows carry the probes on either side."""
    result = {"load_before": load_average(args.max_load), "rows": [], "errors": []}
    run = peers_servers.start(spec, model_dir, workdir, peer_python=peer_python(args), timeout_s=args.start_timeout)
    result["url"] = run.url
    try:
        result["warmup_s"] = peers_clients.warm_up(run.url, run.model, run.api_key)
        before = peers_probe.probe(probe_info) if probe_info else None
        for load in loads:
            each = f" of each of {', '.join(prompts)}" if args.workload != "synthetic" else ""
            print(f"== {spec.name}: {load.concurrency} streams, {load.requests} requests{each} via {args.client}",
                  file=sys.stderr, flush=True)
            try:
                rows = level_rows(args, run, model_dir, load, workdir, prompts)
                if probe_info:
                    after = peers_probe.probe(probe_info)
                    for row in rows:
                        row["roofline_probe"] = {"before": before, "after": after}
                    before = after
                result["rows"] += rows
            except Exception as exc:            # recorded; the other levels and servers still run
                print(f"{spec.name} at {load.concurrency} streams failed: {exc}", file=sys.stderr, flush=True)
                result["errors"].append(f"{load.concurrency} streams: {str(exc)[:2000]}")
    finally:
        peers_servers.stop(run)
        result["info"] = {**run.info, **peers_servers.threads_info(spec.kind, run.log)}
        result["load_after"] = os.getloadavg()[0]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--server", action="append", default=None,
                   help="NAME=KIND[:FLAGS], KIND in streamgate|vllm|hf (repeatable; default: "
                        + ", ".join(peers_servers.DEFAULT_SERVERS) + ")")
    add_engine_args(p, only=("model",))
    p.add_argument("--workload", default="synthetic", choices=["synthetic", "grounded", "structured"],
                   help="synthetic: random words of --prompt-tokens; grounded: bench.engine.speculative's "
                        "edit and summarize messages; structured: its JSON asks under its schema "
                        "(both loadgen client only)")
    p.add_argument("--client", default=None, choices=["guidellm", "loadgen"],
                   help="default: guidellm for synthetic prompts, loadgen for grounded ones")
    p.add_argument("--guidellm", default=os.environ.get("GUIDELLM", str(PEERS_DIR / "guidellm/bin/guidellm")))
    p.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", str(PEERS_DIR / "vllm/bin/python")))
    p.add_argument("--hf-python", default=os.environ.get("HF_SERVE_PYTHON", str(PEERS_DIR / "hf/bin/python")),
                   help="python of a venv with transformers[serving] (for --server NAME=hf)")
    p.add_argument("--llama-server",
                   default=os.environ.get("LLAMA_SERVER", str(peers_llamacpp.server_binary(PEERS_DIR / "llamacpp"))),
                   help="llama.cpp's llama-server, built by bench.peers.setup --only llamacpp "
                        "(for --server NAME=llamacpp)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated stream counts")
    p.add_argument("--prompt-tokens", type=int, default=256, help="synthetic prompts' length")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests-per-stream", type=float, default=2.0)
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    p.add_argument("--max-seconds", type=float, default=300.0, help="bound on each level's run")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="bound on a server's start-up (s); vLLM compiles its model on first start")
    p.add_argument("--peer", default="vllm-bf16", help="server the ratios are against")
    p.add_argument("--max-load", type=float, default=0.5, help="warn when the 1-min load average is above this")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--roofline", default=None,
                   help="a roofline JSON of this host and model (bench.engine.roofline, measured beside the run): "
                        "the report then gives each level's share of the bound")
    p.add_argument("--no-probe", action="store_true",
                   help="do not probe the roofline beside each level (bench/peers/probe.py; never for grounded runs)")
    p.add_argument("--probe-wait", type=float, default=peers_probe.IDLE_WAIT_S,
                   help="seconds a probe waits at most for the machine to be idle")
    p.add_argument("--attach", default=None, metavar="PEERS_JSON",
                   help="with --roofline: add it to this peers.json (a run it was measured beside) and exit")
    args = p.parse_args(argv)
    if args.attach:
        if not args.roofline:
            p.error("--attach needs --roofline")
        return attach(args.attach, args.roofline, argv)
    if args.workload != "synthetic" and args.client == "guidellm":
        p.error(f"--workload {args.workload} needs --client loadgen: GuideLLM sends only its own synthetic prompts")
    args.client = args.client or ("loadgen" if args.workload != "synthetic" else "guidellm")
    prov = provenance("peers", argv)

    try:
        specs = [peers_servers.parse_server(s) for s in args.server or peers_servers.DEFAULT_SERVERS]
    except ValueError as exc:
        p.error(str(exc))
    if len({s.name for s in specs}) != len(specs):
        p.error("--server names must be unique")
    if args.client == "guidellm" and not Path(args.guidellm).exists():
        p.error(f"--guidellm {args.guidellm}: not found (install it, or use --client loadgen)")
    from engine.models import resolve_model

    model_dir = str(resolve_model(args.model))
    roof = load_roofline(args.roofline, model_dir) if args.roofline else None     # refuses another host's
    prompt_tokens = args.prompt_tokens if args.workload == "synthetic" else 0
    loads, first = [], 0
    for c in map(int, args.concurrency.split(",")):       # each level's synthetic prompts new (clients.Load.first)
        n = requests_for(c, args.requests_per_stream, args.min_requests)
        loads.append(Load(c, n, prompt_tokens, args.output_tokens, args.max_seconds, first=first))
        first += n
    if args.workload == "grounded":
        prompts = grounded_messages()
    elif args.workload == "structured":
        prompts = {"json": ""}                          # run_structured's asks (bench.engine.speculative)
    elif args.client == "loadgen":
        prompts = peers_clients.token_prompts(model_dir, sum(ld.requests for ld in loads), args.prompt_tokens)
    else:
        prompts = []
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    report = {"args": vars(args), "model_dir": model_dir, "cpus": os.cpu_count(), "loads": [asdict(ld) for ld in loads],
              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "servers": {}, "skipped": [],
              "env": {k: v for k, v in os.environ.items() if k in VLLM_LAYOUT_ENV}}   # vLLM's thread layout
    if roof is not None:
        report["roofline"] = roof
    probe_info = None
    if not args.no_probe and args.workload == "synthetic":
        report["probe"] = probe_info = peers_probe.setup(model_dir, args.prompt_tokens, args.output_tokens, reps=5,
                                                             idle_wait_s=args.probe_wait)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for spec in specs:
        if why := available(spec, args):
            report["skipped"].append(f"{spec.name} skipped: {why}")
            print(f"skipping {spec.name}: {why}", file=sys.stderr, flush=True)
            continue
        workdir = out / "peers" / spec.name             # its log and GuideLLM's reports stay for a look
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            report["servers"][spec.name] = measure(spec, args, model_dir, loads, workdir, prompts, probe_info)
        except Exception as exc:                # e.g. it did not start: recorded, the next one runs
            report["servers"][spec.name] = {"rows": [], "errors": [f"failed: {str(exc)[:3000]}"]}
            print(f"{spec.name}: {exc}", file=sys.stderr, flush=True)
        write(report, out, args.peer, prov)             # after each server: a later failure loses nothing
    results, notes = write(report, out, args.peer, prov)
    print("\n".join(peers_report.format_text(results, args.peer)))
    print("\n".join(notes))
    print(f"wrote {out / 'peers.json'} and {out / 'peers.md'}")
    return 0 if all(s["rows"] for s in report["servers"].values()) and report["servers"] else 1


def attach(peers_json: str, roofline: str, argv: list[str] | None) -> int:
    """Adds a roofline measured beside a finished run to its peers.json (which keeps its own
    provenance; the roofline's says when and where it was measured, and `attached` by which
    command), so the report gives that run's fractions of the bound too."""
    path = Path(peers_json)
    data = json.loads(path.read_text())
    roof = load_roofline(roofline, data["model_dir"], run=data.get("provenance") or {})
    roof["attached"] = {"command": "python -m bench.peers " + " ".join(argv or sys.argv[1:]),
                        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps({**data, "roofline": roof}, indent=2, default=str) + "\n")
    print(f"{path}: roofline from {roofline} attached")
    return 0


def write(report: dict, out: Path, peer: str, prov: dict) -> tuple[dict, list[str]]:
    """peers.json (with the run's provenance: `streamgate-bench report` renders it,
    bench/renderers/peers.py) and peers.md in `out` from what has been measured so far."""
    results = {name: s["rows"] for name, s in report["servers"].items()}
    notes = list(report["skipped"])
    for name, s in report["servers"].items():
        if "load_before" in s:
            threads = {k: v for k, v in s["info"].items() if k not in ("kind", "flags")}
            notes.append(f"{name}: load average {s['load_before']:.2f} before, {s['load_after']:.2f} after; "
                         f"threads {json.dumps(threads)}")
        notes += [f"{name}: {e.splitlines()[0]}" for e in s["errors"]]
    report["notes"] = notes
    write_json(out / "peers.json", prov, **report)
    (out / "peers.md").write_text(peers_report.format_markdown(results, peer, notes))
    return results, notes

if __name__ == "__main__":
    sys.exit(main())
