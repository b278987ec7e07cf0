"""Structured output with speculative decoding, end to end: two real uvicorn gateways on the
repeat model (tests/conftest.py), one with n-gram speculation, and the official `openai`
client. A json_schema answer (`chat.completions.parse`) and a forced tool call, greedy and
seeded, come back the same from both, valid against their schemas, while the speculative
engine verified drafts on those constrained rows (engine/spec_decode.py)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.held_engine import HeldEngine
from tests.live import KEYS, engine_config, serve
from tests.test_api_chat import MESSAGES, WEATHER, Trip


@pytest.fixture(scope="module")
def pair(repeat_model, tmp_path_factory):
    """(plain server, speculative server, the speculative engine) on the same model."""
    spec = HeldEngine(engine_config(repeat_model, num_speculative_tokens=3, speculative_ngram_min=1), steps=None)
    with serve(repeat_model, tmp_path_factory.mktemp("plain"), engine=HeldEngine(engine_config(repeat_model),
                                                                                 steps=None)) as plain, \
            serve(repeat_model, tmp_path_factory.mktemp("spec"), engine=spec) as fast:
        yield plain, fast, spec.gate


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=11)])
def test_structured_answers_are_the_same_with_speculation(pair, sampling):
    plain, fast, engine = pair
    before = engine.stats()["spec_draft_tokens"]
    got = []
    for live in (plain, fast):
        parsed = client(live).chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Trip,
                                                     max_tokens=60, **sampling)
        call = client(live).chat.completions.create(
            model="tiny", messages=MESSAGES, tools=[WEATHER], max_tokens=60, **sampling,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (tool,) = call.choices[0].message.tool_calls
        jsonschema.validate(json.loads(tool.function.arguments), WEATHER["function"]["parameters"])
        assert isinstance(parsed.choices[0].message.parsed, Trip)
        got.append((parsed.choices[0].message.content, tool.function.arguments, call.choices[0].finish_reason))
    assert got[0] == got[1]
    assert engine.stats()["spec_draft_tokens"] > before, "the constrained rows drafted"
