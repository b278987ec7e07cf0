"""Constrained decoding (issue 27): a request's grammar (JSON schema, json_object, regex,
Lark) holds the tiny random model's output to it; compiles never stall the step; grammar
rows under recompute and swap preemption equal an unpreempted run; bad grammars are
refused before anything streams."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import AsyncEngine, EngineConfig, Grammar, LLMEngine, SamplingParams
from tests.models import run_to_completion


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def clock():
    return FakeClock()


@pytest.fixture(scope="module")
def engine(tiny_model, clock):
    return LLMEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, max_num_seqs=16,
                                  max_model_len=1024, num_kv_blocks=512), clock=clock)


def drain(engine) -> dict[str, dict]:
    res: dict[str, dict] = {}
    while engine.has_unfinished():
        for o in engine.step():
            r = res.setdefault(o.request_id, {"tokens": [], "text": "", "finals": []})
            r["tokens"] += o.new_token_ids
            r["text"] += o.new_text
            if o.finished:
                r["finals"].append(o.finish_reason)
                r["error"] = o.error
    return res


def prompt(rng: random.Random, n: int = 12) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


# -- random JSON schemas ---------------------------------------------------------------------
scalars = st.one_of(
    st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
        lambda a: {"type": "integer", "minimum": a[0], "maximum": a[0] + a[1]}),
    st.tuples(st.integers(-100, 100), st.integers(1, 400)).map(
        lambda a: {"type": "number", "minimum": a[0] / 4, "maximum": (a[0] + a[1]) / 4}),
    st.tuples(st.integers(0, 3), st.integers(0, 6)).map(
        lambda a: {"type": "string", "minLength": a[0], "maxLength": a[0] + a[1]}),
    st.lists(st.one_of(st.integers(-50, 50), st.text("abcxyz _", max_size=5), st.booleans(), st.none()),
             min_size=1, max_size=4, unique_by=json.dumps).map(lambda e: {"enum": e}),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"const": "fixed"}]),
)
names = st.text("abcdefgh", min_size=1, max_size=6)


def containers(children):
    return st.one_of(
        st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
            lambda a: {"type": "array", "items": a[0], "minItems": a[1], "maxItems": a[1] + a[2]}),
        st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req, "additionalProperties": False})),
    )


@st.composite
def json_schemas(draw):
    """A schema over bounded scalars, arrays and objects, with $defs that reference each
    other (d1 may use d0, ...) and are referenced from the body."""
    defs: dict[str, dict] = {}
    for i in range(draw(st.integers(0, 3))):
        leaves = scalars if not defs else st.one_of(scalars, st.sampled_from([{"$ref": f"#/$defs/{d}"} for d in defs]))
        defs[f"d{i}"] = draw(st.one_of(leaves, containers(leaves)))
    leaves = scalars if not defs else st.one_of(scalars, st.sampled_from([{"$ref": f"#/$defs/{d}"} for d in defs]))
    body = draw(st.recursive(leaves, containers, max_leaves=6))
    if body.get("type") != "object" and draw(st.booleans()):
        body = {"type": "object", "properties": {"v": body}, "required": ["v"], "additionalProperties": False}
    return {**body, "$defs": defs} if defs else body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(schema=json_schemas(), seed=st.integers(0, 2**31))
def test_random_schemas_always_validate(engine, schema, seed):
    """Three sampled rows (temperature 1, 1.5 and greedy) beside a plain row: every
    constrained output ends with 'stop' and validates against its schema with jsonschema."""
    rng = random.Random(seed)
    g = Grammar("json_schema", json.dumps(schema))
    for i, temp in enumerate((1.0, 1.5, 0.0)):
        engine.add_request(f"s{i}", prompt(rng, rng.randrange(3, 40)),
                           SamplingParams(max_tokens=600, temperature=temp, seed=seed + i, grammar=g))
    engine.add_request("plain", prompt(rng), SamplingParams(max_tokens=10, temperature=1.0, seed=seed))
    res = drain(engine)
    for i in range(3):
        r = res[f"s{i}"]
        assert r["finals"] == ["stop"], (schema, r)
        jsonschema.validate(json.loads(r["text"]), schema)
    assert engine.stats()["kv_blocks_used"] == 0


def test_regex_lark_and_json_object_outputs_match(engine):
    rng = random.Random(1)
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,4}/ | NUMBER\n%import common.NUMBER'
    cases = {
        "re": (Grammar("regex", r"(yes|no|maybe), [0-9]{1,3}!"), r"(yes|no|maybe), [0-9]{1,3}!"),
        "lark": (Grammar("lark", lark), r"\((?:[a-z]{1,4}|[0-9.eE+-]+)(?:,(?:[a-z]{1,4}|[0-9.eE+-]+))*\)"),
    }
    for seed in range(3):
        for name, (g, _) in cases.items():
            engine.add_request(f"{name}{seed}", prompt(rng), SamplingParams(max_tokens=300, temperature=1.0,
                                                                           seed=seed, grammar=g))
        engine.add_request(f"obj{seed}", prompt(rng), SamplingParams(max_tokens=300, temperature=0.8, seed=seed,
                                                                    grammar=Grammar("json_object")))
    res = drain(engine)
    for seed in range(3):
        for name, (_, pattern) in cases.items():
            r = res[f"{name}{seed}"]
            assert r["finals"] == ["stop"] and re.fullmatch(pattern, r["text"]), r
        r = res[f"obj{seed}"]
        if r["finals"] == ["stop"]:
            assert isinstance(json.loads(r["text"]), dict)
        else:                                   # json_object has no bound: 'length' is allowed, still a prefix
            assert r["finals"] == ["length"] and r["text"].startswith("{")


def test_eos_is_only_allowed_where_the_grammar_accepts(engine):
    """A regex needing at least 40 characters: the model (whose EOS the grammar would
    otherwise let it pick early) writes all of them, and max_tokens short of that ends with
    'length' and a prefix of the language."""
    g = Grammar("regex", "[a-z]{40,45}")
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=100, temperature=1.0, seed=5, grammar=g))
    engine.add_request("short", [1, 2, 3], SamplingParams(max_tokens=3, temperature=1.0, seed=5, grammar=g))
    res = drain(engine)
    assert res["long"]["finals"] == ["stop"] and re.fullmatch("[a-z]{40,45}", res["long"]["text"])
    assert res["short"]["finals"] == ["length"] and re.fullmatch("[a-z]{1,45}", res["short"]["text"])


def test_a_finished_language_ends_with_stop_on_its_last_token(engine):
    """A finite language ('yes' or 'no'): the row ends with 'stop' on the token that completes
    it, with no EOS step after it, even when that token is the max_tokens-th."""
    g = Grammar("regex", "(yes|no)")
    engine.add_request("free", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0.0, grammar=g))
    free = drain(engine)["free"]
    assert free["finals"] == ["stop"] and free["text"] in ("yes", "no")
    assert not set(free["tokens"]) & engine.eos_token_ids
    engine.add_request("tight", [1, 2, 3], SamplingParams(max_tokens=len(free["tokens"]), temperature=0.0, grammar=g))
    tight = drain(engine)["tight"]
    assert tight["finals"] == ["stop"] and tight["text"] == free["text"]


def block_compiles(engine) -> threading.Event:
    """Holds the compile thread until the returned event is set (the tokenizer is built first)."""
    engine.grammars._lltokenizer()
    release = threading.Event()
    engine.grammars._compiler.submit(release.wait)
    return release


def test_the_step_never_waits_on_a_compile(engine):
    """While a grammar compiles, other requests stream to the end and the constrained
    request's prompt computes all but its last token; once the compile lands it finishes."""
    release = block_compiles(engine)
    try:
        engine.add_request("g", list(range(100, 180)),
                           SamplingParams(max_tokens=50, temperature=0.0,
                                          grammar=Grammar("regex", "[0-9]{3}-[0-9]{4}")))
        engine.add_request("p", [5, 6, 7], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        outs = []
        for _ in range(40):
            outs += engine.step()
        seq = engine.seqs["g"]
        assert [o.finish_reason for o in outs if o.finished] == ["length"]
        assert all(o.request_id == "p" for o in outs) and seq.num_output_tokens == 0
        assert seq.num_computed_tokens == seq.num_tokens - 1
    finally:
        release.set()
    res = drain(engine)
    assert res["g"]["finals"] == ["stop"] and re.fullmatch("[0-9]{3}-[0-9]{4}", res["g"]["text"])


def test_a_compile_past_its_time_limit_ends_the_request_with_a_grammar_error(engine, clock):
    release = block_compiles(engine)
    try:
        engine.add_request("slow", [1, 2, 3], SamplingParams(max_tokens=5, grammar=Grammar("json_object")))
        engine.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        first = engine.step()
        clock.t += engine.grammars.compile_timeout_s + 1
        res = drain(engine)
    finally:
        release.set()
    assert [o.request_id for o in first] == ["ok"]
    res["ok"]["tokens"][:0] = first[0].new_token_ids
    assert res["slow"]["finals"] == ["error"] and res["slow"]["error"].startswith("grammar:")
    assert "longer than" in res["slow"]["error"] and res["slow"]["tokens"] == []
    assert res["ok"]["finals"] == ["length"] and len(res["ok"]["tokens"]) == 4
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_request_aborted_while_its_grammar_compiles_is_never_compiled(engine):
    release = block_compiles(engine)
    try:
        engine.add_request("gone", list(range(100, 140)), SamplingParams(grammar=Grammar("regex", "[0-9]+")))
        engine.step()
        future = engine.seqs["gone"].grammar_state.future
        engine.abort("gone")
        outs = engine.step()
        assert [(o.request_id, o.finish_reason) for o in outs] == [("gone", "abort")]
        assert future.cancelled() and not engine.grammars.pending
    finally:
        release.set()
    assert not engine.has_unfinished() and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("grammar, match", [
    (Grammar("json_schema", "{not json"), "grammar: the JSON schema is not valid JSON"),
    (Grammar("json_schema", '{"type": "frobnicate"}'), "grammar: "),
    (Grammar("json_schema", "[1, 2]"), "grammar: a JSON schema must be an object"),
    (Grammar("regex", "a(b"), "grammar: the regex does not compile"),
    (Grammar("lark", "start: foo"), "grammar: the lark does not compile"),
    (Grammar("yaml", ""), "grammar: kind must be one of"),
    (Grammar("regex", "a" * (64 * 1024 + 1)), "grammar: the regex is 65537 bytes"),
])
def test_bad_grammars_are_refused_at_admission(engine, grammar, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        engine.add_request("bad", [1, 2], SamplingParams(grammar=grammar))
    assert not engine.has_unfinished()


def test_grammar_with_ignore_eos_is_refused(engine):
    with pytest.raises(ValueError, match="grammar: cannot be combined with ignore_eos"):
        engine.add_request("bad", [1, 2], SamplingParams(grammar=Grammar("json_object"), ignore_eos=True))


async def test_async_generate_refuses_a_bad_grammar_before_streaming(tiny_model):
    eng = AsyncEngine(EngineConfig(model=tiny_model("llama"), max_num_batched_tokens=64, num_kv_blocks=128))
    await eng.start()
    try:
        with pytest.raises(ValueError, match="^grammar: "):
            async for _ in eng.generate("bad", [1, 2], SamplingParams(grammar=Grammar("regex", "(("))):
                pytest.fail("a bad grammar streamed")
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["n"], "additionalProperties": False}
        text, finals = "", []
        params = SamplingParams(max_tokens=50, temperature=1.0, seed=3,
                                grammar=Grammar("json_schema", json.dumps(schema)))
        async for out in eng.generate("good", [1, 2], params):
            text += out.new_text
            finals += [out.finish_reason] if out.finished else []
        assert finals == ["stop"] and 1 <= json.loads(text)["n"] <= 9
    finally:
        await eng.stop()


PRE_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10**6},
                             "tags": {"type": "array", "minItems": 3, "maxItems": 5,
                                      "items": {"type": "string", "minLength": 4, "maxLength": 9}},
                             "ok": {"type": "boolean"}}}


