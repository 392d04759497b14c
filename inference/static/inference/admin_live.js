// Live admin pages: poll state.json about once a second and redraw the page's tables.
// Rows are built with textContent only (values come from Redis). No build step.
"use strict";
(function () {
  const root = document.getElementById("live-root");
  const status = document.getElementById("live-status");
  const notice = document.getElementById("live-message");
  const page = root.dataset.page;
  const POLL_MS = 1000;
  const rates = new Map();  // "daemon|slot|request" -> {generated, at, rate}

  function el(tag, props, children) {
    const node = document.createElement(tag);
    Object.assign(node, props || {});
    for (const child of children || []) {
      node.append(child instanceof Node ? child : String(child ?? "–"));
    }
    return node;
  }
  const num = (v) => (v === null || v === undefined ? "–" : Number(v).toLocaleString());
  const secs = (ms) => (ms === null || ms === undefined ? "–" : (ms / 1000).toFixed(1) + " s");
  const mb = (b) => (b / 1048576).toFixed(1) + " MB";

  function table(headers, rows, emptyText) {
    const head = el("tr", {}, headers.map(([label, cls]) => el("th", {className: cls || ""}, [label])));
    const body = rows.map((cells) => el("tr", {}, cells.map((cell) => {
      const isNum = typeof cell === "number";
      return el("td", {className: isNum ? "num" : ""}, [isNum ? num(cell) : cell]);
    })));
    if (!rows.length) {
      body.push(el("tr", {}, [el("td", {colSpan: headers.length}, [emptyText])]));
    }
    return el("table", {}, [el("thead", {}, [head]), el("tbody", {}, body)]);
  }

  function button(label, fields, confirmText) {
    return el("button", {type: "button", className: "button", textContent: label, onclick: () => {
      if (confirmText && !window.confirm(confirmText)) return;
      act(fields);
    }});
  }

  async function act(fields) {
    const csrf = document.querySelector("#live-csrf [name=csrfmiddlewaretoken]").value;
    const response = await fetch(root.dataset.actionUrl, {
      method: "POST", credentials: "same-origin",
      headers: {"X-CSRFToken": csrf}, body: new URLSearchParams(fields),
    });
    const reply = await response.json().catch(() => ({message: "HTTP " + response.status}));
    notice.textContent = reply.message;
    notice.className = reply.ok ? "success" : "errornote";
    refresh();
  }

  function tokensPerSecond(slot) {
    if (!slot.request_id || slot.state !== "generating") return null;
    const key = slot.daemon_id + "|" + slot.id + "|" + slot.request_id;
    const seen = rates.get(key);
    const now = {generated: slot.generated_tokens || 0, at: slot.heartbeat_at, rate: null};
    if (seen && now.at > seen.at) {
      now.rate = (now.generated - seen.generated) / (now.at - seen.at);
    } else if (seen) {
      Object.assign(now, seen);  // same snapshot as last poll: keep its rate
    }
    rates.set(key, now);
    return now.rate === null ? null : Math.round(now.rate * 10) / 10;
  }

  const cancel = (id) => button("Cancel", {action: "cancel", request_id: id});
  const draw = {
    queue: (s) => [table(
      [["Daemon"], ["Request id"], ["Tenant"], ["Prompt tokens", "num"], ["Max tokens", "num"],
       ["Age", "num"], [""]],
      s.queue.map((q) => [q.daemon_id,
                          q.preempted ? `${q.request_id} (preempted after ${q.output_tokens} tokens)`
                                      : q.request_id,
                          q.tenant, q.prompt_tokens, q.max_tokens,
                          q.preempted ? "–" : secs(q.age_ms), cancel(q.request_id)]),
      "No request is waiting.")],
    slots: (s) => [table(
      [["Daemon"], ["Slot", "num"], ["State"], ["Request id"], ["Tenant"], ["Tokens in KV", "num"],
       ["Cached prefix", "num"], ["Prompt", "num"], ["Generated", "num"], ["Tokens/s", "num"], [""]],
      s.slots.map((x) => [x.daemon_id, x.id, el("span", {className: "state-" + x.state}, [x.state]),
                          x.request_id || "–", x.request_id ? x.tenant : "–", x.kv_tokens,
                          x.cached_tokens, x.prompt_tokens, x.generated_tokens, tokensPerSecond(x),
                          x.request_id ? cancel(x.request_id) : ""]),
      "No live daemon.")],
    cache: (s) => s.daemons.flatMap((d) => [
      el("h2", {}, [`${d.daemon_id}: RAM ${mb(d.cache.ram_bytes || 0)} of ${mb(d.cache.ram_budget_bytes || 0)}`
                    + ` budget, ${num(d.cache.ram_entries || 0)} RAM entries`]),
      table([["Tier"], ["Slot", "num"], ["Tenant"], ["Tokens", "num"], ["Bytes", "num"],
             ["Hits", "num"], ["Last used"], [""]],
            s.cache.filter((e) => e.daemon_id === d.daemon_id).map((e) => [
              e.tier, e.slot ?? "–", e.tenant, e.tokens, e.bytes, e.hits,
              e.age_ms ? secs(e.age_ms) + " ago" : "in use",
              e.cache_scope ? button("Evict tenant", {action: "evict_scope", daemon_id: d.daemon_id,
                                     tenant_id: e.cache_scope},
                                     `Evict every cache entry of ${e.tenant} on ${d.daemon_id}?`) : ""]),
            "Nothing cached.")]).concat(s.daemons.length ? [] : [el("p", {}, ["No live daemon."])]),
    quarantine: (s) => [table(
      [["Fingerprint"], ["Request id"], ["Tenant"], ["Model"], ["Kind"], ["Deaths", "num"],
       ["Last daemon"], ["Since"], [""]],
      s.quarantine.map((q) => [q.fingerprint.slice(0, 12), q.request_id, q.tenant, q.model, q.kind,
                               q.deaths, q.last_daemon, new Date(q.at * 1000).toLocaleString(),
                               button("Release", {action: "release", fingerprint: q.fingerprint},
                                      "Let this request run again? It was running at two " +
                                      "separate daemon deaths (crashes or hangs).")]),
      "No request is quarantined.")],
    daemons: (s) => [table(
      [["Daemon"], ["Model"], ["Host / pid"], ["Heartbeat", "num"], ["Uptime", "num"], ["State"],
       ["Slots busy"], ["Queue", "num"], ["Held / capacity"], ["Routed waiting", "num"],
       ["Routed", "num"], ["Affinity hits", "num"], ["Tenant shares"],
       ["KV blocks"], ["Settings"], ["Requests", "num"],
       ["Prompt / completion tokens"], ["Hit ratio", "num"], ["KV pressure", "num"],
       ["Refusals", "num"], [""]],
      s.daemons.map((d) => {
        const c = d.config;
        return [d.daemon_id, d.model, `${d.host} / ${d.pid}`, d.heartbeat_age_s.toFixed(1) + " s ago",
                d.uptime_s + " s",
                el("span", {className: d.stuck || d.draining ? "draining" : ""},
                   [d.stuck ? `stuck (no loop turn for ${d.loop_stalled_s} s)`
                            : d.draining ? "draining" : "serving",
                    d.restarts ? ` · restarted ${d.restarts}× (last: ${d.last_exit})` : ""]),
                `${d.slots_busy} / ${d.slots_total}`, d.queue_depth,
                d.capacity === undefined ? "–" : `${d.held} / ${d.capacity}`,
                d.routed_waiting ?? "–", d.routed ?? "–", d.affinity_hits ?? "–",
                Object.entries(d.tenant_shares || {})
                  .map(([t, share]) => `${t} ${(share * 100).toFixed(0)} %`).join(", ") || "–",
                `${num(d.kv.blocks_used)} / ${num(d.kv.blocks_total)}`,
                `n_parallel ${c.n_parallel}, n_ctx ${c.n_ctx}, chunk ${c.chunk_size}, `
                + `max_queue ${c.max_queue}, cache_prompt ${c.cache_prompt}, RAM cache ${c.prompt_cache_ram_mb} MB`,
                d.requests, `${num(d.prompt_tokens)} / ${num(d.completion_tokens)}`,
                d.hit_ratio === null ? "–" : (d.hit_ratio * 100).toFixed(1) + " %",
                d.kv_pressure, d.refusals,
                d.draining ? button("Resume", {action: "resume", daemon_id: d.daemon_id})
                           : button("Drain", {action: "drain", daemon_id: d.daemon_id},
                                    `Drain ${d.daemon_id}? It stops taking new requests.`)];
      }),
      "No live daemon.")],
  };

  async function refresh() {
    try {
      const response = await fetch(root.dataset.stateUrl, {credentials: "same-origin"});
      if (!response.ok) throw new Error("HTTP " + response.status);
      const state = await response.json();
      root.replaceChildren(...draw[page](state));
      status.textContent = `${state.daemons.length} live daemon(s); updated `
        + new Date(state.now * 1000).toLocaleTimeString();
    } catch (error) {
      status.textContent = "Could not refresh: " + error.message;
    }
  }
  refresh();
  setInterval(refresh, POLL_MS);
})();
