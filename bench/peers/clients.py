"""The two load clients of `bench.peers`, both closed loops of C concurrent streams with
synthetic prompts of P tokens and outputs of exactly N tokens (`ignore_eos`, greedy):

- `guidellm`: GuideLLM's CLI from its own venv (`guidellm run`, concurrent profile),
  run as a bounded subprocess; its JSON report is parsed by `peers_report`.
- `loadgen`: this repository's own client (`bench.replay.replay` over SSE through
  `bench.drivers.SseDriver`), for when GuideLLM is not installed or cannot run, and the
  only one that sends the input-grounded prompts (`run_grounded`: bench.engine.speculative's
  edit and summarize messages, where n-gram speculation finds its drafts in the prompt) and
  its JSON asks under its schema (`run_structured`, structured output).

Both report one row per concurrency (see `peers_report`), with the same
definitions: output tokens/s over the level's wall time, TTFT per request, and ITL as
each request's (latency - TTFT) / (tokens - 1); a grounded row also names its workload.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.peers import report as peers_report
from bench.serving import servestats
from bench.serving.drivers import SseDriver
from bench.serving.loadgen import Req, Workload
from bench.serving.replay import replay
from bench.workload import _text


@dataclass(frozen=True)
class Load:
    """What every client sends at one concurrency level."""

    concurrency: int
    requests: int
    prompt_tokens: int              # synthetic prompts' length; 0 for grounded ones (counted per row)
    output_tokens: int
    max_seconds: float
    first: int = 0                  # synthetic prompts the run's earlier levels sent: this level's are new


# -- GuideLLM ---------------------------------------------------------------------------------------
def guidellm_command(exe: str, url: str, model: str, model_dir: str, api_key: str, load: Load, out: Path) -> list[str]:
    """GuideLLM 0.8.1's CLI (`guidellm run`, options as `kind=...,key=value`) for one
    concurrency level. Its tokenizer is the local model dir, so synthetic prompts are
    counted in the model's own tokens without a hub.

    The data loader prefetches only the level's own requests: GuideLLM's default
    (`prefetch_factor=4096`) has its data worker generate 4,096 synthetic prompts, ~7 s of
    a whole core, while the level runs, so on a 2-core host the client took a core from a
    server that uses both (docs/bench/HISTORY.md, "GuideLLM's prompt worker").

    Each level has its own seed (GuideLLM's 42 plus the prompts earlier levels sent): with one
    seed every run of `guidellm` generates the same prompts in the same order, so until
    2026-12-06 a level re-sent the previous level's (8 of 16 at 8 streams, 16 of 64 at 32),
    which every server's prefix cache served while the roofline's bound assumed them prefilled."""
    return [exe, "run", "--disable-console-interactive",
            "--backend", f"kind=openai_http,target={url},model={model},api_key={api_key},"
                         "request_format=/v1/chat/completions",
            "--tokenizer", f"kind=huggingface_auto,model={model_dir}",
            "--profile", f"kind=concurrent,streams={load.concurrency}",
            "--data", f"kind=synthetic_text,prompt_tokens={load.prompt_tokens},output_tokens={load.output_tokens}",
            "--data-loader", f"kind=pytorch,prefetch_factor={load.requests}",
            "--seed", f"kind=static,value={42 + load.first}",
            "--constraint", f"kind=max_requests,count={load.requests}",
            "--constraint", f"kind=max_duration,seconds={int(load.max_seconds)}",
            "--output", f"kind=json,path={out}"]


def run_guidellm(exe: str, url: str, model: str, model_dir: str, api_key: str, load: Load, workdir: Path) -> dict:
    """One GuideLLM run, bounded by `max_seconds` plus a margin; returns its row."""
    out = workdir / f"guidellm-c{load.concurrency}.json"
    log = workdir / f"guidellm-c{load.concurrency}.log"
    cmd = guidellm_command(exe, url, model, model_dir, api_key, load, out)
    shown = shlex.join(cmd).replace(api_key, "<key>") if api_key else shlex.join(cmd)
    print(f"running: {shown}", file=sys.stderr, flush=True)     # the key is the run's own, still not logged
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=load.max_seconds + 180)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc != 0 or not out.exists():
        why = "timed out" if rc is None else f"exited {rc}"
        raise RuntimeError(f"GuideLLM {why}; its log:\n" + log.read_text(errors="replace")[-3000:])
    rows = peers_report.rows_from_guidellm(json.loads(out.read_text()))
    return next(r for r in rows if r["concurrency"] == load.concurrency)


# -- loadgen ------------------------------------------------------------------------------------------
def token_prompts(model_dir: str, n: int, tokens: int, seed: int = 0) -> list[str]:
    """n texts of `tokens` tokens each in the model's tokenizer (random English words cut
    to length), distinct from their first words on so no prefix cache helps."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = tok(_text(rng, tokens), add_special_tokens=False)["input_ids"]
        out.append(tok.decode(ids[:tokens]))
    return out


