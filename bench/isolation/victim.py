"""Tenant B's view of the server during the isolation benchmark: one SSE stream after
another, /health polled on fresh connections, the server's RSS sampled from /proc, and a
WebSocket probe on demand. Everything is timestamped with `time.monotonic()` so a window
[t0, t1] (the baseline, or one attack) can be summarised afterwards."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import httpx

from bench.isolation.client import connect

POLL_S = 0.1                 # /health and RSS sampling period
HEALTH_TIMEOUT_S = 30.0


def main_thread_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) of process `pid`'s main thread, which runs the server's
    event loop: unlike latencies, this hardly moves with the load of a shared host."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int | None:
    """VmRSS of process `pid` less its RssShmem and the Rss of its mappings advised for huge
    pages (VmFlags `hg` in /proc/<pid>/smaps): engine/huge_pages.py's packed weights and CPU KV
    pool, whose pages become resident as blocks are first used, which is the pool filling up
    to its configured size, not growth an attack causes."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        rss = int(fields["VmRSS"].split()[0]) - int(fields.get("RssShmem", "0 kB").split()[0])
        advised = mapping_rss = 0
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == "Rss":
                mapping_rss = int(rest.split()[0])
            elif key == "VmFlags" and "hg" in rest.split():
                advised += mapping_rss
        return (rss - advised) * 1024
    except (OSError, KeyError, ValueError):
        return None


class Victim:
    """Records B's content chunks, /health latencies, RSS samples and B's errors."""

    def __init__(self, url: str, key: str, pid: int | None, max_tokens: int):
        self.url, self.key, self.pid, self.max_tokens = url, key, pid, max_tokens
        self.chunks: list[float] = []                 # arrival time of each content chunk
        self.polls: list[tuple[float, float, bool]] = []    # (sent at, latency s, timed out)
        self.rss: list[tuple[float, int]] = []        # (t, bytes)
        self.loop_cpu: list[tuple[float, float]] = []  # (t, CPU seconds of the server's event-loop thread)
        self.errors: list[tuple[float, str]] = []     # (t, what B got instead of a stream)
        self.streams = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(f()) for f in (self._stream_loop, self._health_loop, self._rss_loop)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _stream_loop(self) -> None:
        body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
                "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(60.0),
                                     headers={"Authorization": f"Bearer {self.key}"}) as client:
            while True:
                try:
                    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            self.errors.append((time.monotonic(), f"HTTP {r.status_code}"))
                            await asyncio.sleep(0.5)
                            continue
                        async for line in r.aiter_lines():
                            if not line.startswith("data: {"):
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                self.errors.append((time.monotonic(), event["error"].get("code") or "error"))
                            elif event["choices"] and event["choices"][0]["delta"].get("content"):
                                self.chunks.append(time.monotonic())
                    self.streams += 1
                except httpx.HTTPError as exc:
                    self.errors.append((time.monotonic(), type(exc).__name__))
                    await asyncio.sleep(0.5)

    async def _health_loop(self) -> None:
        """One poll at a time on a fresh connection (as a load balancer's probe would)."""
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.url, timeout=HEALTH_TIMEOUT_S, limits=limits) as client:
            while True:
                t0, timed_out = time.monotonic(), False
                try:
                    await client.get("/health")
                except httpx.TimeoutException:
                    timed_out = True        # still counts: its latency is the wait, a lower bound
                except httpx.HTTPError:
                    pass
                self.polls.append((t0, time.monotonic() - t0, timed_out))
                await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - t0)))

    async def _rss_loop(self) -> None:
        while self.pid is not None:
            rss, cpu = rss_bytes(self.pid), main_thread_cpu_s(self.pid)
            if rss is not None:
                self.rss.append((time.monotonic(), rss))
            if cpu is not None:
                self.loop_cpu.append((time.monotonic(), cpu))
            await asyncio.sleep(POLL_S)

    async def warm(self, chunks: int = 5, steady_s: float = 2.0, timeout_s: float = 300.0) -> None:
        """Wait until B's stream is flowing, then `steady_s` more: a fresh server's first steps
        are slower than the rest, and would count against whichever phase came first."""
        deadline = time.monotonic() + timeout_s
        while len(self.chunks) < chunks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"B's stream produced no tokens in {timeout_s:g} s; errors: {self.errors[-3:]}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(steady_s)

    def summary(self, t0: float, t1: float, t_end: float) -> dict:
        """B's service in the window [t0, t1]. A gap counts if it overlaps the window; a gap
        still open at the end of the run is measured up to `t_end`."""
        times = self.chunks + [t_end]
        gaps = [(b - a, a) for a, b in zip(times, times[1:]) if a < t1 and b > t0]
        worst = max(gaps, default=None)
        polls = [lat for sent, lat, _ in self.polls if t0 <= sent <= t1]
        before = [r for t, r in self.rss if t <= t0][-1:] or [r for t, r in self.rss[:1]]
        during = [r for t, r in self.rss if t0 <= t <= t1]
        growth = (max(during) - before[0]) / 1e6 if before and during else None
        cpu = [c for t, c in self.loop_cpu if t0 <= t <= t1]
        return {
            "window_s": round(t1 - t0, 2),
            "chunks": sum(t0 <= t <= t1 for t in self.chunks),
            "gap_max_ms": round(worst[0] * 1000, 1) if worst else None,
            "gap_max_from_s": round(worst[1] - t0, 2) if worst else None,      # when it began, from t0
            "gap_p50_ms": round(statistics.median(g for g, _ in gaps) * 1000, 1) if gaps else None,
            "health_max_ms": round(max(polls) * 1000, 1) if polls else None,
            "health_p50_ms": round(statistics.median(polls) * 1000, 1) if polls else None,
            "health_polls": len(polls),
            "health_timeouts": sum(t0 <= sent <= t1 and out for sent, _, out in self.polls),
            "rss_before_mb": round(before[0] / 1e6, 1) if before else None,
            "rss_growth_mb": round(growth, 1) if growth is not None else None,
            "loop_cpu_ms": round((cpu[-1] - cpu[0]) * 1000) if len(cpu) > 1 else None,
            "b_errors": [what for t, what in self.errors if t0 <= t <= t1][:10],
        }


async def probe_ws(url: str, key: str, timeout_s: float = 15.0) -> dict:
    """Can B open a WebSocket now? Connect with B's key, wait for auth.ok, ping, wait for pong."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    t0 = time.monotonic()
    out: dict = {"connected": False}
    try:
        ws = await connect(url, key, timeout_s=timeout_s)
        try:
            await ws.send(json.dumps({"type": "ping"}))
            while json.loads(await asyncio.wait_for(ws.recv(), timeout_s)).get("type") != "pong":
                pass
            out["connected"] = True
        finally:
            await ws.close()
    except ConnectionClosed as exc:
        out["close_code"] = exc.rcvd.code if exc.rcvd else None
    except InvalidStatus as exc:
        out["http_status"] = exc.response.status_code
    except (TimeoutError, asyncio.TimeoutError, OSError) as exc:
        out["error"] = type(exc).__name__
    out["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return out
