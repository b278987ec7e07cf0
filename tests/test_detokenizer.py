"""Tests for engine.detokenizer.IncrementalDetokenizer.

The oracle is always a full `tokenizer.decode` of the ids (plus, for stop strings, a
straightforward character-by-character scan), never an output copied from a run.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import MAX_PENDING_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

SENTENCES = ["hello world this is a test", "the quick brown fox jumps over the lazy dog",
             "streaming text with spaces between words", "hello there world of tokens"]
SP_ALPHABET = "helowrdtquickbfx "            # characters the Unigram model was trained on
WIDE_ALPHABET = "ab éü中龘😀\n"               # ASCII, spaces, 2/3/4-byte characters


@pytest.fixture(scope="module")
def smol(tokenizer_dir):
    """The SmolLM2 byte-level BPE tokenizer (from the converted default model)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def sp_unigram():
    """A tiny SentencePiece-style Unigram tokenizer (Metaspace pre-tokenizer and decoder)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(SENTENCES, trainers.UnigramTrainer(
        vocab_size=80, special_tokens=["<unk>", "</s>"], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")


@pytest.fixture(scope="module")
def sp_llama():
    """A tiny Llama-2-style tokenizer: BPE over "▁"-words, byte fallback, Strip decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    base.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"]))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split()) for m in model["merges"]]
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    t.add_special_tokens(["<unk>", "</s>"])
    t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", eos_token="</s>")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(tok, ids, prompt=(), stop=(), skip=True, flush=True):
    """Feed `ids` one at a time; return the detokenizer and the list of deltas."""
    det = IncrementalDetokenizer(tok, list(prompt), stop=tuple(stop), skip_special_tokens=skip)
    deltas = [det.add_token(i) for i in ids]
    if flush:
        deltas.append(det.flush())
    return det, deltas


def cut_at_first_stop(text, stops):
    """Oracle: text before the stop string that completes first (longest on ties)."""
    for end in range(len(text) + 1):
        hits = [s for s in stops if s and text.endswith(s, 0, end)]
        if hits:
            return text[:end - max(map(len, hits))], True
    return text, False


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every id list passed to decode."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids, **kw):
        self.lengths.append(len(ids))
        return self.tok.decode(ids, **kw)


# -- byte-level BPE (SmolLM2) -------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "Hello, world! This is a plain ASCII sentence.",
    "  leading spaces,\n\nnewlines\tand tabs   and trailing  ",
    "你好，世界！这是一个测试。",
    "emoji 😀🎉👍🏽 and flags 🇫🇷 mixed in",
    "mixed: naïve café — 東京 😀 x=1\n  def f(): return 'ok'",
])
def test_round_trip_matches_full_decode(smol, text):
    """Concatenated deltas equal decode(all ids) and no delta holds a replacement char."""
    ids = enc(smol, text)
    det, deltas = stream(smol, ids)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=True) == det.text
    assert not any("\ufffd" in d for d in deltas)
    assert not det.stopped


def test_prompt_text_is_never_emitted(smol):
    """With a prompt as context, only the generated tokens' text is emitted."""
    prompt, gen = enc(smol, "Tell me a story about"), enc(smol, " a brave little toaster.")
    det, deltas = stream(smol, gen, prompt=prompt)
    assert det.text == smol.decode(gen, skip_special_tokens=True)


@pytest.mark.parametrize("text", ["a😀b", "x龘y 𝕏!"])
def test_multibyte_character_split_across_tokens_is_held(smol, text):
    """A character spanning several tokens is emitted only once it is complete."""
    ids = enc(smol, text)
    full = smol.decode(ids)
    # Precondition: some character needs more than one token.
    assert any(len(enc(smol, ch)) > 1 for ch in text)
    det = IncrementalDetokenizer(smol, [])
    held_steps = 0
    for k, i in enumerate(ids, 1):
        delta = det.add_token(i)
        assert "\ufffd" not in delta
        assert full.startswith(det.text)                   # never a partial character
        held_steps += smol.decode(ids[:k]).endswith("\ufffd")
        if smol.decode(ids[:k]).endswith("\ufffd"):
            assert delta == ""
    assert held_steps > 0
    assert det.text + det.flush() == full