def preemption_workload() -> dict[int, list[tuple]]:
    """Grammar rows (sampled and greedy) and plain rows, long enough prompts to chunk,
    half of them sharing a prefix (prefix-cache hits)."""
    rng = random.Random(4)
    shared = prompt(rng, 40)
    grammars = [Grammar("json_schema", json.dumps(PRE_SCHEMA)), Grammar("regex", "[a-z]{30,40}( [0-9]{2,6}){3}")]
    arrivals: dict[int, list[tuple]] = {}
    for i in range(10):
        p = (shared if i % 2 else []) + prompt(rng, rng.randrange(20, 70))
        if i % 3 == 2:
            params = SamplingParams(max_tokens=60, temperature=1.0, seed=i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=200, temperature=[1.0, 0.0][i % 2], seed=i, grammar=grammars[i % 2],
                                    logprobs=1)
        arrivals.setdefault(i // 2, []).append((f"r{i}", p, params))
    return arrivals


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_grammar_rows_under_preemption_equal_an_unpreempted_run(tiny_model, mode):
    arrivals = preemption_workload()
    roomy = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=512, block_size=8,
                                   max_num_batched_tokens=64, max_num_seqs=16))
    want = run_to_completion(roomy, arrivals)
    assert roomy.stats()["num_preemptions"] == 0
    tight = LLMEngine(EngineConfig(model=tiny_model("llama"), num_kv_blocks=40, block_size=8, watermark=0.0,
                                   max_num_batched_tokens=64, max_num_seqs=16, preemption_mode=mode,
                                   num_swap_blocks=128, swap_min_tokens=0))
    got = run_to_completion(tight, arrivals)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats[f"preemptions_{mode}"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert got == want
    tok = tight.tokenizer
    for reqs in arrivals.values():
        for rid, _, params in reqs:
            if params.grammar is not None and params.grammar.kind == "json_schema":
                jsonschema.validate(json.loads(tok.decode(got[rid], skip_special_tokens=True)), PRE_SCHEMA)
    assert stats["kv_blocks_used"] == 0


def test_grammar_rows_under_tensor_parallelism_equal_one_process(tiny_model):
    """Two CPU ranks (rank 0 samples, so masks and matchers live there only) give the
    one-process engine's tokens for grammar and plain rows, under recompute preemption.
    Greedy: the ranks sum their halves in another order, and a seeded draw may flip where
    the cumulative distribution moves by that rounding (plain sampled rows do too)."""
    arrivals = {step: [(rid, p, dataclasses.replace(params, temperature=0.0)) for rid, p, params in reqs]
                for step, reqs in preemption_workload().items()}
    cfg = dict(model=tiny_model("llama"), num_kv_blocks=40, block_size=8, watermark=0.0, max_num_batched_tokens=64,
               max_num_seqs=16, preemption_mode="recompute")
    want = run_to_completion(LLMEngine(EngineConfig(**cfg)), arrivals)
    tp = LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2, tp_timeout_s=30.0))
    try:
        got = run_to_completion(tp, arrivals)
        assert tp.stats()["num_preemptions"] > 0
    finally:
        tp.close()
    assert got == want
