"""Starting and stopping a `streamgate serve` subprocess on a free loopback port, for the
benchmarks and the screenshot script (one place, so they all start it the same way)."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(flags: list[str], log: Path, *, timeout_s: float = 300.0, cwd: Path | None = None):
    """`python -m gateway.cli serve --host 127.0.0.1 --port <free> *flags`, logging to `log`
    (a file, not a pipe: nobody reads it while the server runs). Returns (process, url) once
    /health answers 200; raises RuntimeError with the log's tail if it never does."""
    port = free_port()
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    print(f"starting: {shlex.join(cmd[1:])}", file=sys.stderr, flush=True)
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=sink)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"the server did not start ({shlex.join(flags)}); its log:\n"
                               + Path(log).read_text()[-3000:])
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)


def stop(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM (the server drains), then kill if it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
