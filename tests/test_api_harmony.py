"""gpt-oss's harmony output (gateway/harmony.py): the analysis channel as reasoning, the
final channel as content, `commentary to=functions.NAME` messages as tool calls — fed in
any split, and through a real uvicorn with the official `openai` client reassembling the
streamed call, with the parser chosen from a harmony chat template and the engine asked to
keep special tokens in the text (the markers are special tokens in gpt-oss's vocabulary)."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.harmony import HarmonyParser
from gateway.tool_parsers import ToolCallDelta
from tests.live import KEYS, serve
from tests.fake_engine import FakeEngine, FakeTokenizer

ANSWER = ('<|channel|>analysis<|message|>Need the weather <|end|> tool.<|end|>'
          '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
          '{"city": "Paris <|end"}')
FINAL = '<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 3 < 4.'
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def parse(pieces: list[str]) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls) from feeding `pieces` one by one."""
    p, out = HarmonyParser(), []
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish()
    reasoning = "".join(x[1] for x in out if isinstance(x, tuple) and x[0] == "reasoning")
    content = "".join(x[1] for x in out if isinstance(x, tuple) and x[0] == "content")
    calls: dict[int, dict] = {}
    for x in out:
        if isinstance(x, ToolCallDelta):
            c = calls.setdefault(x.index, {"name": x.name, "arguments": ""})
            c["arguments"] += x.arguments
            assert x.name is None or x.name == c["name"]
    return reasoning, content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", [ANSWER, FINAL])
def test_every_split_parses_the_same(text):
    """Whole, character by character, and cut at every point: the same reasoning, content and calls."""
    whole = parse([text])
    assert parse(list(text)) == whole
    for cut in range(1, len(text)):
        assert parse([text[:cut], text[cut:]]) == whole, cut


def test_channels_and_calls():
    """analysis -> reasoning, final -> content (a lone '<' kept), a call's body -> its arguments."""
    assert parse([ANSWER]) == ("Need the weather ", "", [{"name": "get_weather",
                                                          "arguments": '{"city": "Paris <|end"}'}])
    # `<|end|>` closes the analysis message: " tool." is a header fragment, not shown.
    assert parse([FINAL]) == ("Easy.", "It is 3 < 4.", [])
    assert parse(["plain text, no header"]) == ("", "plain text, no header", [])
    two = ('<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{}<|call|>'
           '<|start|>assistant<|channel|>commentary to=functions.b<|message|>{"x": 1}<|call|>')
    assert parse([two])[2] == [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": '{"x": 1}'}]
    assert parse(['<|channel|>commentary<|message|>Checking.<|end|>'])[1] == "Checking."


class HarmonyTokenizer(FakeTokenizer):
    chat_template = "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return "\n".join(m["content"] for m in messages)[-40:]


class RecordingEngine(FakeEngine):
    def __init__(self, script):
        super().__init__(script)
        self.params = []

    def validate(self, rid, prompt, params, **kw):
        self.params.append(params)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    cut = [ANSWER[i:i + 7] for i in range(0, len(ANSWER), 7)]
    engine = RecordingEngine([(1, piece) for piece in cut])
    engine.tokenizer = HarmonyTokenizer()
    engine.max_model_len = 4096
    with serve("fake", tmp_path_factory.mktemp("harmony"), engine=engine) as server:
        yield server, engine


def test_harmony_call_whole_and_streamed_with_the_openai_client(live):
    """Chosen from the template: reasoning_content, the call reassembled by the client's stream helper."""
    server, engine = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=60)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[TOOL], max_tokens=50)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert whole.message.model_extra["reasoning_content"] == "Need the weather "
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris <|end"}
    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris <|end"} and call.id.startswith("call_")
    assert engine.params and not any(p.skip_special_tokens for p in engine.params)


MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_tokenizer(tokenizer_dir):
    """SmolLM2's tokenizer with harmony's markers as special tokens (as they are in gpt-oss's)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def test_a_real_tokenizers_stream_keeps_the_markers_only_with_special_tokens(harmony_tokenizer):
    """Detokenized token by token with special tokens kept, harmony parses as the whole text
    does; with them skipped (the default) the markers vanish and no call is found."""
    from engine.detokenizer import IncrementalDetokenizer

    ids = harmony_tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    assert all(harmony_tokenizer.convert_tokens_to_ids(m) in ids for m in ("<|channel|>", "<|message|>"))

    def pieces(skip: bool) -> list[str]:
        d = IncrementalDetokenizer(harmony_tokenizer, [1, 2], skip_special_tokens=skip)
        return [d.add_token(t) for t in ids] + [d.flush()]

    assert parse(pieces(False)) == parse([ANSWER])
    assert parse(pieces(True))[2] == []


def test_the_engine_keeps_special_tokens_when_asked(tiny_model):
    """SamplingParams.skip_special_tokens reaches the engine's detokenizer: a special token the
    bias forces shows in the text only when it is False."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, num_kv_blocks=64))
    special = eng.tokenizer.convert_tokens_to_ids("<|im_start|>")
    texts = {}
    for skip in (True, False):
        eng.add_request(str(skip), [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, logit_bias={special: 100},
                                                              skip_special_tokens=skip))
        texts[skip] = ""
        while eng.has_unfinished():
            texts[skip] += "".join(o.new_text for o in eng.step())
    assert texts == {True: "", False: "<|im_start|><|im_start|>"}
