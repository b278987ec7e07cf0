"""`streamgate serve` and `streamgate keys new` as a user runs them: a real process, a real
SIGTERM, JSON logs that never contain prompts or keys, tenant-file errors at start."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from tenants import Registry

from .redis_server import wait_healthy

STREAMGATE = [sys.executable, "-m", "gateway.cli"]
SECRET_PROMPT = "my-secret-prompt-do-not-log"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keys_new(tenant: str, tmp_path) -> tuple[str, str]:
    """Run `streamgate keys new` and write its pasted lines into a tenants file."""
    out = subprocess.run([*STREAMGATE, "keys", "new", tenant], capture_output=True, text=True, check=True).stdout
    key = next(line.strip() for line in out.splitlines() if line.strip().startswith("sg-"))
    paste = out[out.index(f"[tenants.{tenant}]"):]
    path = tmp_path / "tenants.toml"
    path.write_text(paste)
    return key, str(path)


def test_keys_new_prints_a_key_whose_pasted_hash_authenticates(tmp_path):
    """The printed lines, pasted into a file, make a registry that accepts the printed key."""
    key, path = keys_new("acme", tmp_path)
    reg = Registry.from_file(path)
    assert reg.authenticate(key).name == "acme"
    assert reg.authenticate(key + "x") is None


def test_invalid_tenants_file_fails_at_start_naming_tenant_and_field(tmp_path):
    """A bad field stops `serve` before it loads anything, with the tenant and field in the message."""
    path = tmp_path / "bad.toml"
    path.write_text('[tenants.acme]\napi_key_sha256 = ["' + "a" * 64 + '"]\nweight = -1\n')
    r = subprocess.run([*STREAMGATE, "serve", "--tenants", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "tenants.acme.weight" in r.stderr


def test_serve_streams_logs_json_and_drains_on_a_real_sigterm(tiny_model, tmp_path):
    """A served request is logged as JSON with ids and token counts, never its prompt or key;
    SIGTERM exits cleanly with code 0."""
    key, path = keys_new("acme", tmp_path)
    port = free_port()
    env = {**os.environ, "STREAMGATE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([*STREAMGATE, "serve", "--model", tiny_model("llama"), "--tenants", path,
                             "--port", str(port), "--drain-grace", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 90)
        r = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                       json={"messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 3})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-2000:]
    assert SECRET_PROMPT not in stderr and key not in stderr
    records = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    done = [rec for rec in records if rec.get("event") == "chat.finished"]
    assert len(done) == 1
    rec = done[0]
    assert rec["tenant"] == "acme" and rec["status"] == 200 and rec["completion_tokens"] == 3
    assert rec["completion_id"] == r.json()["id"] and rec["ttft_ms"] is not None
    http = [h for h in records if h.get("event") == "http.request" and h.get("path") == "/v1/chat/completions"]
    assert len(http) == 1 and http[0]["request_id"] == rec["request_id"] == r.headers["x-request-id"]
    assert any(rec.get("event") == "drain.done" for rec in records)
    # once loaded, start-up's objects were frozen out of the GC's scans (gateway/server.freeze_heap)
    ready = [rec for rec in records if rec.get("event") == "engine.ready"]
    assert len(ready) == 1 and ready[0]["gc_frozen"] > 50_000, ready


@pytest.mark.skipif(getattr(ctypes.CDLL(None), "malloc_trim", None) is None,
                    reason="not glibc: this C library has no malloc_trim, so freeze_heap only freezes")
def test_freeze_heap_freezes_and_hands_freed_memory_back():
    """gateway.server.freeze_heap, in a fresh process: start-up's objects leave the GC's scans,
    and memory that loading freed but glibc kept (mid-size tensors copied, the first copies
    dropped, as packing weights does) goes back to the OS."""
    code = (
        "import gc, torch\n"
        "from gateway.server import freeze_heap\n"
        "rss = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0].split()[1]) << 10\n"
        "first = [torch.randn(96, 1024) for _ in range(400)]\n"          # 384 KB each, 150 MiB
        "second = [t.clone() for t in first]\n"
        "del first\n"
        "before = rss(); frozen = freeze_heap(); after = rss()\n"
        "print(before - after, frozen, gc.get_freeze_count(), sum(len(g) for g in [gc.get_objects(i) for i in range(3)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    returned, frozen, count, tracked = (int(x) for x in out.split())
    assert returned > 100 << 20, returned
    assert frozen == count > 10_000 and tracked < frozen // 10
