"""From a parsed request to its prompt: the chat template (with tools, gateway/tools.py) for
chat, the text or token ids for completions, fill-in-the-middle where the vocabulary has
the tokens for it. Runs the template on the tokenizer threads (admission.Tokenizers)."""

from __future__ import annotations

from .errors import BadRequest
from .tools import template_inputs

# (prefix, suffix, middle) tokens of the fill-in-the-middle formats served families use
FIM_FORMATS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),      # Qwen2.5-Coder
               ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),            # StarCoder, SmolLM
               ("<PRE>", "<SUF>", "<MID>"))                                 # Code Llama


def fim_format(tokenizer) -> tuple[str, str, str] | None:
    """The FIM tokens this vocabulary has, or None (a `suffix` is then refused)."""
    vocab = tokenizer.get_vocab()
    return next((f for f in FIM_FORMATS if all(t in vocab for t in f)), None)


def chat_template(tokenizer) -> str | None:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        t = t.get("tool_use") or t.get("default")
    return t if isinstance(t, str) else None


async def render_prompt(tok, tenant: str, req) -> tuple[str | None, list[int] | None]:
    """(text to tokenize, None) or (None, token ids given by the client)."""
    prompt = getattr(req, "prompt", None)
    if prompt is None:
        messages, kw = template_inputs(req, tok.template)
        try:
            return await tok.run(tenant, tok.render, messages, kw), None
        except Exception as exc:        # a template that refuses the conversation (e.g. role order)
            raise BadRequest(f"messages: the model's chat template rejected them: {exc}",
                             param="messages") from None
    if isinstance(prompt, list):
        return None, prompt
    if req.suffix is None:
        return prompt, None
    if tok.fim is None:
        raise BadRequest("suffix: this model's vocabulary has no fill-in-the-middle tokens; send the "
                         "prompt without suffix", param="suffix")
    pre, suf, mid = tok.fim
    return f"{pre}{prompt}{suf}{req.suffix}{mid}", None


def starts_in_reasoning(text: str | None) -> bool:
    """The template opened a `<think>` block for the answer (DeepSeek-R1, Qwen3 thinking)."""
    return bool(text) and text.rstrip().endswith("<think>")