def test_skip_special_tokens(smol):
    """Special tokens are dropped with skip_special_tokens=True and kept otherwise."""
    end = smol.convert_tokens_to_ids("<|im_end|>")
    ids = enc(smol, "Hi there") + [end] + enc(smol, " more text") + [end]
    det, _ = stream(smol, ids)
    assert det.text == smol.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in det.text
    det, _ = stream(smol, ids, skip=False)
    assert det.text == smol.decode(ids, skip_special_tokens=False)
    assert det.text.count("<|im_end|>") == 2


# -- stop strings ----------------------------------------------------------------------------

def test_stop_string_split_across_tokens(smol):
    """A stop string spread over several tokens is detected; it and what follows are cut."""
    stop = "<<HALT>>"
    text = "The answer is 42.<<HALT>> and this must never appear"
    ids = enc(smol, text)
    full = smol.decode(ids)
    # Precondition: the stop string's characters span at least two tokens.
    start = full.index(stop)
    k_first = max(k for k in range(len(ids) + 1) if len(smol.decode(ids[:k])) <= start)
    k_done = min(k for k in range(len(ids) + 1) if stop in smol.decode(ids[:k]))
    assert k_done - k_first >= 2
    det, deltas = stream(smol, ids, stop=[stop], flush=False)
    assert det.stopped
    assert det.text == "".join(deltas) == full[:start]
    assert all(d == "" for d in deltas[k_done:])
    assert det.flush() == "" and det.add_token(ids[0]) == ""
    assert det.text == full[:start]


def test_partial_stop_is_held_then_released(smol):
    """Text that might start a stop string is held, and emitted once it turns out not to be."""
    stop = "END"
    text = "We stop at the EN of the line, and then END for real."
    ids = enc(smol, text)
    full = smol.decode(ids)
    det = IncrementalDetokenizer(smol, [], stop=(stop,))
    held_en = False
    for k, i in enumerate(ids, 1):
        det.add_token(i)
        so_far = smol.decode(ids[:k])
        assert cut_at_first_stop(full, [stop])[0].startswith(det.text)
        if so_far.endswith(" EN"):                         # could still become "END"
            held_en = True
            assert not det.text.endswith("EN")
    assert held_en                                         # precondition: the case occurred
    assert det.stopped
    assert det.text == full[:full.index("END")]
    assert "the EN of" in det.text


def test_flush_releases_held_text_without_stop(smol):
    """When generation ends without a stop, flush() returns the held possible-stop prefix."""
    text = "the story ends with EN"
    ids = enc(smol, text)
    det, deltas = stream(smol, ids, stop=("END", "xyz"), flush=False)
    assert not det.text.endswith("EN")
    tail = det.flush()
    assert tail.endswith("EN")
    assert det.text == smol.decode(ids) and not det.stopped
    assert det.flush() == ""


def test_stop_at_very_start(smol):
    """A stop string at the beginning of the output yields empty text and stopped=True."""
    ids = enc(smol, "STOP then more")
    det, deltas = stream(smol, ids, stop=("STOP",))
    assert det.stopped and det.text == "" and all(d == "" for d in deltas)


# -- SentencePiece-style tokenizers ------------------------------------------------------

@pytest.mark.parametrize("which", ["sp_unigram", "sp_llama"])
def test_sentencepiece_spacing(request, which):
    """Tokenizers that strip the first token's leading space still stream correct spacing."""
    tok = request.getfixturevalue(which)
    ids = enc(tok, "hello world the quick fox")
    full = tok.decode(ids)
    # Precondition: decoding token by token loses spaces, so a naive stream would be wrong.
    assert "".join(tok.decode([i]) for i in ids) != full
    det, _ = stream(tok, ids)
    assert det.text == full


@pytest.mark.parametrize("which", ["sp_unigram", "sp_llama"])
def test_sentencepiece_first_token_space_uses_prompt_context(request, which):
    """The first generated token keeps its leading space thanks to the prompt context."""
    tok = request.getfixturevalue(which)
    prompt, gen = enc(tok, "hello there"), enc(tok, "world of tokens")
    expected = tok.decode(prompt + gen)[len(tok.decode(prompt)):]
    assert expected.startswith(" ") and not tok.decode(gen).startswith(" ")   # precondition
    det, _ = stream(tok, gen, prompt=prompt)
    assert det.text == expected


