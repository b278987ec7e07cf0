"""Scheduler.update owns every finish decision a step makes (stop tokens, stop strings,
length) and the text of each sampled token; Sequence keeps the most prompt tokens it ever
had computed. Pure Python: the real detokenizer over a one-character-per-id tokenizer."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import EngineConfig, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


class CharTokenizer:
    """Token id i is chr(i)."""

    all_special_ids: list[int] = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) -> str:
        return "".join(map(chr, ids))


def make(num_blocks=64, block_size=4, **cfg) -> Scheduler:
    config = EngineConfig(block_size=block_size, num_kv_blocks=num_blocks, max_num_batched_tokens=64, **cfg)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching), clock=lambda: 0.0)


def seq(sched: Scheduler, rid: str, prompt: str, **params) -> Sequence:
    s = Sequence(rid, [ord(c) for c in prompt], SamplingParams(**{"max_tokens": 50, **params}), arrival_time=0.0,
                 eos_token_ids=frozenset({3}))
    s.detokenizer = IncrementalDetokenizer(CharTokenizer(), s.prompt_token_ids, s.params.stop)
    sched.add(s)
    return s


def run(sched: Scheduler, s: Sequence, text: str) -> list[str]:
    """Step until `s` finishes, sampling the characters of `text` in turn; its deltas."""
    deltas, chars = [], iter(text)
    while not s.status.finished:
        out = sched.schedule()
        sampled = sched.update(out, [ord(next(chars)) for _ in out.sampling_seqs])
        deltas += [x.new_text for x in sampled]
    return deltas


def test_a_stop_string_finishes_the_sequence_inside_update():
    """The step whose token completes "END" finishes it with 'stop' there, frees its blocks,
    and no text of the stop string (nor a held-back part of it) was ever emitted."""
    sched = make()
    s = seq(sched, "a", "hello", stop=("END",))
    deltas = run(sched, s, "ab ENDxyz")
    assert s.finish_reason == "stop" and s.status is SequenceStatus.FINISHED
    assert "".join(deltas) == "ab " and s.num_output_tokens == 6
    assert not sched.has_unfinished() and sched.bm.num_used_blocks == 0


def test_a_stop_string_outranks_length():
    """A stop string completed by the last token max_tokens allows ends with 'stop'."""
    sched = make()
    s = seq(sched, "a", "hi", stop=("xy",), max_tokens=3)
    run(sched, s, "axy")
    assert s.finish_reason == "stop"
    other = seq(sched, "b", "hi", stop=("xy",), max_tokens=3)
    run(sched, other, "axz")
    assert other.finish_reason == "length"


def test_a_stop_tokens_text_is_not_shown():
    """A stop token ends the sequence with 'stop' and its own text is never fed to the
    detokenizer (an id in stop_token_ids may be an ordinary character)."""
    sched = make()
    s = seq(sched, "a", "hi", stop_token_ids=(ord("!"),))
    deltas = run(sched, s, "ok!")
    assert s.finish_reason == "stop" and "".join(deltas) + s.detokenizer.flush() == "ok"


def test_the_computed_prompt_count_survives_freeing_and_recompute():
    """num_computed_prompt_tokens is the most prompt tokens ever computed: freeing the blocks
    (a recompute preemption, a finish) zeroes num_computed_tokens but not it."""
    sched = make(max_num_seqs=4)
    s = seq(sched, "a", "x" * 20)
    out = sched.schedule()
    assert out.num_new_tokens == [20]             # the whole prompt in one step
    sched.update(out, [ord("a")])
    assert s.num_computed_prompt_tokens == 20 and s.num_computed_tokens == 20
    sched.bm.free(s)                            # what a recompute preemption does to its blocks
    s.num_computed_tokens = 0
    assert s.num_computed_prompt_tokens == 20
    sched.finish(s, "abort")
    assert s.num_computed_prompt_tokens == 20
