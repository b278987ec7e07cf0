"""The newer chat fields against a real uvicorn with a tiny random model and the official
`openai` client: logprobs, n, response_format (json_schema via `chat.completions.parse`),
tools with a grammar-forced tool_choice (whole and streamed, reassembled by the client's own
stream helper), tool-call history, and the 400 each contradictory combination gets."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.held_engine import HeldEngine
from tests.live import KEYS, engine_config, serve, wait_until

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    """The tiny model's real engine, stepping freely unless a test holds it (tests/held_engine.py)."""
    model = tiny_model("llama")
    engine = HeldEngine(engine_config(model), steps=None)
    with serve(model, tmp_path_factory.mktemp("api-chat"), engine=engine) as server:
        yield server


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)


def test_logprobs_are_the_chosen_tokens_with_their_top_alternatives(live):
    """Greedy: each content entry is the argmax (top_logprobs[0]) and the tokens' bytes spell the text."""
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                             logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == r.choices[0].message.content


def test_n_choices_each_with_its_index_and_billed_as_n_completions(live):
    """n=3: three choices 0..2; usage counts the prompt once and every choice's tokens."""
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=3, seed=7,
                                             extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 15 and all(c.finish_reason == "length" for c in r.choices)
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1, "each choice draws its own tokens (seed + index)"
    again = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, n=3, seed=7,
                                                 extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == texts, "the same seed reproduces every choice"
    stream = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, n=2, stream=True,
                                                  extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
    finishes, text = {}, {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if chunk.usage:
            assert chunk.usage.completion_tokens == 8
    assert finishes == {0: "length", 1: "length"} and text[0] and text[1]


class Trip(BaseModel):
    city: Literal["Paris", "Rome"]
    nights: int = Field(ge=1, le=9)
    direct: bool


def test_parse_with_a_pydantic_model_returns_a_valid_instance(live):
    """json_schema strict (the client's `parse`): a random model's output validates against the model."""
    r = client(live).chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Trip, max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Trip)
    r = client(live).beta.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Trip, max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Trip) and r.choices[0].finish_reason == "stop"
    # json_object is any object: a random model fills one until max_tokens, so what the test can
    # check is that the output is always a JSON object prefix (here cut short) and that, when a
    # bias makes "{}" likely, the grammar ends the answer right after it.
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                             response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    empty = live.gateway.engine.tokenizer.convert_tokens_to_ids("{}")
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12,
                                             response_format={"type": "json_object"}, logit_bias={str(empty): 100})
    assert json.loads(r.choices[0].message.content) == {} and r.choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_a_call_whose_arguments_validate(live):
    """A named tool_choice: one call of that function, arguments valid against its schema, finish tool_calls."""
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, tools=[WEATHER, CLOCK],
                                             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_streamed_and_reassembled_by_the_client(live):
    """tool_choice required, streamed: the client's stream helper reassembles valid calls."""
    with client(live).chat.completions.stream(model="tiny", messages=MESSAGES, max_tokens=80,
                                              tools=[WEATHER, CLOCK], tool_choice="required",
                                              parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_call_history_is_accepted(live):
    """An assistant turn with tool_calls and the tool's answer render and generate."""
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = client(live).chat.completions.create(model="tiny", messages=history, tools=[WEATHER], max_tokens=4,
                                             tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.usage.completion_tokens >= 1


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_contradictions_and_bad_values_are_400s_naming_the_field(live, extra, param):
    """Each unsupported combination or bad value gets a 400 whose param names the field."""
    r = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   json={"messages": MESSAGES, "max_tokens": 4, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_n_is_billed_once_for_the_prompt_and_for_every_choice(live):
    """The ledger grows by usage.total_tokens: prompt once + the tokens of all n choices."""
    ledger = live.gateway.quotas.ledger
    before = ledger.used_today("acme")
    r = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, n=4,
                                             extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 24
    assert wait_until(lambda: live.gateway.quotas.in_flight("acme") == 0)
    assert ledger.used_today("acme") - before == r.usage.prompt_tokens + 24 == r.usage.total_tokens


def test_leaving_an_n_stream_aborts_every_choice_and_settles(live):
    """A client that hangs up after the first chunks: all n engine requests end and the lease is settled."""
    ledger = live.gateway.quotas.ledger
    before = ledger.used_today("acme")
    body = {"messages": MESSAGES, "max_tokens": 1500, "n": 3, "stream": True, "ignore_eos": True}
    engine = live.gateway.engine
    engine.hold(16)         # then two steps per line read: the choices are still running when it leaves
    try:
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
            lines = r.iter_lines()
            seen = []
            for _ in range(8):
                seen.append(next(lines))
                engine.allow(2)
        assert any('"index": 2' in line for line in seen)
        assert wait_until(lambda: live.gateway.quotas.in_flight("acme") == 0, timeout=30)
        assert wait_until(lambda: live.engine_stats()["running"] == 0, timeout=30)
    finally:
        engine.release()    # (only now: released earlier, the choices could run to 1500 before their aborts land)
    billed = ledger.used_today("acme") - before
    assert 0 < billed < 3 * 1500
