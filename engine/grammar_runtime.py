"""Constrained decoding at run time: per-request llguidance matchers, compiled off the engine
thread, and each step's token masks for the rows that have one.

- `start(seq)` (add_request, engine thread) submits the compile to a one-thread pool, so it
  runs while the prompt prefills. Until it is done `Sequence.can_sample` is false and the
  scheduler holds the sequence's last token back (scheduler.py `_add`): the step never waits
  on a compile. A compile that fails, or is not done within `compile_timeout_s`, ends the
  request with an error naming the grammar (`failures()`).
- `masks(seqs)` (before the forward) starts computing the masks of the step's constrained
  rows on another thread (llguidance releases the GIL; numpy unpacks the bits), and
  `MaskJob.result()` (after the forward) returns each row's banned tokens for the sampler.
  A step without constrained rows does
  nothing here.
- `advance(seqs, tokens)` feeds each constrained row its sampled token.

The matcher lives on the Sequence (not in the KV cache), so recompute and swap preemption
leave it as it was; it is also re-derivable from the generated tokens (`GrammarState.catch_up`).
EOS is allowed only where the grammar accepts (llguidance's mask); a grammar that allows
nothing more ends the row with "stop" on its last token (`GrammarState.complete`, checked by
Scheduler.update, before max_tokens); when the output reaches max_tokens first, the request
ends with finish_reason "length" and its text may not parse.
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import CancelledError
import threading
from collections import deque
import time

import numpy as np
import torch

from .grammar import llguidance_grammar, limits
from .sequence import Sequence


class GrammarState:
    __slots__ = ("future", "deadline", "matcher", "consumed", "error")

    def __init__(self, future: concurrent.futures.Future, deadline: float):
        self.future, self.deadline = future, deadline
        self.matcher = None
        self.consumed = 0              # output tokens the matcher has consumed
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        if self.matcher is None and self.error is None and self.future.done():
            exc = CancelledError("cancelled") if self.future.cancelled() else self.future.exception()
            if exc is None:
                self.matcher = self.future.result()
            else:
                self.error = str(exc) if str(exc).startswith("grammar:") else f"grammar: {type(exc).__name__}: {exc}"
        return self.matcher is not None

    def catch_up(self, output_token_ids: list[int]) -> None:
        """The matcher consumes the output tokens it has not seen (after a preemption, say)."""
        if self.consumed < len(output_token_ids):
            self.matcher.consume_tokens(output_token_ids[self.consumed:])
            self.consumed = len(output_token_ids)

    def drafts(self, output_token_ids: list[int], ngram, k: int) -> list[int]:
        """Up to k speculative drafts (speculative.py) the grammar accepts from here: the tokens
        it forces next (llguidance's fast-forward tokens: a JSON key, a closing brace), else
        `ngram()`'s proposal; either cut at the first token the grammar refuses."""
        if self.matcher is None or self.error is not None:
            return []
        self.catch_up(output_token_ids)
        if self.matcher.is_stopped():
            return []
        proposal = self.matcher.compute_ff_tokens()[:k] or ngram()
        return proposal[:self.matcher.validate_tokens(proposal)] if proposal else []

    def consume(self, token: int) -> None:
        """The matcher takes the row's sampled token (a failure marks the state in error)."""
        if self.matcher is not None:
            if not self.matcher.consume_token(token) and self.error is None:
                self.error = f"grammar: internal error: {self.matcher.get_error()[:300]}"
            self.consumed += 1

    @property
    def complete(self) -> bool:
        """The output is a whole sentence of the grammar and nothing can extend it (a finite
        language's last token): the row ends with 'stop' now, not after an EOS step."""
        return self.matcher is not None and self.error is None and self.matcher.is_stopped()


class MaskJob:
    def __init__(self, future: concurrent.futures.Future, rows: dict[int, int]):
        self.future, self.rows = future, rows

    def result(self, device: torch.device | str = "cpu") -> RowMasks:
        """row -> bool [V] on `device`: the tokens the row's grammar bans."""
        banned = self.future.result().to(device)                      # bool [G, V]
        masks = RowMasks({row: banned[g] for row, g in self.rows.items()})
        masks.banned = banned
        return masks


class RowMasks(dict):
    """row -> banned tokens; `banned` holds them all, bool [G, V], in row order (one op for
    the sampler when the constrained rows are all its processed rows)."""

    banned: torch.Tensor


class GrammarRuntime:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], compile_timeout_s: float = 10.0):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.mask_words = (vocab_size + 31) // 32           # int32 words of a token bitmask
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._masker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._lock = threading.Lock()
        self._llt = None
        self._executor = None
        self.pending: set[Sequence] = set()
        self.compile_times: deque[float] = deque(maxlen=256)   # the latest compiles' seconds (bench, tests)

    def _lltokenizer(self):
        with self._lock:
            if self._llt is None:
                import llguidance
                import llguidance.hf

                # ~1 s for a 50k-token vocabulary: built once, on the first grammar.
                self._llt = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
                self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
            return self._llt

    def _compile(self, grammar):
        from llguidance import LLMatcher

        start = time.perf_counter()
        matcher = LLMatcher(self._lltokenizer(), llguidance_grammar(grammar), limits=limits(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: the {grammar.kind} does not compile: {matcher.get_error()[:500]}")
        self.compile_times.append(time.perf_counter() - start)
        return matcher

    def start(self, seq: Sequence, now: float) -> None:
        grammar = seq.params.grammar
        seq.grammar_state = GrammarState(self._compiler.submit(self._compile, grammar), now + self.compile_timeout_s)
        self.pending.add(seq)

    def failures(self, now: float) -> list[tuple[Sequence, str]]:
        """Sequences whose compile failed or overran its time limit (they stop pending)."""
        failed = []
        for seq in list(self.pending):
            state = seq.grammar_state
            if seq.status.finished:
                state.future.cancel()                # aborted while queued: never compiled
            if state.ready or state.error is not None or seq.status.finished:
                self.pending.discard(seq)
                if state.error is not None and not seq.status.finished:
                    failed.append((seq, state.error))
            elif now >= state.deadline:
                self.pending.discard(seq)
                state.future.cancel()
                state.error = (f"grammar: compiling the {seq.params.grammar.kind} took longer than "
                               f"{self.compile_timeout_s} s")
                failed.append((seq, state.error))
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` s for a pending compile (only when a step has nothing to run)."""
        futures = [s.grammar_state.future for s in self.pending]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def masks(self, seqs: list[Sequence]) -> MaskJob | None:
        """Start the masks of the constrained rows among `seqs` (the step's sampling rows)."""
        rows = {i: s for i, s in enumerate(seqs) if s.grammar_state is not None}
        if not rows:
            return None
        matchers = []
        for g, seq in enumerate(rows.values()):
            seq.grammar_state.catch_up(seq.output_token_ids)
            matchers.append((seq.grammar_state.matcher, g))
        return MaskJob(self._masker.submit(self._fill, matchers), {i: g for g, i in enumerate(rows)})

    def _fill(self, matchers: list) -> torch.Tensor:
        """The banned tokens of each matcher's next step, bool [G, V] (mask thread)."""
        words = self.mask_words
        bitmask = np.full((len(matchers), words), -1, dtype=np.int32)
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, words * 4, len(matchers))
        return self._banned(bitmask)

    def _banned(self, bitmask: np.ndarray) -> torch.Tensor:
        """llguidance's allowed-token bits, one row a mask -> the banned tokens, bool [G, V]."""
        for g in range(len(bitmask)):   # a matcher with nothing left to allow may still end (never a -inf row)
            if not bitmask[g].any():
                for eos in self.eos_token_ids:
                    bitmask[g, eos // 32] |= np.int32(1 << (eos % 32)) if eos % 32 < 31 else np.int32(-2**31)
        # bit t of word t // 32 (little-endian) is token t: ~bits, unpacked, are the banned tokens
        banned = np.unpackbits((~bitmask).view(np.uint8), axis=-1, bitorder="little")[:, :self.vocab_size]
        return torch.from_numpy(np.ascontiguousarray(banned)).view(torch.bool)

    def advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Each constrained row consumes its sampled token (before update() appends it)."""
        for seq, token in zip(seqs, tokens):
            if seq.grammar_state is not None:
                seq.grammar_state.consume(token)

    def draft_masks(self, drafted: list[tuple[Sequence, list[int]]]) -> MaskJob | None:
        """Start the masks of the verified positions of the drafted constrained rows
        (spec_decode.py): row j of a sequence with drafts d1..dk (rows counted as verify
        counts them, 1 + k a sequence) gets the tokens its grammar bans after d1..dj; the
        matcher consumes the drafts to get there and rolls them back (mask thread)."""
        rows, items, at = {}, [], 0
        for seq, drafts in drafted:
            if seq.grammar_state is not None and seq.grammar_state.matcher is not None:
                seq.grammar_state.catch_up(seq.output_token_ids)
                for j in range(len(drafts) + 1):
                    rows[at + j] = len(rows)
                items.append((seq.grammar_state.matcher, drafts))
            at += len(drafts) + 1
        if not rows:
            return None
        return MaskJob(self._masker.submit(self._fill_drafts, items, len(rows)), rows)

    def _fill_drafts(self, items: list, count: int) -> torch.Tensor:
        words = self.mask_words
        bitmask = np.full((count, words), -1, dtype=np.int32)
        g = 0
        for matcher, drafts in items:
            for j in range(len(drafts) + 1):
                matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data + g * words * 4, words * 4)
                g += 1
                if j < len(drafts):
                    matcher.consume_token(drafts[j])      # valid: GrammarState.drafts checked them
            matcher.rollback(len(drafts))
        return self._banned(bitmask)

    def close(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)
        self._masker.shutdown(wait=False, cancel_futures=True)
