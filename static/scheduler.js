// The live scheduler view: queue counts, KV blocks, last step's decode/prefill split and an
// inter-token latency chart, all from the gateway's periodic `stats` message (gateway/live.py).
import { $, fmtMs } from "./socket.js";

const CHART_SPAN_MS = 60_000;
const itlPoints = [];      // {t (ms, server clock), p50, p99}

export function renderStats(s) {
  const e = s.engine || {};
  const set = (id, v) => { $(id).textContent = v == null ? "–" : String(v); };
  set("stat-waiting", e.waiting);
  set("stat-running", e.running);
  set("stat-swapped", e.swapped);
  set("stat-preemptions", e.num_preemptions);
  set("stat-streams", s.open_streams);
  set("stat-gen-tokens", e.generation_tokens);
  $("stat-policy").textContent = s.ready ? `policy ${s.policy}${s.draining ? ", draining" : ""}` : "model loading…";
  $("stat-preempt-detail").textContent =
    `recompute ${e.preemptions_recompute ?? 0}, swap ${e.preemptions_swap ?? 0}, ` +
    `deadline drops ${e.deadline_drops ?? 0}, rejections ${e.rejections ?? 0}`;

  const used = e.kv_blocks_used ?? 0;
  const total = e.kv_blocks_total ?? 0;
  const pct = total ? (100 * used) / total : 0;
  $("kv-fill").style.width = `${pct.toFixed(1)}%`;
  $("kv-bar").setAttribute("aria-valuenow", pct.toFixed(0));
  $("kv-bar").setAttribute("aria-valuetext", `${used} of ${total} blocks`);
  let kvText = `${used} / ${total} blocks (${pct.toFixed(1)}%)`;
  if (e.host_blocks_total) kvText += `; host swap ${e.host_blocks_used ?? 0} / ${e.host_blocks_total}`;
  $("kv-text").textContent = kvText;

  const decode = e.num_decode_tokens ?? 0;
  const prefill = e.num_prefill_tokens ?? 0;
  const budget = Math.max(s.max_num_batched_tokens || 0, decode + prefill, 1);
  $("tok-decode").style.width = `${((100 * decode) / budget).toFixed(1)}%`;
  $("tok-prefill").style.width = `${((100 * prefill) / budget).toFixed(1)}%`;
  $("stat-decode").textContent = String(decode);
  $("stat-prefill").textContent = String(prefill);
  $("tok-budget").textContent = `of ${budget} (${e.num_seqs_scheduled ?? 0} seqs)`;

  const itl = s.itl || {};
  const t = (s.time || Date.now() / 1000) * 1000;
  itlPoints.push({ t, p50: itl.p50_ms ?? null, p99: itl.p99_ms ?? null });
  while (itlPoints.length && itlPoints[0].t < t - CHART_SPAN_MS) itlPoints.shift();
  if (itl.count) {
    $("itl-p50").textContent = fmtMs(itl.p50_ms);
    $("itl-p99").textContent = fmtMs(itl.p99_ms);
  }
  drawChart();
}

function axisLabel(ms) {
  if (ms === 0) return "0";
  if (ms >= 1000) return `${+(ms / 1000).toFixed(2)} s`;
  return `${ms >= 10 ? Math.round(ms) : +ms.toFixed(1)} ms`;
}

function niceCeil(v) {
  if (v <= 0) return 10;
  const mag = 10 ** Math.floor(Math.log10(v));
  return [1, 2, 5, 10].map((m) => m * mag).find((x) => x >= v);
}

export function drawChart() {
  const canvas = $("itl-chart");
  const w = canvas.clientWidth;
  const h = canvas.clientHeight;
  if (!w || !h) return;
  const dpr = window.devicePixelRatio || 1;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 52, right = 10, top = 8, bottom = 20;
  const pw = w - left - right, ph = h - top - bottom;
  const values = itlPoints.flatMap((p) => [p.p50, p.p99]).filter((v) => v != null);
  const ymax = niceCeil(Math.max(1, ...values));
  const tEnd = itlPoints.length ? itlPoints[itlPoints.length - 1].t : 0;
  const x = (t) => left + pw * (1 - (tEnd - t) / CHART_SPAN_MS);
  const y = (v) => top + ph * (1 - v / ymax);

  ctx.font = "11px system-ui, sans-serif";
  const css = getComputedStyle(document.documentElement);
  ctx.fillStyle = css.getPropertyValue("--muted").trim();
  ctx.strokeStyle = "#dde1e6";
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let i = 0; i <= 4; i++) {
    const v = (ymax * i) / 4;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(left + pw, yy); ctx.stroke();
    ctx.fillText(axisLabel(v), left - 4, yy);
  }
  ctx.textBaseline = "top";
  for (const [ago, align] of [[60, "left"], [30, "center"], [0, "right"]]) {
    ctx.textAlign = align;
    ctx.fillText(ago ? `−${ago} s` : "now", left + pw * (1 - ago / 60), top + ph + 4);
  }

  for (const key of ["p99", "p50"]) {
    const color = css.getPropertyValue(`--${key}`).trim();
    ctx.strokeStyle = color;
    ctx.fillStyle = color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    let drawing = false;
    itlPoints.forEach((p, i) => {
      if (p[key] == null) { drawing = false; return; }
      const px = x(p.t), py = y(p[key]);
      if (drawing) ctx.lineTo(px, py);
      else ctx.moveTo(px, py);
      drawing = true;
      if (itlPoints[i - 1]?.[key] == null && itlPoints[i + 1]?.[key] == null) ctx.fillRect(px - 2, py - 2, 4, 4);
    });
    ctx.stroke();
  }
  const last = [...itlPoints].reverse().find((p) => p.p50 != null);
  canvas.setAttribute("aria-label", last
    ? `Inter-token latency chart: latest p50 ${fmtMs(last.p50)}, p99 ${fmtMs(last.p99)}; scale up to ${ymax} ms`
    : "Inter-token latency chart: no tokens in the last minute");
}
