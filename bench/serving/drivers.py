"""Transports for the serving benchmark: WebSocket, SSE (OpenAI-compatible HTTP), the
engine in-process, and Hugging Face's continuous batching offline (a baseline).

A driver has `open(reqs)`, `send(req, record, t0)`, `sample_stats(samples, t0)` and
`close()`. `send` fills the record (see `replay.new_record`) and never raises for what
the server answers: a 429/503/504 or a failure mid-stream is recorded as `error` (the
error code) and `status`. Every delta is timestamped when its frame or line arrives.
A delta counts `num_tokens` tokens if the server says so (a streamgate extension, see
bench/serving/serve.py), else one: a client that lags gets merged deltas, one gap each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time

STAT_FIELDS = ("waiting", "running", "swapped", "kv_cache_usage", "num_preemptions", "num_prefill_tokens",
               "num_decode_tokens")
PER_SOCKET = 24          # below the gateway's 32 requests per WebSocket, with room for races
OK_FINISH = ("length", "stop")


def chat_body(req) -> dict:
    body = {"messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True,
            "priority": req.priority}
    if req.deadline_ms:
        body["deadline_ms"] = req.deadline_ms
    return {**body, **(getattr(req, "extra", None) or {})}


def _finish(rec: dict, t: float, finish: str | None, usage: dict | None, timings: dict | None) -> None:
    rec["end"], rec["finish"] = t, finish
    if usage:
        rec["output_tokens"], rec["prompt_tokens"] = usage.get("completion_tokens"), usage.get("prompt_tokens")
    if timings and timings.get("queue_ms") is not None:
        rec["queue_s"] = timings["queue_ms"] / 1000
    if finish not in OK_FINISH:
        rec["error"] = finish or "no_finish_reason"


def _fail(rec: dict, t: float, code: str, status: int | None = None) -> None:
    rec["end"], rec["error"], rec["status"] = t, code, status


def _sample(t: float, engine: dict) -> dict:
    return {"t": round(t, 3), **{k: engine.get(k) for k in STAT_FIELDS}}


class _HttpStats:
    """Samples the server's `GET /v1/stats` SSE stream until cancelled."""

    url: str
    keys: dict[str, str]

    async def sample_stats(self, samples: list[dict], t0: float, interval_ms: int = 250) -> None:
        import httpx

        key = next(iter(self.keys.values()))
        try:
            async with httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=10)) as client:
                async with client.stream("GET", f"/v1/stats?interval_ms={interval_ms}",
                                         headers={"Authorization": f"Bearer {key}"}) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            samples.append(_sample(time.perf_counter() - t0, json.loads(line[6:]).get("engine", {})))
        except (httpx.HTTPError, ValueError) as exc:
            print(f"warning: /v1/stats sampling stopped: {exc!r}", file=sys.stderr)


class _Socket:
    """One WebSocket: a reader task routes timestamped frames to per-request queues."""

    def __init__(self, ws):
        self.ws = ws
        self.waiters: dict[str, asyncio.Queue] = {}
        self.alive = True
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                t = time.perf_counter()
                msg = json.loads(frame)
                queue = self.waiters.get(str(msg.get("id")))
                if queue is not None:
                    queue.put_nowait((t, msg))
        except Exception:                   # closed or broken: every waiter hears about it below
            pass
        finally:
            self.alive = False
            for queue in self.waiters.values():
                queue.put_nowait((time.perf_counter(), {"type": "error", "error": {"code": "connection_closed"}}))


