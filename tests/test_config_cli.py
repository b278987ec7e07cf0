"""EngineConfig by section and the flags generated from it: every field has exactly one flag
on `serve` and `chat` (and back), with the field's default; old spellings still parse and log
a deprecation line; `--help` groups the flags by section."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import subprocess
import sys

import pytest

from engine import EngineConfig
from engine.config import SECTIONS, CacheConfig, SchedulerConfig
from engine.config_cli import DEPRECATED, engine_config_from_args, flag
from gateway.cli import build_parser

FIELDS = {f.name for _, f in EngineConfig.knobs()}


def subparser(name: str):
    return build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_every_field_has_one_flag_and_every_engine_flag_a_field(command):
    """The engine groups' flags are exactly the fields, named --field-name, with the fields' defaults."""
    p = subparser(command)
    engine_groups = [g for g in p._action_groups if g.title.startswith("engine: ")]
    assert [g.title for g in engine_groups] == [f"engine: {cls.__doc__.split(':')[0]}" for cls in SECTIONS.values()]
    dests = [a.dest for g in engine_groups for a in g._group_actions]
    assert sorted(dests) == sorted(FIELDS)
    for g in engine_groups:
        for a in g._group_actions:
            assert a.option_strings[0] == flag(a.dest)
    argv = ["hi"] if command == "chat" else []
    assert engine_config_from_args(p.parse_args(argv)) == EngineConfig()


def test_flags_set_their_fields():
    """A flag of each kind (int, None-able int, bool, tri-state, choice, float) reaches its field."""
    args = subparser("serve").parse_args(
        ["--max-num-seqs", "8", "--num-kv-blocks", "40", "--no-chunked-prefill", "--max-num-batched-tokens", "64",
         "--preempt-for-priority", "--policy", "fair", "--itl-target-ms", "250", "--max-step-tokens", "512",
         "--no-packed-linear", "--tp-timeout-s", "7", "--dtype", "auto", "--kv-cache-memory-gb", "auto"])
    c = engine_config_from_args(args)
    assert (c.max_num_seqs, c.num_kv_blocks, c.chunked_prefill, c.preempt_for_priority, c.policy) == \
        (8, 40, False, True, "fair")
    assert (c.itl_target_ms, c.packed_linear, c.tp_timeout_s, c.dtype, c.kv_cache_memory_gb) == \
        (250.0, False, 7.0, "auto", None)


OLD = [(["--tp-timeout", "5"], "tp_timeout_s", 5.0),
       (["--no-prefix-caching"], "enable_prefix_caching", False),
       (["--preempt-at-admission", "off"], "preempt_for_priority", False),
       (["--preempt-at-admission", "auto"], "preempt_for_priority", None),
       (["--isolate-prompts", "off"], "isolate_prompts", False),
       (["--itl-target-ms", "0"], "itl_target_ms", None)]


@pytest.mark.parametrize("argv,name,value", OLD)
def test_old_spellings_parse_and_log_a_deprecation_line(argv, name, value, caplog):
    """Each old spelling sets the field as before and logs one line naming the new flag."""
    with caplog.at_level(logging.WARNING, logger="streamgate"):
        got = getattr(engine_config_from_args(subparser("serve").parse_args(argv)), name)
    assert got == value
    lines = [r.getMessage() for r in caplog.records if "deprecated flag" in r.getMessage()]
    assert len(lines) == 1 and argv[0] in lines[0] and flag(name)[2:] in lines[0]


def test_every_deprecated_spelling_is_tested():
    """The table of old spellings and this test's list agree."""
    assert {argv[0] for argv, _, _ in OLD} == set(DEPRECATED)


def test_new_spellings_log_nothing(caplog):
    """--isolate-prompts / --no-isolate-prompts and --itl-target-ms off are not deprecated."""
    with caplog.at_level(logging.WARNING, logger="streamgate"):
        args = subparser("serve").parse_args(["--no-isolate-prompts", "--itl-target-ms", "off"])
    assert args.isolate_prompts is False and args.itl_target_ms is None
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()]


def test_help_lists_the_sections():
    """`streamgate serve --help` shows the gateway, limits and engine sections as groups."""
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for title in ("gateway:", "limits:", "engine: model:", "engine: cache:", "engine: scheduler:",
                  "engine: forward:", "engine: parallel:", "deprecated engine flags:"):
        assert f"\n{title}\n" in out, title
    assert "--max-num-seqs INT" in out and "sequences running at once (default: 64)" in out


def test_sections_check_their_own_fields():
    """A section refuses a bad value naming the field as EngineConfig.<field>."""
    with pytest.raises(ValueError, match=r"EngineConfig\.block_size: must be a positive int \(got 0\)"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match=r"EngineConfig\.max_step_tokens"):
        SchedulerConfig(max_num_batched_tokens=1024, max_step_tokens=512)
    with pytest.raises(ValueError, match=r"EngineConfig\.preempt_for_priority: must be None, True or False"):
        EngineConfig(preempt_for_priority="on")
    with pytest.raises(TypeError, match="seed"):
        EngineConfig(seed=0)


def test_flat_keywords_sections_replace_and_pickle_agree():
    """Flat keywords, section objects, dataclasses.replace and a pickle round trip give one config."""
    flat = EngineConfig(max_num_seqs=8, block_size=8, policy="fair", device="cpu")
    composed = EngineConfig(scheduler_config=SchedulerConfig(max_num_seqs=8, policy="fair"),
                            cache_config=CacheConfig(block_size=8))
    assert flat == composed and flat.max_num_seqs == flat.scheduler_config.max_num_seqs == 8
    moved = dataclasses.replace(flat, max_num_seqs=4)
    assert moved.max_num_seqs == 4 and moved.block_size == 8 and moved.policy == "fair"
    assert pickle.loads(pickle.dumps(flat)) == flat and hash(flat) == hash(composed)
    assert flat.flat()["policy"] == "fair" and set(flat.flat()) == FIELDS
    assert flat.priority_preemption is True


@pytest.mark.parametrize("name,fields", [("engine.offline", ("model", "dtype", "attention_backend", "cuda_graphs")),
                                         ("serving.serve", ("model",))])
def test_benchmarks_take_the_generated_engine_flags(name, fields):
    """A benchmark's engine flags are add_engine_args's: the field's flag, help and default."""
    out = subprocess.run([sys.executable, "-m", "bench", name, "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "\nengine: model:\n" in out
    knobs = {f.name: f for _, f in EngineConfig.knobs()}
    for name in fields:
        words = knobs[name].metadata["help"].split()[:3]
        assert flag(name) in out and " ".join(words) in " ".join(out.split()), name


def test_the_token_budget_takes_auto():
    """`--max-num-batched-tokens auto` is None (measured at start: engine/budget_probe.py)."""
    args = subparser("serve").parse_args(["--max-num-batched-tokens", "auto"])
    assert engine_config_from_args(args).max_num_batched_tokens is None
    assert engine_config_from_args(subparser("serve").parse_args([])).max_num_batched_tokens == 512
