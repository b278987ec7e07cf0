"""§6's tables give each level's share of the roofline (issue 29: every speed number carries its
fraction of the bound): `bench.peers --roofline` embeds a roofline of the same host, `--attach`
adds one measured beside a finished run, and the renderer turns it into a bound per stream count
(bench.engine.roofline's serving model) and each server's percentage of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.engine.roofline import Rates, Shapes, serving_tok_s
from bench.provenance import provenance
from bench.renderers.peers import render_peers

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"hidden": 576, "intermediate": 1536, "layers": 30, "heads": 9, "kv_heads": 3, "head_dim": 64, "vocab": 49152}


def _rows(text: str) -> dict[str, list[str]]:
    return {cells[0]: cells for line in text.splitlines() if line.startswith("| ") and not line.startswith("|---")
            for cells in [[c.strip() for c in line.strip("|").split(" | ")]]}


def _roofline(host: str, cpu: str, model_dir: str) -> dict:
    """A roofline JSON as bench.engine.roofline writes it (the fields load_roofline reads)."""
    return {"provenance": {"benchmark": "engine.roofline", "command": "python -m bench.engine.roofline", "host": host,
                           "cpu": cpu, "commit": "abc1234", "started": "2026-12-06T11:23:00Z"},
            "model_dir": model_dir, "shapes": SHAPES, "threads": 2,
            "matmul_flops": {"bfloat16": {"1": 4e10, "512": 4.0e11}, "float32": {"1": 2e10, "512": 1.7e11}},
            "read_bandwidth": 3.0e10, "workload": {"prompt_tokens": 286, "output_tokens": 64}}


def _peers(host: str, cpu: str, model_dir: str) -> dict:
    rows = lambda tps: [{"concurrency": c, "ok": 8, "failed": 0, "output_tps": t, "ttft_p50_ms": 100.0,  # noqa: E731
                         "ttft_p99_ms": 200.0, "itl_p50_ms": 10.0} for c, t in zip((1, 8, 32), tps)]
    return {"provenance": {"benchmark": "peers", "command": "python -m bench.peers", "commit": "abc1234", "host": host,
                           "cpu": cpu, "started": "2026-12-06T11:17:00Z", "finished": "2026-12-06T11:22:00Z"},
            "args": {"peer": "vllm", "client": "guidellm", "prompt_tokens": 256, "output_tokens": 64},
            "model_dir": model_dir, "skipped": [],
            "servers": {"vllm": {"rows": rows([28.0, 118.0, 124.0]), "errors": []},
                        "sg": {"rows": rows([65.0, 262.0, 251.0]), "errors": []}}}


def test_each_level_gets_its_bound_and_both_servers_share_of_it():
    data = {**_peers("h", "CPU X", "/m"), "roofline": _roofline("h", "CPU X", "/m")}
    text = render_peers(data, "peers-x")
    rates = Rates(flops=4.0e11, bandwidth=3.0e10)
    rows = _rows(text)
    for c, vllm, sg in ((1, 28.0, 65.0), (8, 118.0, 262.0), (32, 124.0, 251.0)):
        bound = serving_tok_s(Shapes(**SHAPES), rates, c, 286, 64, 2)      # bf16 weights, the roofline's prompt
        assert rows[str(c)][7:9] == [f"{bound:.1f}", f"{100 * vllm / bound:.0f} % / **{100 * sg / bound:.0f} %**"]
    assert "bf16 bound tok/s" in text and "286 tokens in, 64 out" in text and "read 30.0 GB/s" in text
    longer = {**data, "args": {**data["args"], "prompt_tokens": 1024}}          # not the roofline's workload
    bound = serving_tok_s(Shapes(**SHAPES), rates, 8, 1024, 64, 2)
    assert _rows(render_peers(longer, "peers-x"))["8"][7] == f"{bound:.1f}"


def test_another_hosts_roofline_gives_no_fractions_and_says_why():
    data = {**_peers("h", "CPU X", "/m"), "roofline": _roofline("other", "CPU Y", "/m")}
    text = render_peers(data, "peers-x")
    assert "bf16 bound" not in text and "No fraction of the roofline" in text
    assert len(_rows(text)["1"]) == 7                                   # the table without the two columns
    plain = render_peers(_peers("h", "CPU X", "/m"), "peers-x")
    assert "bound" not in plain and "roofline" not in plain


def test_attach_adds_this_hosts_roofline_and_refuses_another_hosts(tmp_path):
    """`--attach` writes the roofline into a finished run's JSON, its provenance kept and the
    command recorded; a roofline measured on another host is refused and the JSON left alone."""
    mine = provenance("engine.roofline", [])
    peers = tmp_path / "peers.json"
    peers.write_text(json.dumps(_peers(mine["host"], mine["cpu"], str(tmp_path))))
    before = peers.read_text()
    foreign = tmp_path / "roof-other.json"
    foreign.write_text(json.dumps(_roofline("elsewhere", "CPU Y", str(tmp_path))))
    cmd = [sys.executable, "-m", "bench.peers", "--attach", str(peers), "--roofline"]
    refused = subprocess.run([*cmd, str(foreign)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "not the run's host" in refused.stderr and peers.read_text() == before
    roof = tmp_path / "roof.json"
    roof.write_text(json.dumps(_roofline(mine["host"], mine["cpu"], str(tmp_path))))
    done = subprocess.run([*cmd, str(roof)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(peers.read_text())
    assert data["provenance"] == json.loads(before)["provenance"] and data["roofline"]["read_bandwidth"] == 3.0e10
    assert data["roofline"]["attached"]["command"].startswith("python -m bench.peers --attach")
    assert "% of it, vllm / sg" in render_peers(data, "peers")
    bare = tmp_path / "bare.json"                                        # a run that says not where it ran
    bare.write_text(json.dumps({**_peers("h", "c", str(tmp_path)), "provenance": {}}))
    cmd[cmd.index(str(peers))] = str(bare)
    assert subprocess.run([*cmd, str(roof)], cwd=ROOT, capture_output=True, timeout=120).returncode != 0


def _probe(gbs: float, gflops: float, busy: float = 0.0) -> dict:
    return {"at": f"2026-12-06T19:00:{gbs:02.0f}Z", "busy": busy, "bf16_flops": gflops * 1e9, "read_bandwidth": gbs * 1e9}


def test_each_level_is_measured_against_the_roofline_probed_on_either_side_of_it():
    """Probed runs (bench/peers/probe.py): each server's level gets the bound of the higher of the
    probes before and after it, computed per rate (bandwidth and FLOP/s each at their best), so
    a level between a slow and a fast probe is held to the fast one; both servers' shares are
    against their own bounds, beside the embedded roofline's columns."""
    data = {**_peers("h", "CPU X", "/m"), "roofline": _roofline("h", "CPU X", "/m"),
            "probe": {"shapes": SHAPES, "threads": 2, "reps": 3, "rows": 512, "bandwidth_mb": 512,
                      "workload": {"prompt_tokens": 286, "output_tokens": 64}}}
    probes = {"vllm": [_probe(30, 440), _probe(40, 380), _probe(28, 400), _probe(33, 420)],
              "sg": [_probe(25, 300, busy=0.4), _probe(26, 310), _probe(45, 430), _probe(29, 300)]}
    for name, p in probes.items():
        for i, row in enumerate(data["servers"][name]["rows"]):
            row["roofline_probe"] = {"before": p[i], "after": p[i + 1]}
    text = render_peers(data, "peers-x")
    rows = _rows(text)
    assert "level's own bound, vllm / sg" in text and "read 25.0–45.0 GB/s" in text and "300–440 bf16 GFLOP/s" in text
    assert "1 began with the CPUs still up to 40 % busy" in text           # a probe that waited its limit

    def bound(p: list[dict], i: int, c: int) -> float:
        rates = Rates(flops=max(p[i]["bf16_flops"], p[i + 1]["bf16_flops"]),
                      bandwidth=max(p[i]["read_bandwidth"], p[i + 1]["read_bandwidth"]))
        return serving_tok_s(Shapes(**SHAPES), rates, c, 286, 64, 2)

    for i, (c, vllm, sg) in enumerate(((1, 28.0, 65.0), (8, 118.0, 262.0), (32, 124.0, 251.0))):
        bv, bs = bound(probes["vllm"], i, c), bound(probes["sg"], i, c)
        assert rows[str(c)][9:11] == [f"{bv:.0f} / {bs:.0f}", f"{100 * vllm / bv:.0f} % / **{100 * sg / bs:.0f} %**"]
    assert bound(probes["vllm"], 0, 1) > serving_tok_s(Shapes(**SHAPES), Rates(4.4e11, 3.0e10), 1, 286, 64, 2)
    unprobed = {**data, "probe": None}
    assert "own bound" not in render_peers(unprobed, "peers-x")