class WsDriver(_HttpStats):
    """`/v1/chat/ws`: sockets per tenant, at most PER_SOCKET requests in flight on each."""

    def __init__(self, url: str, keys: dict[str, str]):
        self.url, self.keys = url, keys
        self.pools: dict[str, list[_Socket]] = {t: [] for t in keys}
        self.lock = asyncio.Lock()

    async def open(self, reqs) -> None:
        for tenant in self.keys:
            await self._socket(tenant, None, None)

    async def _socket(self, tenant: str, rid: str | None, queue) -> _Socket:
        import websockets

        async with self.lock:
            sock = next((s for s in self.pools[tenant] if s.alive and len(s.waiters) < PER_SOCKET), None)
            if sock is None:
                ws = await websockets.connect(self.url.replace("http", "ws", 1) + "/v1/chat/ws", max_size=None,
                                              additional_headers={"Authorization": f"Bearer {self.keys[tenant]}"})
                hello = json.loads(await ws.recv())
                if hello.get("type") != "auth.ok":
                    raise RuntimeError(f"WebSocket auth failed for tenant {tenant!r}: {hello}")
                sock = _Socket(ws)
                self.pools[tenant].append(sock)
            if rid is not None:
                sock.waiters[rid] = queue
            return sock

    async def send(self, req, rec: dict, t0: float) -> None:
        queue: asyncio.Queue = asyncio.Queue()
        sock = await self._socket(req.tenant, req.id, queue)
        rec["send"] = time.perf_counter() - t0
        done = False
        try:
            await sock.ws.send(json.dumps({"type": "chat.request", "id": req.id, **chat_body(req)}))
            while not done:
                t, msg = await queue.get()
                kind, done = msg.get("type"), True
                if kind == "chat.delta":
                    rec["deltas"].append([round(t - t0, 6), msg.get("num_tokens", 1)])
                    done = False
                elif kind == "chat.done":
                    _finish(rec, t - t0, msg.get("finish_reason"), msg.get("usage"), msg.get("timings"))
                else:
                    _fail(rec, t - t0, (msg.get("error") or {}).get("code") or "error")
        except Exception as exc:            # the socket broke while sending
            if not done:
                _fail(rec, time.perf_counter() - t0, f"transport_error: {type(exc).__name__}")
                done = True
        finally:
            sock.waiters.pop(req.id, None)
            if not done and sock.alive:     # cancelled (time limit): stop it on the server
                with contextlib.suppress(Exception):
                    await sock.ws.send(json.dumps({"type": "chat.cancel", "id": req.id}))

    async def close(self) -> None:
        for sock in [s for pool in self.pools.values() for s in pool]:
            with contextlib.suppress(Exception):
                await sock.ws.close()
            sock.reader.cancel()


class SseDriver(_HttpStats):
    """`POST /v1/chat/completions` with `stream: true` and `stream_options.include_usage`."""

    def __init__(self, url: str, keys: dict[str, str]):
        self.url, self.keys = url, keys

    async def open(self, reqs) -> None:
        import httpx

        self.client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(None, connect=30),
                                        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))

    async def send(self, req, rec: dict, t0: float) -> None:
        import httpx

        body = {**chat_body(req), "stream": True, "stream_options": {"include_usage": True}}
        headers = {"Authorization": f"Bearer {self.keys[req.tenant]}"}
        for attempt in (1, 2):
            rec["send"] = time.perf_counter() - t0
            answered = []
            try:
                return await self._stream(body, headers, rec, t0, answered)
            except httpx.RemoteProtocolError as exc:
                # A keep-alive connection the server had already closed (llama.cpp's server
                # closes them): nothing was answered, so the request goes once more on a fresh
                # connection, its clock restarted.
                if attempt == 1 and not answered:
                    continue
                return _fail(rec, time.perf_counter() - t0, f"transport_error: {type(exc).__name__}")
            except httpx.HTTPError as exc:
                return _fail(rec, time.perf_counter() - t0, f"transport_error: {type(exc).__name__}")

    async def _stream(self, body: dict, headers: dict, rec: dict, t0: float, answered: list) -> None:
        finish = usage = timings = None
        async with self.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            answered.append(r.status_code)
            if r.status_code != 200:
                raw, code = await r.aread(), None
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = json.loads(raw)["error"]["code"]
                return _fail(rec, time.perf_counter() - t0, code or f"http_{r.status_code}", r.status_code)
            async for line in r.aiter_lines():
                t = time.perf_counter() - t0
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _fail(rec, t, chunk["error"].get("code") or "error")
                for choice in chunk.get("choices") or ():
                    if choice["delta"].get("content"):
                        rec["deltas"].append([round(t, 6), chunk.get("num_tokens", 1)])
                    finish = choice.get("finish_reason") or finish
                usage, timings = chunk.get("usage") or usage, chunk.get("timings") or timings
            _finish(rec, time.perf_counter() - t0, finish, usage, timings)

    async def close(self) -> None:
        await self.client.aclose()


