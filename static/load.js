// The load control: keep N background chat requests running on a second WebSocket (same
// key) until stopped, with prompts of varied length so long ones are prefilled in chunks.
import { $, Channel, describeError } from "./socket.js";

const LOAD_MAX = 32;
const LOAD_MAX_TOKENS = 128;
const LOAD_PRIORITY = 2;     // lower urgency than the tenant's chat (a request may only lower it)

const LOAD_TOPICS = [
  "Explain how continuous batching lets a server mix new requests with running ones.",
  "Why does a paged KV cache waste less memory than one contiguous buffer per request?",
  "Summarise the trade-off between recomputing and swapping a preempted request.",
  "What is chunked prefill and why does it keep streams smooth?",
];
const FILLER = "The scheduler forms a new batch at every step: running sequences each get one decode " +
  "token first, then waiting prompts fill the rest of the token budget in chunks, and when KV blocks run " +
  "low the least urgent sequence is deferred, swapped to host memory or recomputed later. ";
const LOAD_SIZES = [0, 1, 3, 0, 8, 2, 16, 1];   // filler repeats (≈ 55 tokens each): short to ~900 tokens

const load = { target: 0, running: new Set(), next: 0, done: 0, errors: 0, active: false };

// The request number comes first so that no two prompts share a prefix: the prefix cache
// would otherwise skip most of the prefill this load is meant to show.
function loadPrompt(k) {
  const repeats = LOAD_SIZES[k % LOAD_SIZES.length];
  return `Request ${k}. ${FILLER.repeat(repeats)}${LOAD_TOPICS[k % LOAD_TOPICS.length]}`;
}

export function renderLoad() {
  $("load-running").textContent = String(load.running.size);
  $("load-done").textContent = String(load.done);
  $("load-errors").textContent = String(load.errors);
  $("load-start").disabled = load.active;
  $("load-stop").disabled = !load.active && load.running.size === 0;
}

function loadOne() {
  if (!load.active || load.running.size >= load.target) return;
  const k = load.next++;
  const id = `load-${k}`;
  const sent = loadChannel.send({
    type: "chat.request", id, messages: [{ role: "user", content: loadPrompt(k) }],
    max_tokens: LOAD_MAX_TOKENS, temperature: 0.8, priority: LOAD_PRIORITY,
  });
  if (sent) load.running.add(id);
}

function fillLoad() {
  while (load.active && loadChannel.ready && load.running.size < load.target) {
    const before = load.running.size;
    loadOne();
    if (load.running.size === before) break;
  }
  renderLoad();
}

function onLoadMessage(msg) {
  if (msg.type === "chat.done" || msg.type === "error") {
    if (msg.id == null || !load.running.has(msg.id)) {
      if (msg.type === "error") { load.errors += 1; $("load-status").textContent = describeError(msg.error).text; }
      renderLoad();
      return;
    }
    load.running.delete(msg.id);
    if (msg.type === "chat.done") {
      load.done += 1;
    } else {
      load.errors += 1;
      const problem = describeError(msg.error);
      $("load-status").textContent = problem.text;
      if (load.active && problem.retryAfter != null) {
        setTimeout(fillLoad, Math.max(250, problem.retryAfter * 1000));
        renderLoad();
        return;
      }
    }
    fillLoad();
    if (!load.active && load.running.size === 0) {
      loadChannel.close();
      $("load-status").textContent = "Load stopped.";
    }
  } else if (msg.type === "socket.closed") {
    load.running.clear();
    renderLoad();
  }
}

const loadChannel = new Channel({
  onReady: fillLoad,
  onMessage: onLoadMessage,
  onState: (state, text) => { if (load.active) $("load-status").textContent = `Load socket: ${text}`; },
});

export function startLoad(key) {
  const n = Math.round(Number($("load-n").value));
  if (!(n >= 1 && n <= LOAD_MAX)) {
    $("load-status").textContent = `Choose between 1 and ${LOAD_MAX} requests.`;
    $("load-n").focus();
    return;
  }
  Object.assign(load, { target: n, active: true });
  if (!loadChannel.ready && loadChannel.stopped) loadChannel.connect(key);
  else fillLoad();
  renderLoad();
}

export function stopLoad() {
  load.active = false;
  for (const id of load.running) loadChannel.send({ type: "chat.cancel", id });
  if (load.running.size === 0) loadChannel.close();
  $("load-status").textContent = load.running.size ? "Stopping…" : "Load stopped.";
  renderLoad();
}

// A new key: drop the load socket and everything on it (the server cancels its requests).
export function resetLoad() {
  load.active = false;
  loadChannel.close();
  load.running.clear();
  $("load-status").textContent = "";
  renderLoad();
}
