"""A fake engine for transport tests against a real uvicorn: it has AsyncEngine's public
surface and streams `chunk`-character deltas as fast as the loop lets it, until
`max_tokens` or an abort. Used where a test needs the socket's buffers full (a client
that stops reading) without depending on how fast a model runs here; no torch."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from engine import RequestOutput


class FakeTokenizer:
    """One token per character; the template joins the contents with newlines."""

    backend_tokenizer = type("Backend", (), {"normalizer": None})()

    def __deepcopy__(self, memo):
        return self

    def get_vocab(self) -> dict:
        return {chr(i): i for i in range(32, 127)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "\n".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 128 for c in text]}


class FloodEngine:
    def __init__(self, chunk: int = 16384):
        self.chunk = chunk
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 1 << 20
        self.error = None
        self.ready = True
        self.metrics_registry = CollectorRegistry()
        self.running: set[str] = set()
        self._aborted: set[str] = set()

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def stats(self) -> dict:
        return {"waiting": 0, "running": len(self.running), "kv_cache_usage": 0.0, "block_size": 16,
                "kv_blocks_total": 0}

    def validate(self, rid, prompt, params, *, priority=0, deadline=None, weight=1.0) -> None:
        pass

    async def abort(self, rid) -> None:
        self._aborted.add(rid)

    async def generate(self, rid, prompt, params, *, priority, tenant, deadline, weight, validated, on_final):
        n_prompt, produced, done = len(prompt), 0, False
        self.running.add(rid)

        def final(reason):
            self.running.discard(rid)
            self._aborted.discard(rid)
            out = RequestOutput(rid, [], "", True, reason, n_prompt, produced, num_computed_prompt_tokens=n_prompt)
            on_final(out)
            return out

        try:
            while produced < params.max_tokens and rid not in self._aborted:
                produced += 1
                await asyncio.sleep(0)
                yield RequestOutput(rid, [7], "x" * self.chunk, False, None, n_prompt, produced)
            done = True
            yield final("length" if rid not in self._aborted else "abort")
        finally:
            if not done:                # the consumer left: ended at the engine's next step
                asyncio.get_running_loop().call_soon(final, "abort")