def test_prompt_ending_in_byte_fallback_characters_keeps_context(sp_llama):
    """A prompt tail cut inside byte-fallback characters still gives the right first space."""
    prompt, gen = enc(sp_llama, "hello 中中"), enc(sp_llama, "world")
    tail = sp_llama.convert_ids_to_tokens(prompt[-PROMPT_CONTEXT_TOKENS:])
    assert tail[0] != "<0xE4>" and tail[-1].startswith("<0x")      # precondition: cut mid-char
    expected = sp_llama.decode(prompt + gen)[len(sp_llama.decode(prompt)):]
    assert expected.startswith(" ")
    det, _ = stream(sp_llama, gen, prompt=prompt)
    assert det.text == expected


def test_runs_of_special_tokens_keep_spacing_and_small_window(sp_llama):
    """Many skipped special tokens in a row neither grow the window nor lose a space."""
    eos = sp_llama.convert_tokens_to_ids("</s>")
    ids = enc(sp_llama, "hello") + [eos] * (2 * MAX_PENDING_TOKENS) + enc(sp_llama, " world")[1:]
    assert sp_llama.convert_ids_to_tokens(ids[-1]).startswith("▁")   # precondition
    counting = CountingTokenizer(sp_llama)
    det, _ = stream(counting, ids)
    assert det.text == sp_llama.decode(ids, skip_special_tokens=True) == "hello world"
    assert max(counting.lengths) <= 4


def test_byte_fallback_partial_character_is_held(sp_llama):
    """With byte-fallback tokens (<0xF0> ...), no partial character is ever emitted."""
    ids = enc(sp_llama, "hello 😀 wörld")
    assert len([t for t in sp_llama.convert_ids_to_tokens(ids) if t.startswith("<0x")]) >= 4
    det, deltas = stream(sp_llama, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert det.text == sp_llama.decode(ids)


# -- bounded cost ----------------------------------------------------------------------------

def test_decode_window_stays_bounded(smol):
    """Per-token work decodes a small window, not the whole output."""
    ids = enc(smol, "Streaming text with 😀 emoji and 中文 characters. " * 60)
    counting = CountingTokenizer(smol)
    det, _ = stream(counting, ids, prompt=enc(smol, "a prompt of some length " * 5),
                    stop=("never-seen",))
    assert len(ids) > 500
    assert det.text == smol.decode(ids)
    assert max(counting.lengths) <= PROMPT_CONTEXT_TOKENS + 8


def test_never_completing_bytes_are_eventually_emitted(smol):
    """A long run of invalid bytes does not grow the window forever and matches full decode."""
    lone = smol.convert_tokens_to_ids("ð")                # the single byte 0xF0
    ids = [lone] * (3 * MAX_PENDING_TOKENS)
    assert smol.decode(ids[:5]).endswith("\ufffd")         # precondition: always "incomplete"
    counting = CountingTokenizer(smol)
    det, deltas = stream(counting, ids)
    assert any(deltas[:-1])                                # emitted before the end
    assert max(counting.lengths) <= MAX_PENDING_TOKENS + 1
    assert det.text == smol.decode(ids)


# -- properties ------------------------------------------------------------------------------

CASES = [("smol", WIDE_ALPHABET), ("sp_unigram", SP_ALPHABET), ("sp_llama", WIDE_ALPHABET)]
PROPS = settings(max_examples=150, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("which,alphabet", CASES)
def test_property_incremental_equals_full_decode(request, which, alphabet):
    """For random text and prompt, streamed text equals the full decode's continuation."""
    tok = request.getfixturevalue(which)

    @PROPS
    @given(prompt=st.text(alphabet, max_size=12), text=st.text(alphabet, max_size=40))
    def check(prompt, text):
        p, g = enc(tok, prompt), enc(tok, text)
        det, deltas = stream(tok, g, prompt=p)
        expected = tok.decode(p + g)[len(tok.decode(p)):] if p else tok.decode(g)
        assert "".join(deltas) == det.text == expected

    check()


@pytest.mark.parametrize("which,alphabet", CASES)
def test_property_stop_strings(request, which, alphabet):
    """For random text and stop strings, output is the text before the first completed stop."""
    tok = request.getfixturevalue(which)
    short = alphabet[:4] + " "

    @PROPS
    @given(text=st.text(short, max_size=40),
           stops=st.lists(st.text(short, min_size=1, max_size=4), max_size=3))
    def check(text, stops):
        ids = enc(tok, text)
        det, deltas = stream(tok, ids, stop=stops)
        expected, hit = cut_at_first_stop(tok.decode(ids), stops)
        assert det.text == "".join(deltas) == expected
        assert det.stopped == hit

    check()
