"""The servers `bench.peers` compares, each started on loopback one at a time: streamgate
(through `bench.server`), vLLM for CPU from its own venv, and optionally Hugging Face's
`transformers serve` (from its own venv too: the project's does not carry its serving
extras) and llama.cpp's `llama-server` (bench/peers/llamacpp.py). A server spec on the command
line is `NAME=KIND[:FLAGS]`, e.g. `sg-bf16=streamgate:--dtype bfloat16` or
`vllm-fp32=vllm:--dtype float32`.

Threads: streamgate's engine takes torch's default (one OpenMP thread per core) unless
OMP_NUM_THREADS is set; vLLM for CPU binds its OpenMP threads itself
(`VLLM_CPU_OMP_THREADS_BIND`, default `auto`) and keeps a core for its front end, so on
2 cores its model runs on one thread. Both are started with the same environment; what
each used is recorded from the environment and from vLLM's log.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import server
from bench.peers import llamacpp

KINDS = ("streamgate", "vllm", "hf", "llamacpp")
DEFAULT_SERVERS = ("streamgate-fp32=streamgate:--dtype float32", "streamgate-bf16=streamgate:--dtype bfloat16",
                   "vllm-bf16=vllm:--dtype bfloat16", "vllm-fp32=vllm:--dtype float32")
STREAMGATE_FLAGS = ["--policy", "fcfs", "--drain-grace", "2"]
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "4"}         # GiB of KV cache; its default would take much more


@dataclass(frozen=True)
class ServerSpec:
    name: str
    kind: str
    flags: tuple[str, ...] = ()


def parse_server(spec: str) -> ServerSpec:
    """`NAME=KIND[:FLAGS]` (or a bare KIND, named after itself)."""
    name, eq, rest = spec.partition("=")
    if not eq:
        name, rest = spec.split(":", 1)[0], spec
    kind, _, flags = rest.partition(":")
    if kind not in KINDS or not name.strip():
        raise ValueError(f"--server {spec!r}: expected NAME=KIND[:FLAGS] with KIND one of {', '.join(KINDS)}")
    return ServerSpec(name.strip(), kind, tuple(shlex.split(flags)))


@dataclass
class Running:
    """A started server: what a client needs (url, model name, key) and what it ran with."""

    proc: subprocess.Popen
    url: str
    model: str                      # the name its /v1/models reports (clients send it back)
    api_key: str
    log: Path
    own_group: bool                 # started in its own process group (the peers), or streamgate in ours
    info: dict = field(default_factory=dict)


def threads_info(kind: str, log: Path | None = None) -> dict:
    """The thread settings a server ran with: the environment, plus vLLM's own report."""
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND",
                                      "VLLM_CPU_NUM_OF_RESERVED_CPU") if k in os.environ}
    info = {"cpus": os.cpu_count(), "env": env}
    if kind == "streamgate":
        info["torch_threads"] = int(env.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    if kind == "vllm" and log is not None and log.exists():
        lines = [ln.strip()[-200:] for ln in log.read_text(errors="replace").splitlines()
                 if re.search(r"ompmultiprocessing|Torch threads", ln)]
        info["vllm_log"] = lines[:12]
    return info


def start(spec: ServerSpec, model_dir: str, workdir: Path, *, peer_python: dict[str, str], timeout_s: float) -> Running:
    """Start one server on a free loopback port and wait (bounded) until it answers."""
    log = workdir / f"{spec.name}.log"
    if spec.kind == "streamgate":
        from tenants import hash_key, new_key

        key = new_key()
        (workdir / "tenants.toml").write_text(f'[tenants.bench]\napi_key_sha256 = ["{hash_key(key)}"]\n')
        proc, url = server.launch(["--model", model_dir, "--tenants", str(workdir / "tenants.toml"),
                                   "--ledger", str(workdir / f"{spec.name}.sqlite3"), *STREAMGATE_FLAGS,
                                   *spec.flags], log, timeout_s=timeout_s)
        run = Running(proc, url, "", key, log, own_group=False)
    else:
        port = server.free_port()
        if spec.kind == "vllm":
            cmd = [peer_python["vllm"], "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--host", "127.0.0.1", "--port", str(port), *spec.flags]
            env = {**VLLM_ENV, **os.environ}
        elif spec.kind == "llamacpp":
            cmd = llamacpp.command(peer_python["llamacpp"], model_dir, port, spec.flags)
            env = dict(os.environ)
        else:
            cmd = [str(Path(peer_python["hf"]).parent / "transformers"), "serve", "--host", "127.0.0.1",
                   "--port", str(port), *spec.flags, model_dir]
            env = dict(os.environ)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        run = Running(launch(cmd, env, log, f"http://127.0.0.1:{port}", timeout_s), f"http://127.0.0.1:{port}",
                      "", "none", log, own_group=True)
    try:
        run.model = served_model(run.url, run.api_key)
    except Exception:
        stop(run)
        raise
    run.info = {"kind": spec.kind, "flags": list(spec.flags), **threads_info(spec.kind, log)}
    return run


def launch(cmd: list[str], env: dict, log: Path, url: str, timeout_s: float) -> subprocess.Popen:
    """Start `cmd` in its own process group (vLLM forks workers) and wait until GET /health
    answers 200; on failure stop it and raise with the log's tail."""
    print(f"starting: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return proc
            time.sleep(0.5)
    except BaseException:                   # interrupted while waiting: leave nothing running
        stop_group(proc)
        raise
    why = f"exited with {proc.returncode}" if proc.poll() is not None else f"did not answer in {timeout_s:.0f} s"
    stop_group(proc)
    raise RuntimeError(f"{cmd[0]} {why}; its log:\n"
                       + log.read_text(errors="replace")[-3000:])


def served_model(url: str, key: str) -> str:
    """The first model id the server lists (what GuideLLM and the loadgen client send)."""
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def stop(run: Running, timeout_s: float = 60.0) -> None:
    """Stop a server: streamgate drains on SIGTERM (`bench.server.stop`); a peer gets
    SIGTERM to its whole process group, then SIGKILL to whatever of the group is left."""
    if not run.own_group:
        return server.stop(run.proc, timeout_s)
    stop_group(run.proc, timeout_s)


def stop_group(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM the process group led by `proc`, wait, then SIGKILL the group (vLLM's
    engine and worker processes must not outlive it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
