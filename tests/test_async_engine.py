"""AsyncEngine: concurrent streams, slow consumers, aborts, and a responsive event loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from prometheus_client import generate_latest

from engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture
async def aeng(tiny_model):
    eng = AsyncEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=16,
                                   num_kv_blocks=256))
    await eng.start()
    yield eng
    await eng.stop()


async def collect(aeng, rid, prompt, params, delay: float = 0.0):
    toks, text, finals = [], "", []
    async for out in aeng.generate(rid, prompt, params):
        toks += out.new_token_ids
        text += out.new_text
        if out.finished:
            finals.append(out.finish_reason)
        if delay:
            await asyncio.sleep(delay)
    return toks, text, finals


def reference(tiny_model, prompts, params):
    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, num_kv_blocks=256))
    res = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    while eng.has_unfinished():
        for o in eng.step():
            res.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [res[str(i)] for i in range(len(prompts))]


async def test_many_concurrent_streams_match_the_sync_engine(aeng, tiny_model):
    """12 concurrent generators each get exactly their greedy tokens and one final event."""
    prompts = [[10 + i, 20 + i, 30 + i] * (1 + i % 4) for i in range(12)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = await asyncio.gather(*(collect(aeng, f"c{i}", p, params) for i, p in enumerate(prompts)))
    want = reference(tiny_model, prompts, params)
    for (toks, _, finals), w in zip(results, want):
        assert toks == w and finals == ["length"]


async def test_slow_consumer_gets_merged_deltas_and_does_not_slow_others(aeng):
    """A consumer sleeping between reads receives fewer, merged outputs with every token;
    a fast stream beside it finishes first."""
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    outs = []

    async def slow():
        async for out in aeng.generate("slow", [5, 6, 7], params):
            outs.append(out)
            await asyncio.sleep(0.05)
        return time.monotonic()

    async def fast():
        toks, _, _ = await collect(aeng, "fast", [5, 6, 8], params)
        return time.monotonic(), toks

    t_slow, (t_fast, fast_toks) = await asyncio.gather(slow(), fast())
    assert sum(len(o.new_token_ids) for o in outs) == 30 and len(fast_toks) == 30
    assert len(outs) < 30                     # some outputs were merged
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    assert t_fast < t_slow


async def test_abort_mid_stream_frees_blocks_and_spares_other_streams(tiny_model):
    """Aborting one stream ends it with 'abort', frees its blocks by the next step, and the
    other stream still produces all its tokens."""
    from tests.held_engine import HeldEngine

    # Held after 24 steps (tests/held_engine.py) until the abort is sent: the victim is still
    # running when its abort lands, however fast this host writes its 400 tokens.
    aeng = HeldEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=16,
                                   num_kv_blocks=256), steps=24)
    await aeng.start()
    try:
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        other = asyncio.create_task(collect(aeng, "other", [9, 9, 9],
                                            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))
        got = []
        async for out in aeng.generate("victim", list(range(100, 180)), long):
            got.append(out)
            if sum(len(o.new_token_ids) for o in got) >= 3 and not out.finished:
                await aeng.abort("victim")
                aeng.release()
        assert got[-1].finish_reason == "abort" and sum(o.finished for o in got) == 1
        toks, _, finals = await other
        assert len(toks) == 40 and finals == ["length"]
        stats = await aeng.stats()
        assert stats.kv_blocks_used == 0 and stats.running == 0
    finally:
        await aeng.stop()


async def test_leaving_the_iterator_aborts_the_request(aeng):
    """Breaking out of (or cancelling) a stream aborts it: its blocks are freed."""
    gen = aeng.generate("gone", list(range(100, 160)), SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))
    async for _ in gen:
        break
    await gen.aclose()
    for _ in range(100):
        if (await aeng.stats()).running == 0:
            break
        await asyncio.sleep(0.02)
    stats = await aeng.stats()
    assert stats.running == 0 and stats.kv_blocks_used == 0


async def test_bad_input_raises_before_queueing(aeng):
    """Bad input raises ValueError to the caller; the engine keeps serving."""
    with pytest.raises(ValueError, match="max_tokens"):
        async for _ in aeng.generate("bad", [1, 2], SamplingParams(max_tokens=0)):
            pass
    toks, _, finals = await collect(aeng, "good", [1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(toks) == 3 and finals == ["length"]


async def test_event_loop_stays_responsive_while_engine_steps(aeng, monkeypatch):
    """Every step's forward waits until the event loop has run a coroutine while the step is in
    progress; the requests still finish: steps run on the engine thread, not on the loop (a
    step on the loop would hold it, the coroutine could never run, and the wait would fail).
    Events, not a ticker's delay: the verdict does not depend on how busy the host is."""
    real = aeng.engine.runner.run
    in_step, loop_ran, steps = threading.Event(), threading.Event(), []

    def gated_run(batch):
        loop_ran.clear()
        in_step.set()
        assert loop_ran.wait(60), "the event loop did not run while a step was in progress"
        in_step.clear()
        steps.append(batch)
        return real(batch)

    monkeypatch.setattr(aeng.engine.runner, "run", gated_run)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    work = asyncio.gather(*(collect(aeng, f"t{i}", [7, i + 1, 9] * 20, params) for i in range(4)))
    while not work.done():
        if in_step.is_set():
            loop_ran.set()                          # this coroutine ran on the loop mid-step
        await asyncio.sleep(0.001)
    outs = await work
    assert len(steps) >= 4                          # each request's 4 tokens took steps, each gated
    assert [(len(toks), finals) for toks, _, finals in outs] == [(4, ["length"])] * 4


