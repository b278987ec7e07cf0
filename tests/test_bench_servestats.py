"""The serving benchmark's statistics on synthetic timings (bench/serving/servestats.py)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from bench.serving import servestats as ss


def rec(tenant="t", send=0.0, deltas=((0.1, 1),), end=None, tokens=None, error=None, long=False, queue=None):
    """A record as a driver leaves it; `end` defaults to the last delta."""
    deltas = [list(d) for d in deltas]
    return {"id": "r", "tenant": tenant, "cls": "chat", "user": None, "long": long, "prompt_words": 10,
            "max_tokens": 8, "arrival": send, "send": send,
            "end": end if end is not None or error else (deltas[-1][0] if deltas else send),
            "deltas": deltas, "output_tokens": tokens if tokens is not None else sum(n for _, n in deltas),
            "prompt_tokens": 10, "queue_s": queue, "finish": None if error else "length", "error": error,
            "status": None}


def test_percentile_empty_and_single():
    """No values give None; one value is every percentile."""
    assert ss.percentile([], 50) is None
    assert all(ss.percentile([7.0], q) == 7.0 for q in (0, 50, 90, 99, 100))


def test_percentile_interpolates():
    """Percentiles interpolate linearly between order statistics, whatever the input order."""
    xs = [4.0, 1.0, 3.0, 2.0]
    assert ss.percentile(xs, 0) == 1.0 and ss.percentile(xs, 100) == 4.0
    assert ss.percentile(xs, 50) == 2.5
    assert math.isclose(ss.percentile(list(range(101)), 99), 99.0)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50),
       st.floats(min_value=0, max_value=100), st.floats(min_value=0, max_value=100))
def test_percentile_bounded_and_monotone(xs, q1, q2):
    """Every percentile lies within [min, max] and never decreases as q grows."""
    lo, hi = sorted((q1, q2))
    a, b = ss.percentile(xs, lo), ss.percentile(xs, hi)
    assert min(xs) - 1e-6 <= a <= b + 1e-6 <= max(xs) + 2e-6


def test_dist_of_nothing():
    """A distribution of no values has count 0 and None everywhere (not NaN)."""
    d = ss.dist([])
    assert d["count"] == 0 and d["p50"] is None and d["p99"] is None and d["max"] is None


def test_dist_converts_to_ms_and_skips_none():
    """dist() reports milliseconds and ignores missing values."""
    d = ss.dist([0.1, None, 0.3])
    assert d["count"] == 2 and math.isclose(d["max"], 300.0) and math.isclose(d["p50"], 200.0)


def test_tpot_needs_a_second_token():
    """TPOT is (e2e - TTFT) / (n - 1), and None for a one-token answer."""
    assert math.isclose(ss.tpot(1.0, 0.2, 5), 0.2)
    assert ss.tpot(1.0, 0.2, 1) is None and ss.tpot(None, 0.2, 3) is None
    m = ss.request_metrics(rec(deltas=[(0.3, 1)]))
    assert m["ok"] and m["tpot"] is None and math.isclose(m["ttft"], 0.3)


def test_request_metrics_gaps_count_deltas_not_tokens():
    """One ITL gap per delta, carrying the delta's token count; TPOT uses the usage count."""
    m = ss.request_metrics(rec(deltas=[(0.1, 1), (0.2, 3), (0.5, 1)], tokens=5))
    assert [round(g, 6) for _, g, _ in m["gaps"]] == [0.1, 0.3] and [n for *_, n in m["gaps"]] == [3, 1]
    assert math.isclose(m["tpot"], (0.5 - 0.1) / 4)


