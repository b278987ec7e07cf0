"""Prompts for tool requests with a real tokenizer: a template that takes `tools=` gets them
(and the history's tool calls as objects); one that knows no tools gets a Hermes system
message and `<tool_call>` text; forced tool choices and response formats become grammars."""

from __future__ import annotations

import json
import sys

import pytest
from transformers import AutoTokenizer

from gateway.errors import BadRequest
from gateway.schemas import parse_chat_request
from gateway.tools import MAX_SCHEMA_DEPTH, closed, output_grammar, template_inputs

TOOL = {"type": "function", "function": {"name": "lookup", "description": "find a word",
                                         "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
HISTORY = [{"role": "user", "content": "define cat"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "cat"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "a small feline"}]
TOOLS_TEMPLATE = ("{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}{% for m in messages %}[{{ m.role }}]"
                  "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
                  "{{ c.function.arguments.q }}{% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def render(tokenizer, body: dict, template: str | None) -> str:
    messages, kw = template_inputs(parse_chat_request(body), template)
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                         tokenize=False, **kw)


def test_a_template_with_tools_gets_them_and_call_arguments_as_objects(tokenizer):
    """tools= reaches the template; the history's arguments are a dict the template can index."""
    text = render(tokenizer, {"messages": HISTORY, "tools": [TOOL]}, TOOLS_TEMPLATE)
    assert text.startswith("TOOLS=") and '"lookup"' in text
    assert "CALL lookup cat" in text and "[tool]a small feline" in text


def test_a_template_without_tools_gets_a_hermes_system_message(tokenizer):
    """SmolLM2's template knows no tools: they arrive in a system message, calls as <tool_call> text."""
    text = render(tokenizer, {"messages": HISTORY, "tools": [TOOL]}, tokenizer.chat_template)
    assert "<tools>" in text and '"name": "lookup"' in text
    assert '<tool_call>\n{"name": "lookup", "arguments": {"q": "cat"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\na small feline\n</tool_response>" in text
    plain = render(tokenizer, {"messages": HISTORY, "tools": [TOOL], "tool_choice": "none"}, tokenizer.chat_template)
    assert "<tools>" not in plain and "<tool_call>" in plain


def test_forced_choices_and_formats_become_grammars():
    """required: an array of calls; named: that function's (closed) parameters; json_schema: the schema."""
    g, field = output_grammar(parse_chat_request({"messages": HISTORY, "tools": [TOOL], "tool_choice": "required",
                                                  "parallel_tool_calls": False}))
    schema = json.loads(g.spec)
    assert field == "tools" and schema["type"] == "array" and schema["maxItems"] == 1
    assert schema["items"]["properties"]["name"] == {"const": "lookup"}
    g, _ = output_grammar(parse_chat_request({"messages": HISTORY, "tools": [TOOL],
                                              "tool_choice": {"type": "function", "function": {"name": "lookup"}}}))
    assert json.loads(g.spec) == {**TOOL["function"]["parameters"], "additionalProperties": False}
    g, field = output_grammar(parse_chat_request({"messages": HISTORY, "response_format": {"type": "json_object"}}))
    assert (g.kind, field) == ("json_object", "response_format")
    assert output_grammar(parse_chat_request({"messages": HISTORY}))[0] is None


def test_closed_leaves_free_form_objects_and_explicit_choices_alone():
    """Only objects that list properties without saying anything of others are closed."""
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "array", "items": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}, "$defs": {"D": {"properties": {}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and "additionalProperties" not in out["properties"]["a"]
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert out["$defs"]["D"]["additionalProperties"] is False
    assert closed({"properties": {}, "additionalProperties": True})["additionalProperties"] is True


def test_a_schema_nested_too_deep_is_a_400_naming_the_field():
    """A schema nested deeper than Python recurses is refused naming response_format, not a 500."""
    schema: dict = {"type": "object", "properties": {}}
    for _ in range(900):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"messages": HISTORY[:1], "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "deep", "schema": schema}}}
    with pytest.raises(BadRequest) as exc:
        output_grammar(parse_chat_request(body))
    assert exc.value.param == "response_format"


def test_schema_depth_limit_does_not_depend_on_the_recursion_limit():
    """The refusal comes at MAX_SCHEMA_DEPTH, also where something (inductor) raised the
    interpreter's recursion limit far above it; a schema within it is closed as usual."""
    def nested(levels: int) -> dict:
        schema: dict = {"type": "object", "properties": {}}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(RecursionError, match=str(MAX_SCHEMA_DEPTH)):
            closed(nested(MAX_SCHEMA_DEPTH + 1))
    finally:
        sys.setrecursionlimit(limit)
    inner = closed(nested(MAX_SCHEMA_DEPTH // 2 - 1))
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        assert inner["additionalProperties"] is False
        inner = inner["properties"]["a"]