async def test_a_request_id_is_reusable_only_after_its_abort_lands(aeng):
    """A stream cancelled before the engine saw it keeps its id until the abort lands; the
    next request with that id then runs normally and ends with its own finish reason."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    task = asyncio.create_task(collect(aeng, "same", [5, 6, 7], SamplingParams(max_tokens=400, **{"temperature": 0.0})))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        try:
            toks, _, finals = await collect(aeng, "same", [5, 6, 7], params)
            break
        except ValueError as exc:
            assert "already in use" in str(exc)
            await asyncio.sleep(0.01)
    assert finals == ["length"] and len(toks) == 5


async def test_burst_past_the_queue_limit_is_refused_up_front_never_mid_stream(tiny_model):
    """Adds still on their way to the engine thread count against the queue limit, so a
    burst is refused by generate() with EngineOverloaded and no accepted request errors."""
    from engine import EngineOverloaded

    eng = AsyncEngine(EngineConfig(model=tiny_model("llama"), max_num_seqs=1, max_queued_requests=2,
                                   num_kv_blocks=256))
    await eng.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)

        async def one(i):
            try:
                return await collect(eng, f"b{i}", [5, 6, 7, 8], params)
            except EngineOverloaded:
                return "refused"
        results = await asyncio.gather(*(one(i) for i in range(8)))
    finally:
        await eng.stop()
    served = [r for r in results if r != "refused"]
    assert 2 <= len(served) < 8
    assert all(finals == ["length"] for _, _, finals in served)


async def test_a_request_left_during_prefill_reports_its_computed_prompt_once(aeng, monkeypatch):
    """A consumer that leaves while a long prompt is still being prefilled (no token yet)
    gets on_final exactly once, with the prompt tokens the engine had computed."""
    real = aeng.engine.runner.run

    def slow_run(batch):
        time.sleep(0.02)
        return real(batch)

    monkeypatch.setattr(aeng.engine.runner, "run", slow_run)
    finals = []
    prompt = [7, 8, 9, 10] * 100                    # 400 tokens: 7 chunks of 64
    gen = aeng.generate("long", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                        on_final=finals.append)
    step = asyncio.ensure_future(anext(gen))
    while (await aeng.stats()).prompt_tokens < 128:
        await asyncio.sleep(0.005)
    assert not step.done()
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    await gen.aclose()
    for _ in range(200):
        if finals:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert len(finals) == 1 and finals[0].finish_reason == "abort" and finals[0].num_output_tokens == 0
    assert 128 <= finals[0].num_computed_prompt_tokens < 400


async def test_stats_are_built_on_the_engine_thread_only_when_asked(aeng, monkeypatch):
    """stats() is answered with a snapshot the engine thread builds for it (never on the
    event loop), and steps nobody asked a snapshot of build none."""
    built = []
    real = aeng.engine.snapshot

    def snapshot():
        built.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(aeng.engine, "snapshot", snapshot)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    toks, _, _ = await collect(aeng, "s", [1, 2, 3], params)
    assert len(toks) == 6 and built == []               # 6 steps, no snapshot
    stats = await aeng.stats()
    assert built == ["streamgate-engine"]
    assert stats.generation_tokens >= 6 and stats.running == 0 and stats.waiting == 0
    assert aeng.limits.max_model_len == aeng.max_model_len > 0 and aeng.ready
    assert b"streamgate_num_requests_running" in generate_latest(aeng.metrics_registry)


async def test_a_request_the_engine_thread_refuses_raises_from_generate(tiny_model):
    """validate() passes both requests of a one-request queue (neither is sent yet); the
    engine thread, the check that decides, refuses the second, which generate() raises as
    EngineOverloaded before yielding anything, with no on_final; the first is served."""
    from engine import EngineOverloaded

    eng = AsyncEngine(EngineConfig(model=tiny_model("llama"), max_num_seqs=1, max_queued_requests=1,
                                   num_kv_blocks=256))
    await eng.start()
    gate = threading.Event()            # holds the engine thread before its next drain
    eng.engine.check_health = lambda: gate.wait(30)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        eng.validate("a", [5, 6, 7], params)
        eng.validate("b", [5, 6, 8], params)
        finals = []
        first = eng.generate("a", [5, 6, 7], params, validated=True, on_final=finals.append)
        second = eng.generate("b", [5, 6, 8], params, validated=True, on_final=finals.append)
        got_a = asyncio.ensure_future(anext(first))
        await asyncio.sleep(0)                          # "a" is sent
        got_b = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0)                          # then "b"
        gate.set()
        with pytest.raises(EngineOverloaded):
            await got_b
        outs = [await got_a] + [out async for out in first]
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 3
        assert [f.request_id for f in finals] == ["a"]
        assert (await eng.stats()).rejections == 1
    finally:
        gate.set()
        await eng.stop()
