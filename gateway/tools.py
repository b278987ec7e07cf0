"""What a request's tools and output format ask of the prompt and of the sampler.

- `template_inputs`: the messages and `tools=` handed to the model's own chat template
  (`apply_chat_template`). A template that knows no tools (it never mentions them) gets
  them described in a system message in the Hermes format instead, and earlier tool calls
  as `<tool_call>` text, so the model still sees them and the `hermes` parser reads its
  answer.
- `output_grammar`: the engine.Grammar that `response_format` (json_object, json_schema)
  or a required / named `tool_choice` calls for. A forced call's grammar is the JSON schema
  of the call itself (as vLLM does), so its arguments always parse and validate.
- `sampling_params`: the SamplingParams of a chat or completions request.
"""

from __future__ import annotations

import json

from engine import Grammar, SamplingParams

from .errors import BadRequest

HERMES_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools>{tools}</tools>\nFor each function call return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def template_inputs(req, template: str | None) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments for apply_chat_template) for a ChatRequest."""
    messages = [m.for_template() for m in req.messages]
    knows = template_knows_tools(template)
    if not knows:
        messages = _plain_history(messages)
    if not req.tools_on:
        return messages, {}
    tools = [t.function.as_tool() for t in req.tools]
    if knows:
        return messages, {"tools": tools}
    preamble = HERMES_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}
    else:
        messages.insert(0, {"role": "system", "content": preamble})
    return messages, {}


def _plain_history(messages: list[dict]) -> list[dict]:
    """For a template without tools: calls as Hermes `<tool_call>` text, tool results as a
    user turn of `<tool_response>` blocks (consecutive ones joined), as Qwen2.5's template
    writes them, so templates that know only system/user/assistant accept the history."""
    out: list[dict] = []
    for m in messages:
        if m["role"] != "tool":
            out.append(_plain(m))
            continue
        block = f"<tool_response>\n{m['content']}\n</tool_response>"
        if out and out[-1].get("tool_results"):
            out[-1]["content"] += "\n" + block
        else:
            out.append({"role": "user", "content": block, "tool_results": True})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def _plain(m: dict) -> dict:
    """A message with its tool calls written out as Hermes text (for templates without tools)."""
    if not m.get("tool_calls"):
        return {k: v for k, v in m.items() if k in ("role", "content")}
    calls = "".join("<tool_call>\n" + json.dumps({"name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                    + "\n</tool_call>" for c in m["tool_calls"])
    return {"role": m["role"], "content": (m["content"] + "\n" if m["content"] else "") + calls}


def call_schema(fn) -> dict:
    return closed(fn.parameters or {"type": "object", "properties": {}})


MAX_SCHEMA_DEPTH = 64       # nested subschemas a tool's or response_format's JSON schema may have


def closed(schema, depth: int = 0):
    """`schema` with every object that lists its properties and says nothing of others closed
    (`additionalProperties: false`), as OpenAI's strict mode requires them written: without
    it the grammar lets a model add keys of its own, and a weak one never stops adding.
    Deeper than MAX_SCHEMA_DEPTH it raises RecursionError (output_grammar's 400) at a depth
    that does not depend on the interpreter's recursion limit (inductor raises it to 2,000)."""
    if depth > MAX_SCHEMA_DEPTH:
        raise RecursionError(f"a JSON schema nested deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(schema, list):
        return [closed(s, depth + 1) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v, depth + 1) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(k), dict):
            out[k] = {name: closed(sub, depth + 1) for name, sub in out[k].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "additionalProperties", "contains")


def output_grammar(req) -> tuple[Grammar | None, str | None]:
    """(grammar, the body field it comes from) for a ChatRequest."""
    try:
        return _output_grammar(req)
    except RecursionError:          # a schema nested deeper than Python recurses (the body allowed it)
        field = "tools" if req.forced_tool else "response_format"
        raise BadRequest(f"{field}: the JSON schema is nested too deeply", param=field) from None


def _output_grammar(req) -> tuple[Grammar | None, str | None]:
    forced = req.forced_tool
    if forced == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": call_schema(t.function)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in req.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not req.parallel_tool_calls:
            schema["maxItems"] = 1
        return Grammar("json_schema", json.dumps(schema)), "tools"
    if forced is not None:
        fn = next(t.function for t in req.tools if t.function.name == forced)
        return Grammar("json_schema", json.dumps(call_schema(fn))), "tools"
    return format_grammar(req.response_format), "response_format"


def format_grammar(fmt) -> Grammar | None:
    """A `response_format` (chat) or `text.format` (responses) as a Grammar."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Grammar("json_object", "")
    return Grammar("json_schema", json.dumps(closed(fmt.json_schema.schema_)))


def sampling_params(req, max_tokens: int, grammar: Grammar | None, logprobs: int | None,
                    skip_special_tokens: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          seed=req.seed, stop=tuple(req.stop or ()), ignore_eos=req.ignore_eos,
                          skip_special_tokens=skip_special_tokens,
                          prompt_logprobs=getattr(req, "num_prompt_logprobs", None),
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias_pairs,
                          min_p=req.min_p, logprobs=logprobs, grammar=grammar)


_FIELDS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logprobs",
           "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "prompt_token_ids")


def engine_refusal(exc: ValueError, grammar_field: str | None) -> BadRequest:
    """The engine's ValueError as a 400 naming the body field it concerns."""
    message = str(exc)
    if message.startswith("grammar:"):
        field = grammar_field or "response_format"
        return BadRequest(f"{field}: {message}", param=field)
    field = next((f for f in _FIELDS if message.startswith(f)), None)
    if field == "prompt_token_ids":
        field = "prompt"
    return BadRequest(message, param=field)
