"""`POST /v1/completions`: a prompt as text or token ids (schemas.CompletionRequest), `echo`,
`logprobs` in the legacy format, `suffix` where the vocabulary has fill-in-the-middle tokens,
`n` — through the same admission, quotas, deadlines and billing as chat (sse.serve_openai).

With `echo` and `logprobs` the echoed prompt carries its own logprobs (the engine's prompt
logprobs; the first token's is null, as OpenAI reports it), followed by the generated
tokens'; `max_tokens: 0` with `echo` scores the prompt and generates nothing (what lm-eval's
`local-completions` sends for loglikelihood tasks)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from .chat_api import choice_reason, stream_end
from .chat_format import event_json, token_text
from .sse import serve_openai
from .streaming import Delta, Done


class _Offsets:
    """Legacy logprobs of one choice: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, tt, start: int):
        self.tt, self.offset = tt, start

    def block(self, lps, token_ids=None) -> dict:
        """`lps`: engine TokenLogprobs; with `token_ids` (the prompt), one entry per id, and a
        None in `lps` (the prompt's first token) gives null logprobs."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, lp in zip(token_ids, lps) if token_ids is not None else ((lp.token_id, lp) for lp in lps or ()):
            text, _ = self.tt(tid)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append({self.tt(t)[0]: v for t, v in lp.top} if lp is not None and lp.top else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _prompt_block(gw, adm) -> dict | None:
    """The echoed prompt's logprobs, when the request asked for echo and logprobs."""
    if not adm.request.echo or adm.request.logprobs is None or adm.prompt_logprobs is None:
        return None
    return _Offsets(token_text(gw), 0).block(adm.prompt_logprobs, adm.prompt_ids)


def _joined(a: dict | None, b: dict | None) -> dict | None:
    return b if a is None else a if b is None else {k: a[k] + b[k] for k in a}


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
    prompt = _prompt_block(gw, adm)
    for i in range(req.n):
        logprobs = _Offsets(token_text(gw), len(echo)).block(lps[i]) if req.logprobs is not None else None
        logprobs = _joined(prompt, logprobs)
        choices.append({"index": i, "text": "".join(texts[i]), "logprobs": logprobs,
                        "finish_reason": choice_reason(done, i)})
    return {"id": adm.request_id, "object": "text_completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None, "choices": choices, "usage": done.usage.as_dict()}


async def completion_chunks(gw, adm, first, events):
    req = adm.request
    head = {"id": adm.request_id, "object": "text_completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None}
    echo = _echo_text(gw, adm)
    offsets = [_Offsets(token_text(gw), len(echo)) for _ in range(req.n)] if req.logprobs is not None else None
    finished = [False] * req.n

    def chunk(i: int, text: str, finish: str | None = None, lps=None, num_tokens: int | None = None,
              logprobs: dict | None = None) -> str:
        if offsets is not None and lps is not None:
            logprobs = offsets[i].block(lps)
        body = {**head, "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if req.include_usage:
            body["usage"] = None
        if num_tokens is not None:
            body["num_tokens"] = num_tokens
        return event_json(body)

    try:
        if echo:
            prompt = _prompt_block(gw, adm)             # the first event came: the prompt is scored
            for i in range(req.n):
                yield chunk(i, echo, logprobs=prompt)
        event = first
        while True:
            if isinstance(event, Delta):
                if event.text or event.num_tokens:
                    yield chunk(event.index, event.text, lps=event.logprobs or [], num_tokens=event.num_tokens)
                if event.finish_reason is not None:
                    finished[event.index] = True
                    yield chunk(event.index, "", event.finish_reason)
            else:
                for payload in stream_end(head, event, finished, lambda i, reason: chunk(i, "", reason),
                                          req.include_usage):
                    yield payload
                return
            event = await anext(events)
    finally:
        await events.aclose()


async def completions(request: Request) -> Response:
    return await serve_openai(request, "completion", completion_chunks, completion_body)
