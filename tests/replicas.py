"""Two `streamgate serve --redis` replicas (tiny model, tenants with one limit each) on
one real redis-server, for tests/test_scale_replicas.py (module-scoped fixtures: the
replicas start once per module)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.redis_server import free_port
from tenants import hash_key

from .redis_server import started, wait_healthy

# `streamgate` with its real engine holding a long stream after 16 tokens until it is
# aborted (tests/held_serve.py): the tests' long streams outlast their waits by that hold.
STREAMGATE = [sys.executable, "-m", "tests.held_serve"]
LIMITS = {  # tenant -> limits; each test uses its own tenant, so they share two replicas
    "rpm": {"requests_per_minute": 6},
    "conc": {"max_concurrent": 3},
    "daily": {"daily_tokens": 300},
    "free": {},
}
TTL = 4.0  # lease TTL: a killed replica's slots are free again within it
LONG = {"max_tokens": 1500, "ignore_eos": True, "stream": True}  # held after 16 tokens until aborted


def key(tenant: str) -> str:
    return f"sk-{tenant}-scale-test"


class Replicas:
    """Two `streamgate serve` processes sharing one Redis, each with its own outbox."""

    def __init__(self, model: str, redis_url: str, workdir):
        tenants = workdir / "tenants.toml"
        tenants.write_text("".join(
            f'[tenants.{name}]\napi_key_sha256 = ["{hash_key(key(name))}"]\n'
            + "".join(f"{k} = {v}\n" for k, v in limits.items()) + "\n"
            for name, limits in LIMITS.items()))
        self.urls, self.procs = [], []
        # Each replica its own outbox file. The torch attention path: these tests are about
        # quotas, and loading the C++ kernel can mean waiting on a (re)build in the cache.
        env = {**os.environ, "STREAMGATE_REDIS_URL": redis_url}
        for i in range(2):
            port = free_port()
            self.procs.append(subprocess.Popen(
                [*STREAMGATE, "serve", "--model", model, "--tenants", str(tenants), "--port", str(port),
                 "--ledger", str(workdir / f"outbox{i}.sqlite3"), "--max-model-len", "2048",
                 "--attention-backend", "torch", "--drain-grace", "1", "--redis-lease-ttl", str(TTL)],
                stdout=subprocess.DEVNULL, stderr=open(workdir / f"replica{i}.log", "w"), env=env))
            self.urls.append(f"http://127.0.0.1:{port}")
        try:
            for url, proc in zip(self.urls, self.procs):
                wait_healthy(url, proc, 120)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    yield from started(tmp_path_factory.mktemp("redis"))


@pytest.fixture(scope="module")
def replicas(tiny_model, redis_server, tmp_path_factory):
    pair = Replicas(tiny_model("llama"), redis_server.url, tmp_path_factory.mktemp("replicas"))
    yield pair
    pair.stop()
