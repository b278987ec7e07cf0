// The WebSocket side of the demo page: one authenticated socket to /v1/chat/ws that
// reconnects with backoff, and how the gateway's errors and close codes read to a person.

export const WS_URL = `${location.protocol === "https:" ? "wss:" : "ws:"}//${location.host}/v1/chat/ws`;

export const $ = (id) => document.getElementById(id);
export const el = (tag, cls, text) => {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
};
export const fmtMs = (ms) => (ms == null ? "–" : ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${Math.round(ms)} ms`);

// One authenticated socket: sends `auth` on open, calls onReady(tenant) on auth.ok and
// onMessage(msg) for everything else, plus a synthetic {type: "socket.closed", code, reason}.
// Close codes: 1008 policy (wrong key: no retry until the key changes), 1012 server
// restarting, 1013 overloaded; anything else is a dropped connection. All but 1008 retry.
export class Channel {
  constructor({ onReady, onMessage, onState }) {
    Object.assign(this, { onReady, onMessage, onState });
    this.ws = null;
    this.key = null;
    this.ready = false;
    this.attempt = 0;
    this.timer = null;
    this.stopped = true;
  }

  connect(key) {
    this.close();
    this.key = key;
    this.stopped = false;
    this.attempt = 0;
    this._open();
  }

  _open() {
    clearTimeout(this.timer);
    this.onState("connecting", "Connecting…");
    const ws = new WebSocket(WS_URL);
    this.ws = ws;
    ws.onopen = () => ws.send(JSON.stringify({ type: "auth", api_key: this.key }));
    ws.onmessage = (ev) => {
      let msg;
      try { msg = JSON.parse(ev.data); } catch { return; }
      if (msg.type === "auth.ok") {
        this.ready = true;
        this.attempt = 0;
        this.onState("open", `Connected as tenant “${msg.tenant}”`);
        this.onReady(msg.tenant);
      } else {
        this.onMessage(msg);
      }
    };
    ws.onclose = (ev) => {
      if (this.ws !== ws) return;            // an old socket we replaced
      this.ws = null;
      this.ready = false;
      this.onMessage({ type: "socket.closed", code: ev.code, reason: ev.reason });
      if (this.stopped) return;
      if (ev.code === 1008) {
        this.onState("rejected", `Rejected: ${ev.reason || "policy violation"}. Fix the key and press Connect.`);
        return;
      }
      const delay = Math.min(15_000, 500 * 2 ** this.attempt) * (0.8 + Math.random() * 0.4);
      this.attempt += 1;
      const why = ev.code === 1012 ? "Server restarting"
        : ev.code === 1013 ? `Server overloaded${ev.reason ? ` (${ev.reason})` : ""}`
        : ev.code === 1009 ? "A message was too large"
        : ev.code === 1011 ? "Server error"
        : "Connection lost";
      this.onState("retrying", `${why}; reconnecting in ${(delay / 1000).toFixed(1)} s…`);
      this.timer = setTimeout(() => this._open(), delay);
    };
  }

  send(obj) {
    if (!this.ready || !this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(obj));
    return true;
  }

  close() {
    this.stopped = true;
    clearTimeout(this.timer);
    const ws = this.ws;
    this.ws = null;
    this.ready = false;
    if (!ws) return;
    ws.onmessage = null;
    // Closing a socket that is still connecting makes the browser log a warning: let it open first.
    if (ws.readyState === WebSocket.CONNECTING) ws.onopen = () => ws.close(1000, "client closed");
    else if (ws.readyState === WebSocket.OPEN) ws.close(1000, "client closed");
  }
}

// An error event's body → {kind, text, retryAfter?} for the page.
export function describeError(error) {
  const e = error || {};
  if (e.type === "rate_limit_error") {
    return { kind: "rate_limit", text: `Rate limited (${e.code}): ${e.message}`, retryAfter: e.retry_after ?? null };
  }
  if (e.code === "deadline_exceeded") return { kind: "deadline", text: `Deadline passed: ${e.message}` };
  if (e.code === "engine_overloaded") {
    return { kind: "overloaded", text: `Server overloaded: ${e.message}`, retryAfter: e.retry_after ?? null };
  }
  if (e.code === "server_draining") return { kind: "draining", text: `Server restarting: ${e.message}` };
  return { kind: "error", text: `Error${e.code ? ` (${e.code})` : ""}: ${e.message || "unknown error"}` };
}

