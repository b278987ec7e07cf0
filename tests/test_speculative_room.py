"""Draft room on a hybrid model: proposals never ask for more KV blocks than every group's
table can get (Speculator.extend), so the scheduler's append_slots never runs out."""

from engine import EngineConfig
from engine.block_manager import BlockManager
from engine.config import SamplingParams as SP
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.speculative import Speculator


def test_drafts_fit_the_free_blocks_of_every_kv_group():
    """Two groups (full + sliding) share 6 blocks of 4: a 7-token prompt holds 2 per group and
    2 stay free, so a decode can take one more block per group: at most 4 drafts, not 8."""
    bm = BlockManager(6, 4, windows=(None, 64))
    seq = Sequence("a", [5, 6, 5, 6, 5, 6, 5], SP(max_tokens=100, temperature=0.0))
    bm.allocate(seq)
    seq.num_computed_tokens = 7
    seq.output_token_ids.append(6)                     # the decode computes position 7
    out = SchedulerOutput(token_budget=64)
    out.add(seq, 1)
    spec = Speculator(EngineConfig(num_speculative_tokens=8, speculative_ngram_min=1))
    spec.extend(out, bm, reserve=0, max_model_len=1024)
    (drafts,) = out.drafts
    assert drafts, "a repeating sequence proposes"
    assert seq.num_tokens + len(drafts) <= 3 * 4       # 3 blocks per table: 2 held + 1 of the 2 free
    assert all(len(t) == 3 for t in seq.block_tables) and bm.num_free_blocks == 0
