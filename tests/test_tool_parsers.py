"""Tool-call parsers and the reasoning splitter on text, fed whole and in every split: the
same calls and content come out however the stream is cut."""

from __future__ import annotations

import json

import pytest

from gateway.reasoning import ReasoningSplitter
from gateway.tool_parsers import ToolCallDelta, ToolCallParser, parser_for_template


def run(kind: str, pieces: list[str], name: str | None = None) -> tuple[str, list[dict]]:
    """Feed `pieces`; return the content and the calls as reassembled from the deltas."""
    p = ToolCallParser(kind, name)
    items = [item for piece in pieces for item in p.feed(piece)] + p.finish()
    content, calls = "", {}
    for item in items:
        if isinstance(item, str):
            content += item
            continue
        assert isinstance(item, ToolCallDelta)
        if item.index not in calls:
            assert item.id and item.name, "a call's first delta carries its id and name"
            calls[item.index] = {"id": item.id, "name": item.name, "arguments": ""}
        else:
            assert item.id is None and item.name is None
        calls[item.index]["arguments"] += item.arguments
    return content, [calls[i] for i in sorted(calls)]


def splits(text: str):
    """The text whole, one character at a time, and cut at every position."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


HERMES = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"note": "a </tool_call> inside"}}\n</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1}}'
          '</tool_call>')


@pytest.mark.parametrize("pieces", list(splits(HERMES)))
def test_hermes_calls_however_the_stream_is_cut(pieces):
    """Two Hermes calls, content before them; a literal </tool_call> in a string does not end the call."""
    content, calls = run("hermes", pieces)
    assert content == "Let me check."
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "note": "a </tool_call> inside"}
    assert json.loads(calls[1]["arguments"]) == {"a": 1}
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_plain_text_passes_through_and_a_partial_marker_is_held_then_released():
    """Text without calls is content; a '<tool' that never completes comes back at the end."""
    assert run("hermes", ["Hello <b>world</b>"]) == ("Hello <b>world</b>", [])
    p = ToolCallParser("hermes")
    assert p.feed("Hi <tool") == ["Hi "]
    assert p.finish() == ["<tool"]


def test_text_held_after_the_calls_comes_back_at_the_end():
    """A '<' after a call (maybe another marker) that never becomes one is content when the answer ends."""
    content, calls = run("hermes", ['<tool_call>{"name": "f", "arguments": {}}</tool_call> <'])
    assert [c["name"] for c in calls] == ["f"] and content == "<"


def test_hermes_object_with_other_key_order_and_non_call_json():
    """Arguments before the name are parsed when the object closes; an object that is no call is content."""
    _, calls = run("hermes", ['<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>'])
    assert calls[0]["name"] == "f" and json.loads(calls[0]["arguments"]) == {"x": [1, 2]}
    content, calls = run("hermes", ['<tool_call>{"foo": 1}</tool_call> ok'])
    assert calls == [] and '{"foo": 1}' in content


LLAMA = '{"name": "search", "parameters": {"q": "a;b"}}; {"name": "open", "parameters": {"id": 3}}'


@pytest.mark.parametrize("pieces", list(splits(LLAMA))[:40])
def test_llama3_json_calls(pieces):
    """Llama 3 JSON calls (parameters key, ';' between) at the start of the answer."""
    content, calls = run("llama3_json", pieces)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("search", {"q": "a;b"}), ("open", {"id": 3})]


def test_llama3_json_text_answer_and_python_tag():
    """Prose stays content; <|python_tag|> introduces a call."""
    assert run("llama3_json", ["The answer is {not a call}"]) == ("The answer is {not a call}", [])
    _, calls = run("llama3_json", ['<|python_tag|>{"name": "f", "parameters": {}}'])
    assert calls[0]["name"] == "f" and calls[0]["arguments"] == "{}"


MISTRAL = '[TOOL_CALLS][{"name": "a", "arguments": {"s": "]}"}}, {"name": "b", "arguments": {}}]'


@pytest.mark.parametrize("pieces", list(splits(MISTRAL))[:60])
def test_mistral_calls(pieces):
    """Mistral's [TOOL_CALLS] list, brackets inside strings ignored."""
    content, calls = run("mistral", pieces)
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"s": "]}"}), ("b", {})]


def test_mistral_name_args_form():
    """The newer [TOOL_CALLS]name[ARGS]{...} form."""
    _, calls = run("mistral", ["[TOOL_CALLS]get", "_time[AR", 'GS]{"tz": "UTC"}'])
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", '{"tz": "UTC"}')]


FORCED = '[{"name":"f","arguments":{"a":"x}"}},{"name":"g","arguments":{}}]'


@pytest.mark.parametrize("pieces", list(splits(FORCED)))
def test_forced_required_array(pieces):
    """The grammar-forced array of calls (tool_choice required), compact JSON."""
    content, calls = run("required", pieces)
    assert content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("f", '{"a":"x}"}'), ("g", "{}")]


def test_forced_named_streams_arguments_from_the_first_token():
    """A named tool_choice: the whole answer is the arguments; id and name come with the first delta."""
    p = ToolCallParser("named", "lookup")
    first = p.feed('{"k"')
    assert first[0].name == "lookup" and first[0].id and first[0].arguments == '{"k"'
    rest = p.feed(':"v"}') + p.finish()
    assert "".join(d.arguments for d in first + rest) == '{"k":"v"}'


def test_parser_chosen_from_the_template():
    """The template's own format picks the parser; hermes otherwise."""
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("<|python_tag|> ipython") == "llama3_json"
    assert parser_for_template("<tool_call>") == "hermes"
    assert parser_for_template(None) == "hermes"


THINK = "<think>\nstep 1, step 2\n</think>\n\nThe answer."


@pytest.mark.parametrize("pieces", list(splits(THINK)))
def test_reasoning_split_however_cut(pieces):
    """A leading <think> block is reasoning, the rest content, however the stream is cut."""
    s = ReasoningSplitter()
    parts = [s.feed(p) for p in pieces] + [s.finish()]
    assert "".join(r for r, _ in parts) == "\nstep 1, step 2\n"
    assert "".join(c for _, c in parts) == "The answer."


def test_reasoning_opened_by_the_template_and_text_without_think():
    """A prompt that opened <think> starts in reasoning; an answer not starting with <think> is content."""
    s = ReasoningSplitter(in_reasoning=True)
    assert s.feed("plan</think>done") == ("plan", "done")
    s = ReasoningSplitter()
    assert s.feed("Hello <think>x</think>") == ("", "Hello <think>x</think>")
    s = ReasoningSplitter()
    assert s.feed("<thi") == ("", "") and s.finish() == ("", "<thi")
