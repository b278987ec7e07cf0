"""Deterministic offline workloads: prompts of ordinary English tokens, fixed output lengths.

Every request decodes greedily for exactly its own output length (EOS ignored), so every
system under test produces the same number of useful tokens and throughput is comparable.
Prompts are random word sequences: they tokenize like real text, and no two prompts share
a leading block, so prefix caching cannot make one system look better than the others.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look "
    "think also around another came come work three word must because does part even place "
    "well such here take why things help put years different away again off went old number "
    "great tell men say small every found still between name should home big give air line "
    "set own under read last never us left end along while might next sound below saw "
    "something thought both few those always looked show large often together asked house "
    "world going want school important until form food keep children feet land side without "
    "boy once animals life enough took sometimes four head above kind began almost live page "
    "got earth need far hand high year mother light parts country father let night following "
    "picture being study second eyes soon times story boys since white days ever paper hard "
    "near sentence better best across during today others however sure means knew try told "
    "young miles sun ways thing whole hear example heard several change answer room sea "
    "against top turned learn point city play toward five using himself usually"
).split()


@dataclass(frozen=True)
class Request:
    """One benchmark request: its id, prompt token ids and exact number of tokens to generate."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int


def _text(rng: random.Random, num_words: int) -> str:
    """Random English-looking sentences of about `num_words` words."""
    sentences, left = [], num_words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        words = rng.choices(_WORDS, k=n)
        sentences.append(" ".join(words).capitalize() + rng.choice((".", ".", ".", "?", "!")))
        left -= n
    return " ".join(sentences)


def make_workload(
    tokenizer,
    num_requests: int = 64,
    seed: int = 0,
    min_prompt: int = 16,
    max_prompt: int = 1024,
    min_output: int = 16,
    max_output: int = 256,
) -> list[Request]:
    """Build `num_requests` requests with prompt and output lengths drawn uniformly.

    Prompt lengths are uniform in [min_prompt, max_prompt] tokens and output lengths uniform
    in [min_output, max_output]; the same arguments always give the same requests.
    """
    if not (1 <= min_prompt <= max_prompt and 1 <= min_output <= max_output):
        raise ValueError("need 1 <= min <= max for prompt and output lengths")
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len = rng.randint(min_prompt, max_prompt)
        out_len = rng.randint(min_output, max_output)
        # English words average well under two tokens each, so this text is always long enough.
        ids = tokenizer(_text(rng, prompt_len), add_special_tokens=False)["input_ids"]
        if len(ids) < prompt_len:
            raise RuntimeError(f"prompt text too short: {len(ids)} < {prompt_len} tokens")
        requests.append(Request(f"r{i}", tuple(ids[:prompt_len]), out_len))
    return requests


def summarize(requests: list[Request]) -> dict:
    """Totals describing a workload, for reports."""
    prompts = [len(r.prompt_ids) for r in requests]
    outputs = [r.max_tokens for r in requests]
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(prompts),
        "output_tokens": sum(outputs),
        "prompt_len_range": [min(prompts), max(prompts)] if prompts else [0, 0],
        "output_len_range": [min(outputs), max(outputs)] if outputs else [0, 0],
    }
