"""A throwaway `redis-server` (Debian's package; scripts/ensure_redis.sh installs it) on a
free loopback port in a given directory, with AOF on. The Redis quota tests and
bench/serving/quota_backends.py start, stop, kill and restart it; nothing runs as a service."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, appendfsync: str = "always"):
        self.dir = Path(workdir)
        self.port = free_port()
        self.appendfsync = appendfsync
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again) on the same port and directory, so its AOF is reloaded."""
        if not Path(REDIS_SERVER).exists():
            raise RuntimeError("redis-server is missing: run `bash scripts/ensure_redis.sh` "
                               "(`make test` does) or `apt-get install -y redis-server`")
        log = self.dir / "redis.log"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", self.appendfsync, "--save", "",
             "--daemonize", "no", "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        tail = log.read_text()[-2000:] if log.exists() else ""
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{tail}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop it (SIGKILL: as a crash would, keeping only what the AOF already holds)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)
        self.proc = None
