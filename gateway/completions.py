"""`POST /v1/completions`: a prompt as text or token ids (schemas.CompletionRequest), `echo`,
`logprobs` in the legacy format, `suffix` where the vocabulary has fill-in-the-middle tokens,
`n` — through the same admission, quotas, deadlines and billing as chat (sse.serve_openai)."""

from __future__ import annotations

import json

from starlette.requests import Request
from starlette.responses import Response

from .chat_api import Last
from .chat_format import token_text
from .sse import serve_openai
from .streaming import Delta, Done


class _Offsets:
    """Legacy logprobs of one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tt, start: int):
        self.tt, self.offset = tt, start

    def block(self, lps) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps or ():
            text, _ = self.tt(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.tt(t)[0]: v for t, v in lp.top} if lp.top else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _echo_text(gw, adm) -> str:
    if not adm.request.echo:
        return ""
    if adm.prompt_text is not None:
        return adm.prompt_text
    return gw.engine.tokenizer.decode(adm.prompt_ids)


def completion_body(gw, adm, deltas: list[Delta], done: Done) -> dict:
    req = adm.request
    echo = _echo_text(gw, adm)
    texts = [[echo] for _ in range(req.n)]
    lps = [[] for _ in range(req.n)]
    for d in deltas:
        texts[d.index].append(d.text)
        lps[d.index] += d.logprobs or []
    choices = []
    for i in range(req.n):
        logprobs = _Offsets(token_text(gw), len(echo)).block(lps[i]) if req.logprobs is not None else None
        reason = done.finish_reasons[i] if i < len(done.finish_reasons) else done.finish_reason
        choices.append({"index": i, "text": "".join(texts[i]), "logprobs": logprobs, "finish_reason": reason})
    return {"id": adm.request_id, "object": "text_completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None, "choices": choices, "usage": done.usage.as_dict()}


async def completion_chunks(gw, adm, first, events):
    req = adm.request
    head = {"id": adm.request_id, "object": "text_completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None}
    echo = _echo_text(gw, adm)
    offsets = [_Offsets(token_text(gw), len(echo)) for _ in range(req.n)] if req.logprobs is not None else None
    finished = [False] * req.n

    def chunk(i: int, text: str, finish: str | None = None, lps=None, num_tokens: int | None = None) -> str:
        logprobs = offsets[i].block(lps) if offsets is not None and lps is not None else None
        body = {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if req.include_usage:
            body["usage"] = None
        if num_tokens is not None:
            body["num_tokens"] = num_tokens
        return json.dumps(body, ensure_ascii=False)

    try:
        if echo:
            for i in range(req.n):
                yield chunk(i, echo)
        event = first
        while True:
            if isinstance(event, Delta):
                if event.text or event.num_tokens:
                    yield chunk(event.index, event.text, lps=event.logprobs or [], num_tokens=event.num_tokens)
                if event.finish_reason is not None:
                    finished[event.index] = True
                    yield chunk(event.index, "", event.finish_reason)
            elif isinstance(event, Done):
                for i in range(req.n):
                    if not finished[i]:
                        yield chunk(i, "", event.finish_reasons[i] if i < len(event.finish_reasons)
                                    else event.finish_reason)
                if req.include_usage:
                    yield json.dumps({**head, "choices": [], "usage": event.usage.as_dict(),
                                      "timings": event.timings})
                yield Last("[DONE]")
                return
            else:
                yield Last(json.dumps(event.error.body()))
                return
            event = await anext(events)
    finally:
        await events.aclose()


async def completions(request: Request) -> Response:
    return await serve_openai(request, "completion", completion_chunks, completion_body)
