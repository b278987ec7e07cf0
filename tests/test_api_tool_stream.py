"""Tool calls in `auto` mode through a real uvicorn and the official `openai` client, with a
fake engine that writes a Hermes call (a random model never would): content before the
call, the call streamed as tool_calls deltas and reassembled by the client's stream
helper, a literal `</tool_call>` inside an argument kept, finish_reason tool_calls — over
chat (whole and streamed) and /v1/responses."""

from __future__ import annotations

import json

import openai
import pytest

from tests.live import KEYS, serve
from tests.fake_engine import FakeEngine, FakeTokenizer

ANSWER = ["Sure. ", "<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Pa',
          'ris </tool_call> x"}}\n</tool_call>']
ARGS = {"city": "Paris </tool_call> x"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class ToolsTokenizer(FakeTokenizer):
    chat_template = "{{ messages }}"        # knows no tools: they arrive in a Hermes system message

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        assert not kw
        return "\n".join(m["content"] for m in messages)[-40:]


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    engine = FakeEngine([(1, piece) for piece in ANSWER])
    engine.tokenizer = ToolsTokenizer()
    engine.max_model_len = 4096
    with serve("fake", tmp_path_factory.mktemp("tool-stream"), engine=engine) as server:
        yield server


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=60)


def test_auto_tool_call_whole_and_streamed(live):
    """The call is parsed out of the text; streamed deltas reassemble to the same call."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[TOOL], max_tokens=50)
    whole = client(live).chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure. "
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    with client(live).chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure. "
    (call,) = final.message.tool_calls
    assert json.loads(call.function.arguments) == ARGS and call.id.startswith("call_")


def test_auto_tool_call_in_responses_and_tool_choice_none(live):
    """/v1/responses: a message item then a function_call item; tool_choice none leaves the text alone."""
    r = client(live).responses.create(model="tiny", input="weather?", tools=[
        {"type": "function", "name": "get_weather", "parameters": TOOL["function"]["parameters"]}])
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[0].content[0].text == "Sure. " and json.loads(r.output[1].arguments) == ARGS
    plain = client(live).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                 tools=[TOOL], tool_choice="none").choices[0]
    assert plain.message.content == "".join(ANSWER) and plain.finish_reason == "stop"


@pytest.fixture
def stalling(tmp_path):
    engine = FakeEngine([(1, "a"), "stall"])
    engine.max_model_len = 4096
    with serve("fake", tmp_path, engine=engine) as server:
        yield server, engine


async def test_cancelling_an_n_request_aborts_every_choice(stalling):
    """chat.cancel of an n=2 request aborts both engine requests; it ends with one chat.done abort."""
    import asyncio

    import websockets

    live, engine = stalling
    async with websockets.connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
        await ws.recv()
        await ws.send(json.dumps({"type": "chat.request", "id": "r", "n": 2, "max_tokens": 100,
                                  "messages": [{"role": "user", "content": "hi"}]}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert first["type"] == "chat.delta" and first["index"] in (0, 1)
        await ws.send(json.dumps({"type": "chat.cancel", "id": "r"}))
        frames = []
        while not frames or frames[-1]["type"] != "chat.done":
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    assert frames[-1]["finish_reason"] == "abort"
    rid = engine.finals[0].request_id.rsplit("-", 1)[0]
    assert sorted(engine.aborted) == [f"{rid}-0", f"{rid}-1"]
    assert sorted(f.request_id for f in engine.finals) == [f"{rid}-0", f"{rid}-1"]


async def test_auto_tool_call_over_the_socket(live):
    """The same call over the WebSocket: text, tool_calls deltas, one chat.tool_call, done with tool_calls."""
    import asyncio

    import websockets

    async with websockets.connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
        await ws.recv()
        await ws.send(json.dumps({"type": "chat.request", "id": 1, "tools": [TOOL],
                                  "messages": [{"role": "user", "content": "weather?"}]}))
        frames = []
        while not frames or frames[-1]["type"] != "chat.done":
            frames.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    text = "".join(f["text"] for f in frames if f["type"] == "chat.delta")
    fragments = "".join(d["function"]["arguments"] for f in frames for d in f.get("tool_calls", ()))
    (call,) = [f["tool_call"] for f in frames if f["type"] == "chat.tool_call"]
    assert text == "Sure. " and fragments == call["function"]["arguments"] and json.loads(fragments) == ARGS
    assert frames[-1]["finish_reason"] == "tool_calls" and frames[-1]["usage"]["completion_tokens"] == len(ANSWER)
