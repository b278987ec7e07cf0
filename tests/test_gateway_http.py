"""OpenAI-compatible HTTP against a real uvicorn: the official `openai` client, raw SSE,
errors with the right status and field, /v1/models, /health and /metrics."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.held_engine import HeldEngine
from tests.idle import idle_after  # noqa: F401 - fixture
from tests.live import KEYS, engine_config, serve, tenants

MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]


pytestmark = pytest.mark.usefixtures("idle_after")     # every test leaves the server idle

@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    """The tiny model's real engine, stepping freely unless a test holds it (the keep-alive
    test: its stream must outlast several 50 ms keep-alives)."""
    reg = tenants(other={"max_tokens": 16, "max_prompt_tokens": 200})
    model = tiny_model("llama")
    engine = HeldEngine(engine_config(model), steps=None)
    with serve(model, tmp_path_factory.mktemp("http"), engine=engine, registry=reg, keepalive_s=0.05) as server:
        yield server


def client(live, key: str = KEYS["acme"]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_streaming_chat_with_the_openai_client(live):
    """Chunks stream in, the last content chunk has a finish reason and a usage chunk follows."""
    stream = client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, stream=True,
                                                  temperature=0, stream_options={"include_usage": True})
    chunks = list(stream)
    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 12
    assert chunks[0].model == "tiny" and chunks[0].id.startswith("chatcmpl-")


def test_non_streaming_answer_equals_the_streamed_one_at_temperature_zero(live):
    """Greedy decoding gives the same text whether streamed or returned whole."""
    c = client(live)
    whole = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert whole.choices[0].message.content == streamed and streamed
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10


def test_errors_surface_as_openai_exceptions_with_status_and_field(live):
    """Bad key 401, bad field 400 naming it, too-long prompt 400 context_length_exceeded."""
    with pytest.raises(openai.AuthenticationError) as exc:
        client(live, "sk-wrong").chat.completions.create(model="tiny", messages=MESSAGES)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as exc:
        client(live).chat.completions.create(model="tiny", messages=MESSAGES, temperature=7)
    assert exc.value.param == "temperature" and "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client(live, KEYS["other"]).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 400}], stream=True)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        client(live, KEYS["other"]).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=100)
    assert exc.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as exc:
        client(live).chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert exc.value.param == "model"


def test_raw_sse_headers_keepalives_and_done(live):
    """The stream has SSE headers set before the first byte, keep-alive comments and ends with [DONE]."""
    body = {"messages": MESSAGES, "stream": True, "max_tokens": 400, "temperature": 0}
    engine = live.gateway.engine
    engine.hold(16)                 # the stream stalls after 16 steps until a keep-alive came
    try:
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEYS['acme']}"}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-accel-buffering"] == "no"
            assert "x-ratelimit-remaining-requests" not in r.headers    # acme has no request limit
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if line.startswith(":"):
                    engine.release()
    finally:
        engine.release()
    assert lines[-1] == "data: [DONE]"
    assert any(line.startswith(":") for line in lines), "no keep-alive comment"
    payloads = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


def test_invalid_json_body_and_unsupported_fields_are_400s(live):
    """A body that is not JSON, a non-boolean stream or an unsupported field gets a 400 naming it."""
    r = httpx.post(f"{live.url}/v1/chat/completions", content=b"{nope",
                   headers={"Authorization": f"Bearer {KEYS['acme']}"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.headers["x-request-id"]
    r = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   json={"messages": MESSAGES, "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = httpx.post(f"{live.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEYS['acme']}"},
                   json={"messages": MESSAGES, "functions": [{"name": "f", "parameters": {}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "functions"


def test_models_health_and_metrics(live):
    """/v1/models needs a key and lists the model; /metrics has engine and gateway series."""
    assert httpx.get(f"{live.url}/v1/models").status_code == 401
    models = client(live).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    # the engine's context (the model's 2,048 positions, or less where the KV pool is smaller)
    assert 1 < models.data[0].model_extra["max_model_len"] <= 2048
    assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
    client(live).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    text = httpx.get(f"{live.url}/metrics").text
    assert 'streamgate_gateway_requests_total{status="200",tenant="acme",transport="http"}' in text
    assert "streamgate_num_requests_running" in text and "streamgate_time_to_first_token_seconds_bucket" in text
    assert "streamgate_gateway_open_streams" in text
