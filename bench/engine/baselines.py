"""Hugging Face baselines for the offline benchmark: static batching and HF's continuous batching.

Both take the same `Request` list as the engine and return a plain result dict:
`wall_s`, `output_tokens` (useful tokens: each request's own length), `generated_tokens`
(everything the system computed), `outputs` ({request_id: token ids}) and `notes`.
Model loading and warm-up happen before the clock starts, as for the engine.
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from bench.workload import Request


def load_hf_model(model_dir: str, dtype: str = "float32"):
    """The model on CPU in `dtype` ("auto": what the engine picks on this CPU), eval mode,
    default (SDPA) attention."""
    from engine.dtypes import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(dtype, torch.device("cpu")))
    return model.eval()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _greedy_config(model, max_new_tokens: int) -> GenerationConfig:
    """Greedy decoding that never stops early on EOS."""
    pad = model.config.pad_token_id
    pad = model.config.eos_token_id if pad is None else pad
    return GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=pad, eos_token_id=model.config.eos_token_id,
    )


def _left_pad(batch: list[Request], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a left-padded batch."""
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        n = len(r.prompt_ids)
        ids[row, width - n:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[row, width - n:] = 1
    return ids, mask


@torch.inference_mode()
def run_hf_static(model, requests: list[Request], batch_size: int = 8) -> dict:
    """`model.generate` on fixed batches in arrival order, left-padded, each run to its longest output.

    Every row of a batch decodes for the batch's longest output; a request counts only its
    own length as useful. `kv_slot_waste` is the share of KV slots at the end of each batch
    (padded prompt + longest output, per row) holding padding or tokens past the row's length.
    """
    pad_id = _greedy_config(model, 1).pad_token_id
    warm_ids, warm_mask = _left_pad(requests[:2], pad_id)
    model.generate(input_ids=warm_ids[:, -8:], attention_mask=warm_mask[:, -8:],
                   generation_config=_greedy_config(model, 2))
    outputs, generated, slots, useful_slots = {}, 0, 0, 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        ids, mask = _left_pad(batch, pad_id)
        new = max(r.max_tokens for r in batch)
        seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=_greedy_config(model, new))
        for row, r in enumerate(batch):
            outputs[r.request_id] = seqs[row, ids.shape[1]:ids.shape[1] + r.max_tokens].tolist()
            useful_slots += len(r.prompt_ids) + r.max_tokens
        generated += len(batch) * new
        slots += len(batch) * (ids.shape[1] + new)
        _progress(f"hf-static: {i + len(batch)}/{len(requests)} requests, {time.perf_counter() - start:.0f} s")
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "output_tokens": sum(len(v) for v in outputs.values()),
        "generated_tokens": generated,
        "kv_slot_waste": 1 - useful_slots / slots,
        "outputs": outputs,
        "notes": [f"batches of {batch_size} in arrival order, left-padded, each to its longest output"],
    }


def cb_config(kv_tokens: int, page_size: int, max_batch_tokens: int, max_seqs: int) -> ContinuousBatchingConfig:
    """An explicit cache for HF's continuous batching holding `kv_tokens` tokens of KV.

    Sizing it ourselves keeps HF from sizing the cache from system memory, and gives it the
    same KV budget as the engine.
    """
    return ContinuousBatchingConfig(
        page_size=page_size, num_blocks=kv_tokens // page_size, max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs, allow_block_sharing=False, seed=0,
    )


@torch.inference_mode()
def run_hf_cb(model, requests: list[Request], kv_tokens: int, page_size: int = 256, max_batch_tokens: int = 512,
              max_seqs: int = 64) -> dict:
    """HF's continuous batching (the manager behind `model.generate_batch`), one length per request.

    `generate_batch(inputs, generation_config, continuous_batching_config)` takes a single
    `max_new_tokens` for all prompts; its manager's `add_request(input_ids, request_id,
    max_new_tokens, eos_token_id)` takes one per request, so we drive that manager directly
    (same scheduler, cache and model path) and give `eos_token_id=-1` to ignore EOS.
    """
    cfg = cb_config(kv_tokens, page_size, max_batch_tokens, max_seqs)
    gen = _greedy_config(model, max(r.max_tokens for r in requests))
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in requests),
                          max_generated_length=gen.max_new_tokens, num_requests=len(requests))
    outputs, errors = {}, []
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cfg, block=True, timeout=30, workload_hints=hints,
    ) as manager:
        start = time.perf_counter()
        for r in requests:
            manager.add_request(list(r.prompt_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                eos_token_id=-1)
        while len(outputs) < len(requests):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(f"generation thread stopped with {len(outputs)}/{len(requests)} done")
                continue
            if result.is_finished():
                outputs[result.request_id] = list(result.generated_tokens)
                if len(outputs) % 8 == 0:
                    _progress(f"hf-cb: {len(outputs)}/{len(requests)} requests, {time.perf_counter() - start:.0f} s")
                if result.error is not None:
                    errors.append(f"{result.request_id}: {result.error}")
        wall = time.perf_counter() - start
        attn = model.config._attn_implementation
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    n = sum(len(v) for v in outputs.values())
    return {
        "wall_s": wall,
        "output_tokens": n,
        "generated_tokens": n,
        "cache": {"page_size": page_size, "num_blocks": cfg.num_blocks, "max_batch_tokens": max_batch_tokens,
                  "max_requests_per_batch": max_seqs, "attn_implementation": attn},
        "outputs": outputs,
        "notes": [f"per-request lengths via the generate_batch manager; cache {cfg.num_blocks} x {page_size}-token "
                  f"pages, {max_batch_tokens} batch tokens, {attn} attention"],
    }
