"""The client libraries people point at an OpenAI-compatible server, against a real uvicorn
with a tiny random model: langchain-openai (`bind_tools`, `with_structured_output` with each
of its methods) and the openai-agents SDK running an agent with one function tool end to
end over /v1/responses. A random model emits calls only when the grammar forces them, so
the tool choice is forced where a call is expected."""

from __future__ import annotations

from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field

from tests.live import KEYS, serve


class Trip(BaseModel):
    """A trip."""

    city: Literal["Paris", "Rome"]
    nights: int = Field(ge=1, le=9)
    direct: bool


class Forecast(BaseModel):
    sunny: bool
    grade: Literal["good", "bad"]


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    with serve(tiny_model("llama"), tmp_path_factory.mktemp("api-clients")) as server:
        yield server


def chat_model(live, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], model="tiny", max_retries=0,
                      timeout=120, **{"max_tokens": 60, **kw})


def pick_city_tool():
    from langchain_core.tools import tool

    @tool
    def pick_city(city: Literal["Paris", "Oslo"], nights: int = Field(ge=1, le=5)) -> str:
        """Book a city for some nights."""
        return city

    return pick_city


def test_langchain_bind_tools_forced_call_whole_and_streamed(live):
    """bind_tools with a named tool_choice: an AIMessage with a parsed tool call; streamed chunks add up to it."""
    llm = chat_model(live).bind_tools([pick_city_tool()], tool_choice="pick_city")
    msg = llm.invoke("Book me a trip")
    (call,) = msg.tool_calls
    assert call["name"] == "pick_city" and call["args"]["city"] in ("Paris", "Oslo") and 1 <= call["args"]["nights"] <= 5
    assert msg.response_metadata["finish_reason"] == "tool_calls" and not msg.invalid_tool_calls
    total = None
    for chunk in llm.stream("Book me a trip"):
        total = chunk if total is None else total + chunk
    (call,) = total.tool_calls
    assert call["name"] == "pick_city" and call["args"]["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output_methods_return_the_model(live, method):
    """with_structured_output (json_schema: response_format; function_calling: a forced tool) parses a Trip."""
    result = chat_model(live).with_structured_output(Trip, method=method).invoke("Plan a trip")
    assert isinstance(result, Trip)


def test_langchain_json_mode_gets_a_json_object(live):
    """json_mode sends response_format json_object, which only promises a JSON object (a random model
    fills one until max_tokens): with logit_bias favouring the "{}" token the answer is exactly {},
    which the grammar then ends; LangChain reports that {} is no Trip."""
    empty = live.gateway.engine.tokenizer.convert_tokens_to_ids("{}")
    out = chat_model(live, logit_bias={str(empty): 100}).with_structured_output(
        Trip, method="json_mode", include_raw=True).invoke("Plan a trip as JSON")
    assert out["raw"].content == "{}" and out["raw"].response_metadata["finish_reason"] == "stop"
    assert out["parsed"] is None and out["parsing_error"] is not None


def test_openai_agents_sdk_runs_an_agent_with_one_function_tool(live):
    """Runner.run_sync: turn 1 calls the tool (tool_choice required), the SDK runs it, turn 2 answers
    with the agent's output_type (text.format json_schema: the grammar ends the answer, where a random
    model's free text would run to max_tokens, which the SDK treats as a failure)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)
    agent = Agent(name="forecaster", instructions="Answer with the weather.", tools=[get_weather],
                  output_type=Forecast, model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert calls and calls[0] in ("Paris", "Oslo")
    assert isinstance(result.final_output, Forecast)
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert sorted(o.output for o in outputs) == sorted(f"sunny in {c}" for c in calls)
