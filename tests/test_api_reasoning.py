"""Reasoning output against a real uvicorn: a tiny random model whose chat template opens a
`<think>` block for the answer (as DeepSeek-R1's and Qwen3's thinking templates do) returns
what it writes as `reasoning_content`, whole and streamed, or inline with
`separate_reasoning: false`."""

from __future__ import annotations

import shutil

import openai
import pytest

from tests.live import KEYS, serve

THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def live(tiny_model, tmp_path_factory):
    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model("llama"), model)
    (model / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    with serve(str(model), tmp_path_factory.mktemp("api-reasoning")) as server:
        yield server


def ask(live, **kw):
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)
    return c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                     **{"extra_body": {"ignore_eos": True}, **kw})


def test_reasoning_content_whole_streamed_and_inline(live):
    """The block the template opened is reasoning_content; the same text streams as deltas or stays inline."""
    inline = ask(live, extra_body={"ignore_eos": True, "separate_reasoning": False}).choices[0].message
    assert inline.content and "</think>" not in inline.content
    split = ask(live).choices[0].message
    assert split.reasoning_content == inline.content and not split.content
    reasoning = content = ""
    for chunk in ask(live, stream=True):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert reasoning == inline.content and content == ""


def test_responses_put_the_block_in_a_reasoning_item(live):
    """/v1/responses: a reasoning item with the block's text, whole and from the stream's events."""
    c = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEYS["acme"], max_retries=0, timeout=120)
    inline = ask(live, extra_body={"ignore_eos": True, "separate_reasoning": False}).choices[0].message.content
    kw = dict(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    r = c.responses.create(**kw)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == inline
    with c.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert events[-1].type == "response.incomplete"         # max_output_tokens cut the block
    final = events[-1].response
    assert deltas == inline and final.output[0].content[0].text == inline
    assert final.incomplete_details.reason == "max_output_tokens"
