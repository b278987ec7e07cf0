// streamgate demo page: chat over /v1/chat/ws (docs in DESIGN.md, "Wire protocols"), the
// live scheduler view (scheduler.js) and the load control (load.js). ES modules, no build
// step. Model text is only ever written with textContent / text nodes, never as HTML.
import { $, Channel, describeError, el, fmtMs } from "./socket.js";
import { drawChart, renderStats } from "./scheduler.js";
import { renderLoad, resetLoad, startLoad, stopLoad } from "./load.js";

const DEMO_KEY = "sg-demo-localhost-only";      // examples/tenants.toml, tenant "demo"
const KEY_STORAGE = "streamgate.apiKey";
const STATS_INTERVAL_MS = 500;

// -- banner (errors, with a countdown when the server says when to retry) -------------------
const banner = {
  timer: null,
  show(text, kind = "error", retryAfter = null, onExpire = null) {
    clearInterval(this.timer);
    const node = $("banner");
    node.dataset.kind = kind;
    node.hidden = false;
    node.textContent = text;
    if (retryAfter == null) return;
    // The ticking number is hidden from screen readers (an alert would re-announce it every
    // second); they hear the wait once, and "You can retry now" when it is over.
    const end = performance.now() + retryAfter * 1000;
    const wait = Math.ceil(retryAfter);
    const once = el("span", "visually-hidden", ` You can retry in ${wait} second${wait === 1 ? "" : "s"}.`);
    const shown = el("span", "countdown");
    shown.setAttribute("aria-hidden", "true");
    node.append(once, shown);
    const tick = () => {
      const left = Math.ceil((end - performance.now()) / 1000);
      if (left > 0) { shown.textContent = ` Retry in ${left} s.`; return; }
      clearInterval(this.timer);
      node.textContent = `${text} You can retry now.`;
      if (onExpire) onExpire();
    };
    tick();
    this.timer = setInterval(tick, 250);
  },
  hide() { clearInterval(this.timer); $("banner").hidden = true; },
};

// -- chat ------------------------------------------------------------------------------------
const chat = {
  history: [],          // committed turns only: [{role, content}]
  pending: null,        // the answer being streamed
  seq: 0,
  coolingDown: false,
};

function readSettings() {
  const num = (id) => { const v = $(id).value.trim(); return v === "" ? null : Number(v); };
  const body = {};
  const maxTokens = num("max-tokens");
  if (maxTokens != null) body.max_tokens = Math.round(maxTokens);
  const temperature = num("temperature");
  if (temperature != null) body.temperature = temperature;
  const priority = num("priority");
  if (priority != null) body.priority = Math.round(priority);
  const deadline = num("deadline");
  if (deadline != null) body.deadline_ms = Math.round(deadline);
  return body;
}

function addBubble(role, text) {
  const item = el("li", `msg ${role}`);
  item.append(el("span", "role", role === "user" ? "You" : "Assistant"));
  const content = el("p", "content", text);
  item.append(content);
  $("messages").append(item);
  $("empty-hint").hidden = true;
  scrollMessages(true);
  return { item, content };
}

function scrollMessages(force) {
  const list = $("messages");
  const nearBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 60;
  if (force || nearBottom) list.scrollTop = list.scrollHeight;     // the list scrolls, not the page
}

function updateChatButtons() {
  const busy = chat.pending !== null;
  $("send").disabled = busy || chat.coolingDown;
  $("stop").disabled = !busy;
}

function send() {
  const text = $("prompt").value;
  if (!text.trim() || chat.pending || chat.coolingDown) return;
  const id = `chat-${++chat.seq}`;
  const messages = [...chat.history, { role: "user", content: text }];
  const request = { type: "chat.request", id, messages, ...readSettings() };
  const tSend = performance.now();
  if (!main.send(request)) {
    banner.show("Not connected to the server yet; wait for “Connected” and send again.");
    return;
  }
  banner.hide();
  $("prompt").value = "";
  addBubble("user", text);
  const answer = addBubble("assistant", "");
  answer.item.classList.add("streaming");
  answer.item.dataset.testid = "answer";
  const node = document.createTextNode("");
  answer.content.append(node);
  chat.pending = { id, userText: text, ...answer, node, tSend, tFirst: null };
  updateChatButtons();
}

function finishAnswer(metaParts, problem) {
  const p = chat.pending;
  if (!p) return;
  chat.pending = null;
  p.item.classList.remove("streaming");
  if (metaParts) {
    const meta = el("div", "meta");
    meta.dataset.testid = "answer-meta";
    for (const [label, value, testid, cls] of metaParts) {
      const span = el("span", cls || "", `${label} `);
      const b = el("b", "", value);
      if (testid) b.dataset.testid = testid;
      span.append(b);
      meta.append(span);
    }
    p.item.append(meta);
  }
  if (problem) {
    const note = el("p", "problem", problem.text);
    note.dataset.kind = problem.kind;
    note.dataset.testid = "answer-error";
    p.item.append(note);
    p.item.classList.add("failed");
  }
  updateChatButtons();
  scrollMessages(false);
  return p;
}

