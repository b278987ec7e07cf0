"""WebSocket parity for the newer chat fields, against a real uvicorn: a grammar-forced tool
call arrives as `tool_calls` deltas and one whole `chat.tool_call`, logprobs ride on deltas,
`n` choices are told apart by `index`, and a bad field is an error event naming it."""

from __future__ import annotations

import asyncio
import json

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


async def frames_of(live, request: dict) -> list[dict]:
    """Send one chat.request; return its frames up to and including chat.done or error."""
    async with websockets.connect(live.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": KEYS["acme"]}))
        await ws.recv()
        await ws.send(json.dumps({"type": "chat.request", "id": "r1", **request}))
        out = []
        while not out or out[-1]["type"] not in ("chat.done", "error"):
            out.append(json.loads(await asyncio.wait_for(ws.recv(), timeout=60)))
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