def test_a_host_without_bf16_dot_products_is_held_to_its_faster_fp32_gemm():
    """A probe that measured fp32 faster than bf16 (oneDNN emulates bf16 without AVX512-BF16 or
    AMX) bounds the level with the fp32 rate, and the caption says which rate it is."""
    data = {**_peers("h", "CPU X", "/m"),
            "probe": {"shapes": SHAPES, "threads": 2, "reps": 3, "rows": 512, "bandwidth_mb": 512,
                      "workload": {"prompt_tokens": 286, "output_tokens": 64}}}
    for rows in (data["servers"][n]["rows"] for n in ("vllm", "sg")):
        for row in rows:
            slow, fast = _probe(20, 90), {**_probe(20, 90), "fp32_flops": 250e9}
            row["roofline_probe"] = {"before": slow, "after": fast}
    text = render_peers(data, "peers-x")
    assert "90–250 GFLOP/s (the faster of bf16 and fp32)" in text
    emulated = serving_tok_s(Shapes(**SHAPES), Rates(90e9, 20e9), 32, 286, 64, 2)
    fp32 = serving_tok_s(Shapes(**SHAPES), Rates(250e9, 20e9), 32, 286, 64, 2)
    assert fp32 > emulated and _rows(text)["32"][7] == f"{fp32:.0f} / {fp32:.0f}"


