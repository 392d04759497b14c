// The playground: chat over /ws/v1/stream with a key kept in sessionStorage only.
// Protocol (docs/api.md): {"type":"auth"} first, then chat.completions / cancel; the
// server answers accepted, token, done or error. Multi-turn resends the whole history.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "playground.api_key";
  const ERROR_TEXT = {
    invalid_api_key: "Invalid API key", queue_full: "The queue is full, try again shortly",
    rate_limited: "Rate limited", rpm_exceeded: "Too many requests this minute",
    tpm_exceeded: "Too many tokens this minute", concurrency_limited: "Too many requests at once",
    budget_exceeded: "The monthly token budget is spent", scheduler_unavailable: "No scheduler serves this model",
    context_length_exceeded: "The conversation is too long for the model's context",
    device_memory_budget_exceeded: "The conversation and max tokens need more KV memory than one request may reserve",
    model_not_found: "Unknown model",
  };
  let history = [];  // [{role, content}] of finished turns
  let socket = null, socketKey = null, current = null, counter = 0;

  $("key").value = sessionStorage.getItem(KEY_STORE) || "";
  $("key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORE, $("key").value.trim());
    loadModels();
  });

  function showError(error, status) {
    const code = error && error.code;
    const label = ERROR_TEXT[code] || code || "Error";
    $("error").textContent = `${label}: ${(error && error.message) || "unknown error"}`
      + (status ? ` (HTTP ${status})` : "");
  }

  async function loadModels() {
    const key = $("key").value.trim();
    if (!key) return;
    const response = await fetch("/v1/models", {headers: {Authorization: "Bearer " + key}});
    const body = await response.json().catch(() => ({}));
    if (!response.ok) { showError(body.error, response.status); return; }
    $("error").textContent = "";
    const chosen = $("model").value;
    $("model").replaceChildren(...body.data.map((m) => new Option(m.id, m.id, false, m.id === chosen)));
  }
  $("load-models").onclick = loadModels;

  function turn(role, text) {
    const node = document.createElement("div");
    node.className = "turn " + role;
    const body = document.createElement("div");
    body.className = "content";
    body.textContent = text;
    const stats = document.createElement("div");
    stats.className = "stats";
    node.append(body, stats);
    $("conversation").append(node);
    return {node, body, stats};
  }

  function connect(key) {
    if (socket && socketKey === key && socket.readyState <= WebSocket.OPEN) return socket.ready;
    if (socket) socket.close();
    const scheme = location.protocol === "https:" ? "wss://" : "ws://";
    socket = new WebSocket(scheme + location.host + "/ws/v1/stream");
    socketKey = key;
    const ws = socket;
    ws.ready = new Promise((resolve, reject) => {
      ws.onopen = () => ws.send(JSON.stringify({type: "auth", api_key: key}));
      ws.onmessage = (event) => {
        const message = JSON.parse(event.data);
        if (message.type === "authenticated") resolve();
        else if (message.type === "error" && message.id === null) { reject(message); }
        else onMessage(message);
      };
      ws.onclose = () => { if (socket === ws) socket = null; reject({error: {message: "connection closed"}}); };
    });
    ws.ready.catch(() => {});
    return ws.ready;
  }

  function onMessage(message) {
    if (!current || message.id !== current.id) return;
    const now = performance.now();
    if (message.type === "accepted") {
      current.requestId = message.request_id;
    } else if (message.type === "token") {
      if (current.firstTokenAt === null) current.firstTokenAt = now;
      current.text += message.text;
      current.tokens += message.n_tokens || 0;
      current.view.body.textContent = current.text;
      $("conversation").scrollTop = $("conversation").scrollHeight;
      showStats(now, null);
    } else if (message.type === "done") {
      showStats(now, message);
      history.push({role: "user", content: current.userText},
                   {role: "assistant", content: current.text});
      finish();
    } else if (message.type === "error") {
      showError(message.error, message.status);
      current.view.stats.textContent += " — failed";
      finish();
    }
  }

  function showStats(now, done) {
    const c = current;
    const ttft = c.firstTokenAt === null ? null : c.firstTokenAt - c.sentAt;
    const genS = c.firstTokenAt === null ? 0 : (now - c.firstTokenAt) / 1000;
    const usage = done ? done.usage || {} : {};
    const cached = (usage.prompt_tokens_details || {}).cached_tokens;
    const parts = [
      "TTFT " + (ttft === null ? "–" : ttft.toFixed(0) + " ms"),
      (genS > 0 ? ((c.tokens - 1) / genS).toFixed(1) : "–") + " tokens/s",
      c.tokens + " tokens",
    ];
    if (done) {
      parts.push(`prompt ${usage.prompt_tokens} tokens, ${cached} cached`,
                 "finish: " + done.finish_reason);
    }
    c.view.stats.textContent = parts.join(" · ");
  }

  function finish() {
    current = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }

  async function send() {
    const key = $("key").value.trim(), text = $("message").value;
    if (!key) { $("error").textContent = "Paste an API key first."; return; }
    if (!text.trim() || current) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("error").textContent = "";
    const messages = [];
    if ($("system").value.trim()) messages.push({role: "system", content: $("system").value});
    messages.push(...history, {role: "user", content: text});
    turn("user", text);
    current = {id: "r" + (++counter), userText: text, text: "", tokens: 0, firstTokenAt: null,
               sentAt: performance.now(), view: turn("assistant", "")};
    $("message").value = "";
    $("send").disabled = true;
    $("stop").disabled = false;
    try {
      await connect(key);
    } catch (refusal) {
      showError(refusal.error, refusal.status);
      current.view.node.remove();
      finish();
      return;
    }
    const request = {type: "chat.completions", id: current.id, model: $("model").value || undefined,
                     messages, max_tokens: Number($("max-tokens").value) || 256,
                     temperature: Number($("temperature").value)};
    if ($("ignore-eos").checked) request.ignore_eos = true;
    current.sentAt = performance.now();
    socket.send(JSON.stringify(request));
  }

  $("send").onclick = send;
  $("stop").onclick = () => {
    if (current && socket) socket.send(JSON.stringify({type: "cancel", id: current.id}));
  };
  $("reset").onclick = () => { history = []; $("conversation").replaceChildren(); };
  loadModels();
})();