function onChatDone(msg) {
  const p = chat.pending;
  const now = performance.now();
  const usage = msg.usage || {};
  const timings = msg.timings || {};
  const tokens = usage.completion_tokens ?? 0;
  let rate = timings.tokens_per_s;
  if (rate == null && p.tFirst != null && tokens > 1 && now > p.tFirst) rate = (tokens - 1) / ((now - p.tFirst) / 1000);
  const ttft = p.tFirst == null ? "–" : fmtMs(p.tFirst - p.tSend);
  finishAnswer([
    ["TTFT", `${ttft} (server ${fmtMs(timings.ttft_ms)})`, "ttft"],
    ["Speed", rate == null ? "–" : `${rate.toFixed(1)} tok/s`, "rate"],
    ["Tokens", String(tokens), "tokens"],
    ["Finish", msg.finish_reason, "finish-reason", `finish-${msg.finish_reason}`],
    ...(timings.queue_ms != null ? [["Queued", fmtMs(timings.queue_ms), "queue"]] : []),
  ], msg.finish_reason === "deadline" ? { kind: "deadline", text: "The deadline passed." } : null);
  const answerText = p.node.data;
  chat.history.push({ role: "user", content: p.userText }, { role: "assistant", content: answerText });
  $("announce").textContent = `Answer (${msg.finish_reason}, ${tokens} tokens): ${answerText}`;
}

function onChatError(msg) {
  const problem = describeError(msg.error);
  const p = finishAnswer(null, problem);
  if (p && p.node.data === "") p.content.remove();
  if (problem.retryAfter != null) {
    chat.coolingDown = true;
    updateChatButtons();
    banner.show(problem.text, "warn", problem.retryAfter, () => { chat.coolingDown = false; updateChatButtons(); });
  }
  $("announce").textContent = problem.text;
}

function onMainMessage(msg) {
  const mine = chat.pending && msg.id === chat.pending.id;
  switch (msg.type) {
    case "chat.delta":
      if (!mine) return;
      if (chat.pending.tFirst == null) chat.pending.tFirst = performance.now();
      chat.pending.node.appendData(msg.text);
      scrollMessages(false);
      return;
    case "chat.done":
      if (mine) onChatDone(msg);
      return;
    case "error":
      if (mine) onChatError(msg);
      else banner.show(describeError(msg.error).text);
      return;
    case "stats":
      renderStats(msg);
      return;
    case "socket.closed":
      if (chat.pending) finishAnswer(null, { kind: "error", text: "The connection closed before the answer ended." });
      if (msg.code === 1008) banner.show(`The server refused the connection: ${msg.reason || "policy violation"}`);
      else if (msg.code === 1012) banner.show("The server is restarting (close 1012); the page reconnects by itself.", "notice");
      else if (msg.code === 1013) {
        banner.show(`The server is overloaded (close 1013${msg.reason ? `: ${msg.reason}` : ""}); the page reconnects by itself.`, "notice");
      }
      return;
    default:
      return;
  }
}

function setConnState(state, text) {
  const node = $("conn-status");
  node.dataset.state = state;
  node.textContent = text;
}

const main = new Channel({
  onReady: () => {
    if ($("banner").dataset.kind !== "warn") banner.hide();      // a rate-limit countdown outlives a reconnect
    main.send({ type: "stats.subscribe", interval_ms: STATS_INTERVAL_MS });
  },
  onMessage: onMainMessage,
  onState: setConnState,
});

// -- wiring ------------------------------------------------------------------------------------
function currentKey() { return $("api-key").value.trim(); }

function applyKey() {
  const key = currentKey();
  if (!key) { setConnState("rejected", "Enter an API key."); return; }
  try { localStorage.setItem(KEY_STORAGE, key); } catch { /* storage disabled: still connect */ }
  banner.hide();
  if (chat.pending) finishAnswer(null, { kind: "error", text: "Stopped: the connection was replaced." });
  resetLoad();
  main.connect(key);
}

function init() {
  let saved = null;
  try { saved = localStorage.getItem(KEY_STORAGE); } catch { /* ignore */ }
  $("api-key").value = saved || DEMO_KEY;
  // Enter in the key field fires both change and submit: connect once per new key, and
  // reconnect on submit only when no socket is open or opening for this key.
  $("key-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (currentKey() !== main.key || main.ws === null) applyKey();
  });
  $("api-key").addEventListener("change", () => { if (currentKey() !== main.key) applyKey(); });
  $("chat-form").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => { if (chat.pending) main.send({ type: "chat.cancel", id: chat.pending.id }); });
  $("clear").addEventListener("click", () => {
    if (chat.pending) main.send({ type: "chat.cancel", id: chat.pending.id });
    finishAnswer(null, null);
    chat.history = [];
    $("messages").replaceChildren();
    $("empty-hint").hidden = false;
    $("announce").textContent = "Conversation cleared.";
    $("prompt").focus();
  });
  $("load-form").addEventListener("submit", (ev) => { ev.preventDefault(); startLoad(currentKey()); });
  $("load-stop").addEventListener("click", stopLoad);
  window.addEventListener("resize", drawChart);
  renderLoad();
  updateChatButtons();
  drawChart();
  main.connect(currentKey());
}


init();
