"""Fake engines for the gateway's tests, no torch: both declare the engine's port
(`engine.EngineClient`), as AsyncEngine does, and tests/test_engine_port.py checks that
they define it with AsyncEngine's signatures.

- `FakeEngine` plays a script per request (steps of (token count, text), 'stall' until
  aborted, then a final output), to drive the chat pipeline's contract fast.
- `FloodEngine` streams `chunk`-character deltas as fast as the loop lets it, until
  `max_tokens` or an abort: for transport tests that need a socket's buffers full (a
  client that stops reading) without depending on how fast a model runs here.

Like AsyncEngine, a consumer that leaves early aborts the request and `on_final` still
gets the final output, at the engine's "next step" (the loop's next pass).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry

from engine import EngineClient, EngineLimits, EngineStats, RequestOutput


class FakeTokenizer:
    """One token per character; the template joins the contents with newlines."""

    backend_tokenizer = type("Backend", (), {"normalizer": None})()

    def __init__(self):
        self.encoded = 0

    def __deepcopy__(self, memo):
        return self         # one shared instance, so the test sees every encode

    def get_vocab(self) -> dict:
        return {chr(i): i for i in range(32, 127)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return "\n".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        self.encoded += 1
        return {"input_ids": [ord(c) % 128 for c in text]}


class _Fake(EngineClient):
    """What both fakes share: started, never failing, limits from `max_model_len`."""

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self.tokenizer = FakeTokenizer()
        self.error = None
        self.ready = True
        self.metrics_registry = CollectorRegistry()
        self.running: set[str] = set()

    @property
    def limits(self) -> EngineLimits:
        return EngineLimits(max_model_len=self.max_model_len, vocab_size=128, block_size=16,
                            num_kv_blocks=1 << 20, usable_kv_blocks=1 << 20, max_num_seqs=256,
                            max_num_batched_tokens=512, max_queued_requests=4096, max_queued_tokens=1 << 22)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), block_size=16)

    def validate(self, request_id, prompt_token_ids, params, *, priority=0, deadline=None, weight=1.0) -> None:
        pass


class FakeEngine(_Fake):
    def __init__(self, script=(), *, finish="stop", error=None, computed=None, refuse=None):
        super().__init__(max_model_len=64)
        self.script, self.finish, self.error_text = list(script), finish, error
        self.computed, self.refuse = computed, refuse
        self.aborted: list[str] = []
        self.finals: list[RequestOutput] = []
        self.abort_event = asyncio.Event()

    async def abort(self, request_id) -> None:
        self.aborted.append(request_id)
        self.abort_event.set()

    async def generate(self, request_id, prompt_token_ids, params, *, priority=0, tenant=None, deadline=None,
                       weight=1.0, validated=False, on_final=None) -> AsyncIterator[RequestOutput]:
        if self.refuse is not None:
            raise self.refuse
        rid, n_prompt, produced, finished = request_id, len(prompt_token_ids), 0, False
        computed = n_prompt if self.computed is None else self.computed

        def final(reason, error=None):
            out = RequestOutput(rid, [], "", True, reason, n_prompt, produced, error=error,
                                num_computed_prompt_tokens=computed)
            self.finals.append(out)
            on_final(out)
            return out

        try:
            for step in self.script:
                if step == "stall":
                    await self.abort_event.wait()
                    finished = True
                    yield final("abort")
                    return
                n, text = step
                produced += n
                await asyncio.sleep(0)
                yield RequestOutput(rid, [7] * n, text, False, None, n_prompt, produced)
            finished = True
            out = final(self.finish, self.error_text)
            yield out
        finally:
            if not finished:            # the consumer left: the engine ends it at its next step
                asyncio.get_running_loop().call_soon(final, "abort")


class FloodEngine(_Fake):
    def __init__(self, chunk: int = 16384):
        super().__init__(max_model_len=1 << 20)
        self.chunk = chunk
        self._aborted: set[str] = set()

    async def abort(self, request_id) -> None:
        self._aborted.add(request_id)

    async def generate(self, request_id, prompt_token_ids, params, *, priority=0, tenant=None, deadline=None,
                       weight=1.0, validated=False, on_final=None) -> AsyncIterator[RequestOutput]:
        rid, n_prompt, produced, done = request_id, len(prompt_token_ids), 0, False
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
