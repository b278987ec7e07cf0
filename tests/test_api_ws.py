"""WebSocket parity for the newer chat fields, against a real uvicorn: a grammar-forced tool
call arrives as `tool_calls` deltas and one whole `chat.tool_call`, logprobs ride on deltas,
`n` choices are told apart by `index`, and a bad field is an error event naming it; completions
and responses run over the same socket (gateway/ws_openai.py) with one terminal frame each."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
import websockets

from tests.live import KEYS, serve

MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 3}},
          "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    with serve(tiny_model("llama"), tmp_path_factory.mktemp("api-ws")) as server:
        yield server


async def frames_of(live, request: dict, kind: str = "chat") -> list[dict]:
    """Send one `kind`.request; return its frames up to and including `kind`.done or error,
    checking that no other frame of it follows."""
    async with websockets.connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
        await ws.recv()
        await ws.send(json.dumps({"type": f"{kind}.request", "id": "r1", **request}))
        out = []
        while not out or out[-1]["type"] not in (f"{kind}.done", "error"):
            out.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=60)))
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), timeout=60)) == {"type": "pong"}
        return out


async def test_forced_tool_call_over_the_socket(live):
    """tool_calls deltas reassemble to the chat.tool_call frame; arguments validate; done says tool_calls."""
    frames = await frames_of(live, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 60,
                                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    deltas = [d for f in frames if f["type"] == "chat.delta" for d in f.get("tool_calls", ())]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "get_weather"
    args = "".join(d["function"]["arguments"] for d in deltas)
    (whole,) = [f["tool_call"] for f in frames if f["type"] == "chat.tool_call"]
    assert whole["function"]["arguments"] == args and whole["id"] == deltas[0]["id"]
    jsonschema.validate(json.loads(args), PARAMS)
    assert frames[-1]["type"] == "chat.done" and frames[-1]["finish_reason"] == "tool_calls"
    assert all(f["text"] == "" for f in frames if f["type"] == "chat.delta")


async def test_logprobs_and_n_over_the_socket(live):
    """n=2 with logprobs: deltas carry index and logprobs; each choice ends; done lists both."""
    frames = await frames_of(live, {"messages": MESSAGES, "max_tokens": 4, "n": 2, "logprobs": True,
                                    "top_logprobs": 2, "ignore_eos": True})
    tokens = {0: 0, 1: 0}
    for f in frames:
        if f["type"] == "chat.delta" and "logprobs" in f:
            tokens[f["index"]] += len(f["logprobs"])
            assert all(len(e["top_logprobs"]) == 2 for e in f["logprobs"])
    assert tokens == {0: 4, 1: 4}
    ends = [f for f in frames if f["type"] == "chat.delta" and "finish_reason" in f]
    assert sorted(f["index"] for f in ends) == [0, 1]
    done = frames[-1]
    assert done["choices"] == [{"index": 0, "finish_reason": "length"}, {"index": 1, "finish_reason": "length"}]
    assert done["usage"]["completion_tokens"] == 8


async def test_bad_tool_choice_is_an_error_event_naming_the_field(live):
    """A named tool_choice that is not among the tools: an error event with param tool_choice."""
    frames = await frames_of(live, {"messages": MESSAGES, "tools": TOOLS,
                                    "tool_choice": {"type": "function", "function": {"name": "other"}}})
    assert frames[-1]["type"] == "error" and frames[-1]["error"]["param"] == "tool_choice"


def http_completion(live, body: dict) -> dict:
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def test_completion_over_the_socket_equals_http(live):
    """completion.request with echo + logprobs: chunks carry the SSE chunk bodies (the echo with
    the prompt's logprobs first), their text and logprobs equal the HTTP answer; done has usage."""
    body = {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2,
            "ignore_eos": True}
    whole = http_completion(live, body)["choices"][0]
    frames = await frames_of(live, body, "completion")
    chunks = [f["chunk"] for f in frames if f["type"] == "completion.chunk"]
    assert all(f["id"] == "r1" for f in frames) and chunks[0]["object"] == "text_completion"
    assert chunks[0]["choices"][0]["text"] == "Once upon a time"
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    got = [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert got == pytest.approx(whole["logprobs"]["token_logprobs"])
    done = frames[-1]
    assert done["type"] == "completion.done" and done["usage"]["completion_tokens"] == 3
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"


async def test_response_over_the_socket(live):
    """response.request: Responses events in order, the last one (response.done) holding the whole response."""
    frames = await frames_of(live, {"input": "Hello", "max_output_tokens": 4}, "response")
    events = [f["event"] for f in frames if f["type"] in ("response.event", "response.done")]
    assert events[0]["type"] == "response.created" and frames[-1]["type"] == "response.done"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = frames[-1]["event"]
    assert final["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final["response"]["output"][0]["content"][0]["text"] == text
    assert final["response"]["usage"]["output_tokens"] <= 4


@pytest.mark.parametrize("kind, body, param", [
    ("completion", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completion", {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 99}, "logprobs"),
    ("response", {"input": "x", "max_output_tokens": "many"}, "max_output_tokens"),
])
async def test_bad_completion_and_response_fields_are_error_frames(live, kind, body, param):
    """A field admission refuses: one error frame naming it, and the socket goes on."""
    frames = await frames_of(live, body, kind)
    assert len(frames) == 1 and frames[0]["type"] == "error" and frames[0]["error"]["param"] == param