def test_goodput_counts_only_successes_meeting_both_slos():
    """Goodput counts requests that succeeded with TTFT and TPOT within the SLOs; a failure
    with a fast first token does not count, a one-token answer needs only the TTFT."""
    recs = [rec(deltas=[(0.1, 1), (0.2, 1)]),                    # meets both
            rec(deltas=[(3.0, 1), (3.1, 1)]),                    # TTFT too slow
            rec(deltas=[(0.1, 1), (1.1, 1)]),                    # TPOT too slow
            rec(deltas=[(0.1, 1)], error="deadline_exceeded", end=0.5),
            rec(deltas=[(0.2, 1)]),                              # one token: TTFT decides
            rec(deltas=[], error="engine_overloaded", end=0.01)]
    ms = [ss.request_metrics(r) for r in recs]
    g = ss.goodput(ms, 4.0, ttft_s=2.0, tpot_s=0.5)
    assert g["count"] == 2 and math.isclose(g["fraction"], 2 / 6) and math.isclose(g["rps"], 0.5)


def test_summary_records_failures_without_raising():
    """Failures are counted by code and excluded from successes and latencies."""
    recs = [rec(), rec(error="rate_limit", deltas=[], end=0.0), rec(error="deadline_exceeded", deltas=[], end=1.0)]
    s = ss.summarize(recs, [], 2000, 300)
    assert s["ok"] == 1 and s["failed"] == 2
    assert s["failures"] == {"rate_limit": 1, "deadline_exceeded": 1}
    assert s["e2e_ms"]["count"] == 1


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(min_value=0, max_value=500)), min_size=1,
                max_size=30))
def test_tenant_shares_sum_to_one(items):
    """Per-tenant shares of output tokens add up to 1 whenever any token was served."""
    recs = [rec(tenant=t, deltas=[(0.1, 1)], tokens=n) for t, n in items]
    shares = ss.tenant_shares(recs, [ss.request_metrics(r) for r in recs])
    total = sum(x["share"] for x in shares.values())
    assert math.isclose(total, 1.0) if sum(n for _, n in items) else total == 0.0
    assert sum(x["requests"] for x in shares.values()) == len(items)


def test_long_prefill_window_selects_other_requests_gaps():
    """ITL 'during long prefill' keeps the short requests' gaps that overlap a long
    request's time from send to first token, including a stall that spans past its end."""
    long = rec(send=1.0, deltas=[(2.0, 1), (2.5, 1)], long=True)
    short = rec(deltas=[(0.5, 1), (0.9, 1), (1.5, 1), (3.0, 1), (3.2, 1)])
    ms = [ss.request_metrics(r) for r in (long, short)]
    assert ss.long_windows([long, short]) == [(1.0, 2.0)]
    assert [round(g, 6) for g in ss.gaps_in_windows([long, short], ms, [(1.0, 2.0)])] == [0.6, 1.5]


def test_stats_summary_counts_preemptions_during_the_run():
    """Preemptions are the counter's growth over the samples; KV usage its peak."""
    samples = [{"num_preemptions": 3, "kv_cache_usage": 0.2, "waiting": 0},
               {"num_preemptions": 5, "kv_cache_usage": 0.9, "waiting": 4},
               {"num_preemptions": 7, "kv_cache_usage": 0.5, "waiting": 1}]
    s = ss.stats_summary(samples)
    assert s["preemptions"] == 4 and s["peak_kv_usage"] == 0.9 and s["peak_waiting"] == 4
    assert ss.stats_summary([])["preemptions"] is None


def test_table_has_units_and_one_column_per_run():
    """The table names every run and writes times with units; unmeasured cells are '-'."""
    s = ss.summarize([rec(deltas=[(0.1, 1), (0.3, 1)]), rec(tenant="u", deltas=[(1.5, 1)])], [], 2000, 300)
    lines = ss.format_table([{"label": "chunked", "summary": s}, {"label": "hf", "summary": {"requests": 2}}])
    text = "\n".join(lines)
    assert "chunked" in lines[0] and "hf" in lines[0]
    assert "100 ms" in text and "1.50 s" in text and "req/s" in text and "tok/s" in text
    assert "tenant u" in text