class InprocDriver:
    """`engine.AsyncEngine` in this process; prompts are tokenized before the clock starts."""

    def __init__(self, config):
        self.config = config
        self.prompts: dict[str, list[int]] = {}

    def _ids(self, messages) -> list[int]:
        ids = self.eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    async def open(self, reqs) -> None:
        from engine import AsyncEngine

        self.eng = AsyncEngine(self.config)
        await self.eng.start()
        self.prompts = {r.id: self._ids(r.messages) for r in reqs}

    async def send(self, req, rec: dict, t0: float) -> None:
        from engine import EngineOverloaded, SamplingParams

        prompt = self.prompts.get(req.id) or self._ids(req.messages)
        params = SamplingParams(max_tokens=req.max_tokens, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + req.deadline_ms / 1000 if req.deadline_ms else None
        rec["send"], rec["prompt_tokens"], n = time.perf_counter() - t0, len(prompt), 0
        try:
            async for out in self.eng.generate(req.id, prompt, params, priority=req.priority, tenant=req.tenant,
                                               deadline=deadline, weight=req.weight):
                t = time.perf_counter() - t0
                if out.new_token_ids:
                    rec["deltas"].append([round(t, 6), len(out.new_token_ids)])
                    n += len(out.new_token_ids)
                if out.queue_time_s is not None:
                    rec["queue_s"] = out.queue_time_s
                if out.finished:
                    reason = "deadline_exceeded" if out.finish_reason == "deadline" else out.finish_reason
                    _finish(rec, t, reason, {"completion_tokens": n, "prompt_tokens": len(prompt)}, None)
        except EngineOverloaded:
            _fail(rec, time.perf_counter() - t0, "engine_overloaded", 503)
        except ValueError:
            _fail(rec, time.perf_counter() - t0, "invalid_request_error", 400)

    async def sample_stats(self, samples: list[dict], t0: float, interval_ms: int = 250) -> None:
        while True:
            samples.append(_sample(time.perf_counter() - t0, (await self.eng.stats()).as_dict()))
            await asyncio.sleep(interval_ms / 1000)

    async def close(self) -> None:
        await self.eng.stop()


def run_hf_offline(model_dir: str, reqs, kv_tokens: int, max_batch_tokens: int, max_seqs: int) -> dict:
    """All requests at once through HF's continuous batching (`bench.baselines.run_hf_cb`):
    the offline baseline. Returns wall time and output tokens (no per-token timings)."""
    from transformers import AutoTokenizer

    from bench.engine.baselines import load_hf_model, run_hf_cb
    from bench.workload import Request

    tok = AutoTokenizer.from_pretrained(model_dir)

    def ids(messages) -> tuple[int, ...]:
        out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return tuple(out["input_ids"] if hasattr(out, "keys") else out)

    requests = [Request(r.id, ids(r.messages), r.max_tokens) for r in reqs]
    result = run_hf_cb(load_hf_model(model_dir), requests, kv_tokens, max_batch_tokens=max_batch_tokens,
                       max_seqs=max_seqs)
    result.pop("outputs", None)
    result["prompt_tokens"] = sum(len(r.prompt_ids) for r in requests)
    return result
