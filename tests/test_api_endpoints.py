"""`/v1/completions` and the stateless `/v1/responses` against a real uvicorn with a tiny random
model and the official `openai` client (its own types parse every body and stream event)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from tests.live import KEYS, serve, tenants
from tests.models import load_reference

TOOL = {"type": "function", "name": "get_weather", "description": "weather for a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    reg = tenants(other={"max_tokens": 8}, batch={"requests_per_minute": 1})
    with serve(tiny_model("llama"), tmp_path_factory.mktemp("api-endpoints"), registry=reg) as server:
        yield server


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)


def test_completions_text_and_token_ids_give_the_same_greedy_answer(live):
    """A text prompt and its token ids are the same prompt; echo puts the prompt in front."""
    c = client(live)
    tokenizer = live.gateway.engine.tokenizer
    ids = tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]
    a = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    b = c.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert a.choices[0].text == b.choices[0].text and a.object == "text_completion"
    assert a.usage.prompt_tokens == len(ids) and a.id.startswith("cmpl-")
    e = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0, echo=True)
    assert e.choices[0].text == "Once upon a time" + a.choices[0].text


def test_completions_stream_and_legacy_logprobs(live):
    """Streamed text equals the whole answer; logprobs list each token, its offset and top alternatives."""
    c = client(live)
    whole = c.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))
    assert lp.text_offset[0] == 0 and all(b >= a for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if ch.choices)
    assert streamed == whole.choices[0].text


def test_completions_refusals_name_the_field(live):
    """suffix without FIM tokens, a batch of prompts and max_tokens 0 without echo are 400s naming the field."""
    c = client(live)
    for kwargs, param in [({"suffix": "end"}, "suffix"), ({"prompt": ["a", "b"]}, "prompt"),
                          ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 0, "echo": True, "logprobs": 21},
                                                               "logprobs")]:
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(**{"model": "tiny", "prompt": "x", "max_tokens": 2, **kwargs})
        assert exc.value.param == param, kwargs


def test_responses_text_answer_and_usage(live):
    """A plain input string: one completed message item with output_text and usage."""
    r = client(live).responses.create(model="tiny", input="Say hello", instructions="Be brief",
                                      max_output_tokens=5, temperature=0)
    assert r.status in ("completed", "incomplete") and r.object == "response"
    assert r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert r.usage.output_tokens <= 5 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_forced_function_call_whole_and_streamed(live):
    """tool_choice required: a function_call item whose arguments validate; the stream's events agree."""
    c = client(live)
    r = c.responses.create(model="tiny", input="weather?", tools=[TOOL], tool_choice="required",
                           max_output_tokens=40)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and len({c.call_id for c in calls}) == len(calls)
    for call in calls:              # parallel calls are allowed: each one validates
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
    kinds, args = [], ""
    with c.responses.stream(model="tiny", input="weather?", tools=[TOOL], max_output_tokens=40,
                            tool_choice={"type": "function", "name": "get_weather"}) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert call.arguments == args and json.loads(args)["city"] in ("Paris", "Oslo")


def test_responses_follow_up_with_the_function_output_and_a_json_format(live):
    """The call and its output sent back as input items; text.format json_schema constrains the answer."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    r = client(live).responses.create(
        model="tiny", max_output_tokens=20,
        input=[{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
               {"type": "function_call_output", "call_id": "call_9", "output": "cold"}],
        tools=[TOOL], text={"format": {"type": "json_schema", "name": "ok", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_responses_refusals(live):
    """Stateless: previous_response_id is a 400 naming it; so is an unsupported input item type."""
    h = {"Authorization": f"Bearer {KEYS['acme']}"}
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type")]:
        r = httpx.post(f"{live.url}/v1/responses", json=body, headers=h, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_both_endpoints_answer_to_the_tenant_limits(live):
    """The tenant's max_tokens cap and requests_per_minute apply to completions and responses as to chat."""
    h = {"Authorization": f"Bearer {KEYS['other']}"}
    r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 100}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(f"{live.url}/v1/responses", json={"input": "x", "max_output_tokens": 100}, headers=h, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    h = {"Authorization": f"Bearer {KEYS['batch']}"}
    assert httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=h,
                      timeout=60).status_code == 200
    r = httpx.post(f"{live.url}/v1/responses", json={"input": "x", "max_output_tokens": 2}, headers=h, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "requests_per_minute"
    assert httpx.post(f"{live.url}/v1/responses", json={"input": "x"}).status_code == 401


def test_completions_default_to_16_tokens_within_the_tenant_cap(live):
    """Without max_tokens a completion stops at 16 tokens (OpenAI's default), or at the tenant's smaller cap."""
    body = {"prompt": "Once", "ignore_eos": True}
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 16
    r = httpx.post(f"{live.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS['other']}"},
                   timeout=60)      # "other" may ask for at most 8
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


PROMPT = "The capital of France is Paris, and the capital of Norway is"


def check_prompt_logprobs(lp, ids: list[int], reference: torch.Tensor, k: int) -> None:
    """The echoed prompt's entries: null first, then HF's log-softmax of the token before (fp32 tolerance)."""
    assert "".join(lp.tokens[:len(ids)]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    for p in range(1, len(ids)):
        row = reference[p - 1]
        assert lp.token_logprobs[p] == pytest.approx(row[ids[p]].item(), abs=1e-4)
        top = lp.top_logprobs[p]
        assert 0 < len(top) <= k and max(top.values()) == pytest.approx(row.max().item(), abs=1e-4)
        assert lp.text_offset[p] == len("".join(lp.tokens[:p]))


def test_completions_echo_with_logprobs_scores_the_prompt(live, tiny_model):
    """lm-eval's loglikelihood request (echo, logprobs 5, max_tokens 0 or 1) through the openai
    client: the prompt's logprobs equal HF's forward over it; max_tokens 0 generates nothing and
    bills no completion token; streamed, the echo chunk carries them."""
    c = client(live)
    ids = live.gateway.engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        reference = load_reference(tiny_model("llama"))(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    zero = c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=5, max_tokens=0)
    choice = zero.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length" and zero.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids)
    check_prompt_logprobs(choice.logprobs, ids, reference, 5)
    one = c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=5, max_tokens=1, temperature=0,
                               extra_body={"ignore_eos": True})
    lp = one.choices[0].logprobs
    check_prompt_logprobs(lp, ids, reference, 5)
    assert len(lp.tokens) == len(ids) + 1 and one.usage.completion_tokens == 1
    assert lp.token_logprobs[-1] == pytest.approx(reference[-1].max().item(), abs=1e-4)     # greedy
    assert one.choices[0].text == PROMPT + lp.tokens[-1] and lp.text_offset[-1] == len(PROMPT)
    chunks = [ch for ch in c.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=5, max_tokens=0,
                                                 stream=True) if ch.choices]
    assert chunks[0].choices[0].text == PROMPT
    check_prompt_logprobs(chunks[0].choices[0].logprobs, ids, reference, 5)
    assert "".join(ch.choices[0].text for ch in chunks) == PROMPT and chunks[-1].choices[0].finish_reason == "length"
    plain = c.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
