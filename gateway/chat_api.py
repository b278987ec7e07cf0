"""OpenAI's chat completion bodies from pipeline events: the SSE chunks (`chat_chunks`) and
the whole answer (`chat_body`), with `n` choices, logprobs, reasoning and tool calls."""

from __future__ import annotations

import json

from .chat_format import ChoiceFormat, chat_logprobs, delta_dict, event_json, token_text
from .prompts import chat_template
from .streaming import Delta, Done
from .harmony import is_harmony_template
from .tool_parsers import parser_for_template


class Last(str):
    """A stream's last payload (`[DONE]`, or the error event that ends it)."""


def choice_reason(done: Done, i: int) -> str:
    """Choice i's finish reason (the request's when the engine gave none per choice)."""
    return done.finish_reasons[i] if i < len(done.finish_reasons) else done.finish_reason


def stream_end(head: dict, event, finished: list[bool], finish, usage_on: bool) -> list[str]:
    """The SSE payloads that end a chat or completions stream at its terminal event: each
    unfinished choice's `finish(i, reason)` chunk, the usage chunk when asked, `[DONE]`; or,
    for a failure, the error event (terminal: no `[DONE]` after it)."""
    if not isinstance(event, Done):
        return [Last(json.dumps(event.error.body()))]
    out = [finish(i, choice_reason(event, i)) for i in range(len(finished)) if not finished[i]]
    if usage_on:
        out.append(json.dumps({**head, "choices": [], "usage": event.usage.as_dict(),
                               "timings": event.timings}))          # a streamgate extension
    return out + [Last("[DONE]")]


def tool_parser(gw) -> str:
    """`--tool-parser`, else the parser the model's chat template calls for (harmony for
    gpt-oss's template, which writes `<|channel|>` headers)."""
    chosen = getattr(gw.settings, "tool_parser", None)
    if chosen:
        return chosen
    template = chat_template(gw.engine.tokenizer)
    return "harmony" if is_harmony_template(template) else parser_for_template(template)


def choice_parser(gw, req) -> str | None:
    """The output parser of a request's choices: the tool parser when tools are on, and
    harmony always (its channels carry the reasoning and the answer too)."""
    parser = tool_parser(gw)
    return parser if parser == "harmony" or req.tools_on else None


def _formats(gw, adm) -> list[ChoiceFormat]:
    parser = choice_parser(gw, adm.request)
    return [ChoiceFormat(adm, parser) for _ in range(adm.request.n)]


def chat_body(gw, adm, deltas: list[Delta], done: Done) -> dict:
    formats = _formats(gw, adm)
    tt = token_text(gw) if adm.request.logprobs else None
    for d in deltas:
        formats[d.index].feed(d.text)
        if tt is not None:
            formats[d.index].logprobs += chat_logprobs(tt, d.logprobs)
    result = []
    for i, f in enumerate(formats):
        f.finish()
        reason = choice_reason(done, i)
        result.append({"index": i, "message": f.message(),
                       "logprobs": {"content": f.logprobs, "refusal": None} if tt is not None else None,
                       "finish_reason": f.finish_reason(reason)})
    return {"id": adm.request_id, "object": "chat.completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None, "choices": result, "usage": done.usage.as_dict()}


async def chat_chunks(gw, adm, first, events):
    """SSE `data:` payloads: a role chunk per choice, content/reasoning/tool-call chunks, each
    choice's finish chunk, the usage chunk (if asked), `[DONE]`; or an error event, which is
    terminal (no `[DONE]` after it)."""
    req = adm.request
    usage_on = req.include_usage
    formats = _formats(gw, adm)
    tt = token_text(gw) if req.logprobs else None
    finished = [False] * req.n
    head = {"id": adm.request_id, "object": "chat.completion.chunk", "created": adm.created,
            "model": adm.model, "system_fingerprint": None}

    def chunk(index: int, delta: dict, finish: str | None = None, num_tokens: int | None = None,
              logprobs: list | None = None) -> str:
        lp = {"content": logprobs, "refusal": None} if logprobs is not None else None
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]}
        if usage_on:
            body["usage"] = None
        if num_tokens is not None:
            body["num_tokens"] = num_tokens      # a streamgate extension: tokens in this delta
        return event_json(body)

    def finish(i: int, reason: str):
        finished[i] = True
        delta = delta_dict(formats[i].finish())
        return chunk(i, delta, formats[i].finish_reason(reason))

    try:
        for i in range(req.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        event = first
        while True:
            if isinstance(event, Delta):
                i = event.index
                delta = delta_dict(formats[i].feed(event.text))
                lps = chat_logprobs(tt, event.logprobs) if tt is not None else None
                if delta or lps or event.num_tokens:
                    yield chunk(i, delta, num_tokens=event.num_tokens, logprobs=lps)
                if event.finish_reason is not None:
                    yield finish(i, event.finish_reason)
            else:
                for payload in stream_end(head, event, finished, finish, usage_on):
                    yield payload
                return
            event = await anext(events)
    finally:
        await events.aclose()
