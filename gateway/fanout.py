"""A request's `n` choices as one stream: `choices(engine, adm, settle)` yields
`(index, RequestOutput)` from n engine requests on the same prompt (the engine's prefix
cache computes the shared prompt once), interleaved as they arrive.

Billing: the request pays for its prompt once and for every choice's tokens (OpenAI's
usage for `n`): `settle(tokens)` is called once, when the final output of every choice
that reached the engine has arrived, even if the consumer left before. A choice the engine
refused (overloaded, invalid) raises here before anything is yielded; the choices already
queued are then aborted and still billed for what they computed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

from engine import EngineClient


def billed_tokens(out) -> int:
    """What one engine request pays: prompt + completion once it produced a token, else the
    prompt tokens the engine computed for it (0 if it never started)."""
    if out.num_output_tokens:
        return out.num_prompt_tokens + out.num_output_tokens
    return out.num_computed_prompt_tokens


class _Bill:
    """Collects the final outputs of the choices that reached the engine; settles once."""

    def __init__(self, n: int, settle: Callable[[int], None]):
        self.pending, self.settle = n, settle
        self.prompt = self.completion = 0

    def final(self, out) -> None:
        self.prompt = max(self.prompt, out.num_prompt_tokens if out.num_output_tokens
                          else out.num_computed_prompt_tokens)
        self.completion += out.num_output_tokens
        self.dropped()

    def dropped(self) -> None:
        self.pending -= 1
        if self.pending == 0:
            self.settle(self.prompt + self.completion)


def engine_ids(adm) -> list[str]:
    """The engine's ids for a request's choices (what to abort)."""
    n = adm.request.n
    return [adm.request_id] if n == 1 else [f"{adm.request_id}-{i}" for i in range(n)]


def choice_params(params, i: int):
    """Choice i's params: with a seed, seed + i (wrapped to 64 bits), so that the choices
    differ and a request with the same seed reproduces every one of them."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + i + 2**63) % 2**64 - 2**63)


async def choices(engine: EngineClient, adm, settle: Callable[[int], None]) -> AsyncIterator[tuple[int, object]]:
    n = adm.request.n
    if n == 1:          # the common case, without a task per choice
        stream = engine.generate(adm.request_id, adm.prompt_ids, adm.params, priority=adm.priority,
                                 tenant=adm.tenant.name, deadline=adm.deadline, weight=adm.tenant.weight,
                                 validated=True, on_final=lambda out: settle(billed_tokens(out)))
        async with contextlib.aclosing(stream):
            async for out in stream:
                yield 0, out
        return
    bill = _Bill(n, settle)
    queue: asyncio.Queue = asyncio.Queue()
    started = [False] * n

    async def pump(i: int) -> None:
        started[i] = True
        stream = engine.generate(engine_ids(adm)[i], adm.prompt_ids, choice_params(adm.params, i),
                                 priority=adm.priority,
                                 tenant=adm.tenant.name, deadline=adm.deadline, weight=adm.tenant.weight,
                                 validated=i == 0, on_final=bill.final)
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:        # refused before it was queued: no final output will come
            bill.dropped()
            queue.put_nowait((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i)) for i in range(n)]
    try:
        running = n
        while running:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out.finished:
                running -= 1
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, was in enumerate(started):
            if not was:         # cancelled before its first step: never reached the engine
                bill.dropped()