def loadgen_records(url: str, api_key: str, load: Load, prompts: list[str], tag: str = "peers",
                    extra: dict | None = None) -> list[dict]:
    """`load.concurrency` users each sending its next request when the previous ends, the
    i-th request's user message being `prompts[i % len(prompts)]` (`extra`: more body fields);
    one `replay` record per request. The requests name no model: each server answers with the
    one it serves."""
    reqs = [Req(f"{tag}-c{load.concurrency}-{i}", "bench", "peers", None, i % load.concurrency, 0.0,
                [{"role": "user", "content": prompts[i % len(prompts)]}], load.prompt_tokens, load.output_tokens,
                extra=extra)
            for i in range(load.requests)]
    wl = Workload(name=f"{tag}-c{load.concurrency}", num_requests=load.requests, duration_s=load.max_seconds,
                  arrival="closed", users=load.concurrency)
    driver = SseDriver(url, {"bench": api_key})

    async def go() -> list[dict]:
        await driver.open(reqs)
        try:
            return await replay(reqs, wl, driver.send, time_limit=load.max_seconds + 120,
                                label=f"{tag} c={load.concurrency}")
        finally:
            await driver.close()

    return asyncio.run(go())


def level_prompts(prompts: list[str], load: Load) -> list[str]:
    """The level's own synthetic prompts: the `load.requests` after those earlier levels sent
    (`prompts` holds the whole run's), so no level re-sends another's to a prefix cache."""
    return prompts[load.first:load.first + load.requests]


def run_loadgen(url: str, api_key: str, load: Load, prompts: list[str]) -> dict:
    """One level of synthetic prompts (`level_prompts`) through `loadgen_records`; returns its row."""
    recs = loadgen_records(url, api_key, load, level_prompts(prompts, load))
    return peers_report.row_from_summary(servestats.summarize(recs, [], 1e9, 1e9), load.concurrency)


def run_grounded(url: str, api_key: str, load: Load, workload: str, messages: list[str],
                 extra: dict | None = None) -> dict:
    """One level of `load.requests` requests cycling over `messages` (one grounded message,
    edit or summarize; or run_structured's asks) through `loadgen_records`; returns its row
    with `workload` and `prompt_tokens`, the distinct prompt lengths the server reported."""
    recs = loadgen_records(url, api_key, load, messages, tag=workload, extra=extra)
    row = peers_report.row_from_summary(servestats.summarize(recs, [], 1e9, 1e9), load.concurrency)
    counted = sorted({r["prompt_tokens"] for r in recs if r["prompt_tokens"] is not None})
    return {"workload": workload, **row, "prompt_tokens": counted}


def run_structured(url: str, api_key: str, load: Load) -> dict:
    """One level of bench.engine.speculative's JSON asks under its schema (`response_format`
    json_schema, strict; each answer ends where the schema closes, so no `ignore_eos`): the
    structured output agent frameworks ask for. One row, workload "json"."""
    from bench.engine.speculative import JSON_ASKS, JSON_SCHEMA

    fmt = {"type": "json_schema", "json_schema": {"name": "records", "schema": json.loads(JSON_SCHEMA), "strict": True}}
    return run_grounded(url, api_key, load, "json", JSON_ASKS, extra={"ignore_eos": False, "response_format": fmt})


def warm_up(url: str, model: str, api_key: str, timeout_s: float = 300.0) -> float:
    """One short chat request before measuring (first-call costs stay out of the numbers);
    returns its seconds."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Hello, how are you today?"}],
            "max_tokens": 8, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"},
                   timeout=timeout_s)
    r.raise_for_status()
    return time.perf_counter() - t0