def test_the_bound_assumes_the_prompt_as_the_chat_template_wraps_it(tiny_model):
    """The probed bound's prompt is the synthetic prompt plus the model's chat template's own
    tokens, counted with its tokenizer, not a constant."""
    from transformers import AutoTokenizer

    from bench.peers.probe import templated_tokens

    model = tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(model)
    assert tok.chat_template                                   # SmolLM2's, which adds a system turn
    wrapped = tok.apply_chat_template([{"role": "user", "content": " hello" * 100}], add_generation_prompt=True,
                                      tokenize=False)
    overhead = len(tok(wrapped, add_special_tokens=False)["input_ids"]) - len(
        tok(" hello" * 100, add_special_tokens=False)["input_ids"])
    assert overhead > 10 and templated_tokens(model, 100) == 100 + overhead


def test_a_probe_waits_while_the_machine_is_busy_and_records_how_busy():
    """wait_idle (bench/peers/probe.py) does not return while a process spins on a CPU: it waits
    its whole limit and reports the busy share it last saw (here at least one CPU's worth)."""
    import os
    import time

    from bench.peers.probe import IDLE_BUSY, wait_idle

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        busy = wait_idle(limit_s=1.2)
        waited = time.monotonic() - t0
    finally:
        spinner.kill()
        spinner.wait()
    assert waited >= 1.2 and busy is not None and busy >= max(IDLE_BUSY, 0.9 / os.cpu_count())
