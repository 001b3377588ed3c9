// The outbox dashboard: a page over the admin API (/api/…, described by /api/openapi.json).
// No build step and nothing fetched from elsewhere: this file, app.css and index.html are all.
"use strict";

const STATES = ["PENDING", "SENT", "CONFIRMED", "FAILED", "REJECTED", "PREPARED", "ROLLED_BACK", "UNDECIDED"];
const main = document.getElementById("main");
const tokenInput = document.getElementById("token");
tokenInput.value = sessionStorage.getItem("outbox-token") || "";
tokenInput.addEventListener("change", () => sessionStorage.setItem("outbox-token", tokenInput.value));

function esc(s) {
  return String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (tokenInput.value) h["Authorization"] = "Bearer " + tokenInput.value;
  return h;
}

// The page being drawn: a newer route aborts the reads of the one before, so a page whose
// answer comes late never replaces the page shown after it (actions, which POST, run on).
let drawing = new AbortController();

async function api(path, body) {
  const init = body === undefined
    ? { headers: headers(false), signal: drawing.signal }
    : { method: "POST", headers: headers(true), body: JSON.stringify(body) };
  const r = await fetch(path, init);
  let data = null;
  try { data = await r.json(); } catch (e) { if (e.name === "AbortError") throw e; /* not JSON */ }
  if (!r.ok) throw new Error((data && data.error) || `${r.status} ${r.statusText}`);
  return data;
}

function toast(text, error) {
  const t = document.getElementById("toast");
  t.textContent = text;
  t.className = "toast" + (error ? " error" : "");
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, 6000);
}

function confirmDialog(title, text) {
  return new Promise((resolve) => {
    const m = document.getElementById("modal");
    document.getElementById("modal-title").textContent = title;
    document.getElementById("modal-text").textContent = text;
    m.hidden = false;
    const done = (v) => { m.hidden = true; ok.onclick = cancel.onclick = null; resolve(v); };
    const ok = document.getElementById("modal-ok");
    const cancel = document.getElementById("modal-cancel");
    ok.onclick = () => done(true);
    cancel.onclick = () => done(false);
  });
}

function badge(state, number) {
  const s = state || "unknown";
  return `<span class="badge b-${esc(s)}">${esc(state || "status " + number)}</span>`;
}

function when(t) {
  return t ? esc(t.replace("T", " ").replace(/\.\d+/, "").replace("Z", " UTC").replace("+00:00", " UTC")) : "";
}

function age(seconds) {
  if (seconds == null) return "–";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 120) return `${seconds.toFixed(1)} s`;
  if (seconds < 7200) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}

function setNav(name) {
  document.querySelectorAll("header nav a").forEach((a) => a.classList.toggle("active", a.dataset.nav === name));
}

function showError(e) {
  main.innerHTML = `<div class="error-box">${esc(e.message)}</div>`;
}

async function overview() {
  setNav("overview");
  const o = await api("api/overview");
  const cards = STATES.filter((s) => (o.counts[s] || 0) > 0 || ["PENDING", "SENT", "FAILED"].includes(s))
    .map((s) => `<a class="card" href="#/messages?state=${s}" data-state="${s}">
        <div class="label c-${s}">${s}</div><div class="n">${(o.counts[s] || 0).toLocaleString()}</div></a>`).join("");
  const topics = o.topics.map((t) => `<tr><td><a href="#/messages?topic=${encodeURIComponent(t.topic)}">${esc(t.topic)}</a></td>
      ${STATES.map((s) => `<td class="num">${t.counts[s] ? `<a href="#/messages?topic=${encodeURIComponent(t.topic)}&state=${s}">${t.counts[s].toLocaleString()}</a>` : ""}</td>`).join("")}</tr>`).join("");
  main.innerHTML = `<h1>Overview</h1>
    <div class="cards" id="state-cards">${cards}</div>
    <h2>Backlog</h2>
    <div class="cards">
      <div class="card"><div class="label">Oldest due PENDING</div><div class="n" id="oldest-pending">${age(o.oldest_pending_age_seconds)}</div></div>
      <div class="card"><div class="label">SENT awaiting confirmation</div><div class="n">${o.awaiting_confirmation.toLocaleString()}</div></div>
      <div class="card"><div class="label">Oldest unconfirmed</div><div class="n">${age(o.oldest_unconfirmed_age_seconds)}</div></div>
    </div>
    <h2>Last hour</h2>
    <div id="charts" class="charts"><p class="muted">Loading…</p></div>
    <h2>Topics</h2>
    <table><thead><tr><th>Topic</th>${STATES.map((s) => `<th class="num">${s}</th>`).join("")}</tr></thead>
    <tbody>${topics || `<tr><td colspan="7" class="muted">No messages.</td></tr>`}</tbody></table>`;
  await charts();
}

// An SVG chart of `series` ({name, cls, values}) over `points` (x = time): bars for the first
// series when `bars`, lines otherwise; the y axis from 0 to the largest value, labelled with `fmt`.
function chart(id, title, points, series, fmt, bars) {
  const W = 560, H = 180, L = 56, R = 8, T = 10, B = 24;
  // The time axis ends at the last point and spans at least 5 minutes (an hour once full).
  const t1 = points.length ? Date.parse(points[points.length - 1].at) : Date.now();
  const first = points.length ? Date.parse(points[0].at) - points[0].seconds * 1000 : t1;
  const t0 = Math.min(first, t1 - 300000);
  const max = Math.max(1e-9, ...series.flatMap((s) => s.values.filter((v) => v != null)));
  const xt = (t) => L + ((t - t0) / (t1 - t0)) * (W - L - R);
  const x = (i) => xt(Date.parse(points[i].at));
  const y = (v) => T + (1 - v / max) * (H - T - B);
  const shapes = series.map((s, k) => {
    if (bars && k === 0) {
      return s.values.map((v, i) => {
        if (!v) return "";
        const right = x(i);
        const left = Math.max(L + 1, xt(Date.parse(points[i].at) - points[i].seconds * 1000));
        const w = Math.max(1, right - left - 0.5);
        return `<rect class="${s.cls}" x="${(right - w).toFixed(1)}" y="${y(v).toFixed(1)}" width="${w.toFixed(1)}" height="${(H - B - y(v)).toFixed(1)}"></rect>`;
      }).join("");
    }
    const pts = s.values.map((v, i) => (v == null ? null : [x(i).toFixed(1), y(v).toFixed(1)])).filter(Boolean);
    const dots = pts.map(([px, py]) => `<circle class="${s.cls}" cx="${px}" cy="${py}" r="2"></circle>`).join("");
    return (pts.length > 1 ? `<polyline class="${s.cls}" points="${pts.map((p) => p.join(",")).join(" ")}"></polyline>` : "") + dots;
  }).join("");
  const ago = (ms) => (ms >= 60000 ? `${Math.round(ms / 60000)} min before` : `${Math.round(ms / 1000)} s before`);
  const legend = series.map((s) => `<span class="key ${s.cls}">${esc(s.name)}</span>`).join(" ");
  return `<figure class="chart" id="${id}"><figcaption>${esc(title)} ${legend}</figcaption>
    <svg viewBox="0 0 ${W} ${H}" width="${W}" height="${H}" role="img" aria-label="${esc(title)}">
      <line class="axis" x1="${L}" y1="${H - B}" x2="${W - R}" y2="${H - B}"></line>
      <line class="axis" x1="${L}" y1="${T}" x2="${L}" y2="${H - B}"></line>
      <text x="${L - 6}" y="${T + 10}" text-anchor="end">${esc(fmt(max))}</text>
      <text x="${L - 6}" y="${H - B}" text-anchor="end">0</text>
      <text x="${L}" y="${H - 6}">${ago(t1 - t0)}</text>
      <text x="${W - R}" y="${H - 6}" text-anchor="end">last sample</text>
      ${shapes}
    </svg></figure>`;
}

async function charts() {
  const box = document.getElementById("charts");
  if (!box) return;
  let s;
  try {
    s = await api("api/series");
  } catch (e) {
    box.innerHTML = `<p class="muted">${esc(e.message)}</p>`;
    return;
  }
  const p = s.points;
  if (p.length === 0) {
    box.innerHTML = `<p class="muted">No sample yet: the relay samples its counters every ${s.interval_seconds} s.</p>`;
    return;
  }
  const rate = (k) => p.map((x) => x[k] / Math.max(x.seconds, 1e-9));
  const ms = (k) => p.map((x) => (x[k] == null ? null : x[k] * 1000));
  const total = p.reduce((a, x) => a + x.published, 0);
  box.innerHTML = chart("chart-throughput", `Published: ${total.toLocaleString()} messages`, p,
      [{ name: "published/s", cls: "s-pub", values: rate("published") },
       { name: "dead-lettered/s", cls: "s-dead", values: rate("dead_lettered") }],
      (v) => (v >= 100 ? Math.round(v).toLocaleString() : v.toFixed(1)) + "/s", true)
    + chart("chart-latency", "Commit → ack latency", p,
      [{ name: "p50", cls: "s-p50", values: ms("latency_p50") },
       { name: "p99", cls: "s-p99", values: ms("latency_p99") }],
      (v) => (v >= 10 ? Math.round(v) : v.toFixed(1)) + " ms", false);
}

const FILTER_KEYS = ["state", "topic", "key", "message_id", "error", "created_after", "created_before"];

function filterToBody(params) {
  const f = {};
  if (params.get("state")) f.states = params.get("state").split(",");
  if (params.get("topic")) f.topic = params.get("topic");
  if (params.get("key")) f.partition_key = params.get("key");
  if (params.get("message_id")) f.message_id = params.get("message_id");
  if (params.get("error")) f.error = params.get("error");
  if (params.get("created_after")) f.created_after = params.get("created_after");
  if (params.get("created_before")) f.created_before = params.get("created_before");
  return f;
}

async function messages(query) {
  setNav("messages");
  const params = new URLSearchParams(query);
  const apiParams = new URLSearchParams();
  FILTER_KEYS.concat(["before"]).forEach((k) => { if (params.get(k)) apiParams.set(k, params.get(k)); });
  apiParams.set("limit", params.get("limit") || "50");
  const page = await api("api/messages?" + apiParams.toString());
  const chosen = new Set((params.get("state") || "").split(",").filter(Boolean));
  const v = (k) => esc(params.get(k) || "");
  const rows = page.messages.map((m) => `<tr data-id="${m.id}">
      <td><input type="checkbox" class="pick" value="${m.id}" aria-label="select ${m.id}"></td>
      <td class="num"><a href="#/messages/${m.id}">${m.id}</a></td>
      <td>${badge(m.status, m.status_number)}</td>
      <td>${esc(m.topic)}</td><td>${esc(m.partition_key || "")}</td>
      <td class="num">${m.attempts}</td><td>${when(m.created_at)}</td>
      <td><span class="err" title="${esc(m.last_error || "")}">${esc(m.last_error || "")}</span></td></tr>`).join("");
  main.innerHTML = `<h1>Messages</h1>
    <form class="filters" id="filters">
      <div class="states">State:
        ${STATES.map((s) => `<label><input type="checkbox" name="state" value="${s}" ${chosen.has(s) ? "checked" : ""}> ${s}</label>`).join("")}
      </div>
      <label>Topic (glob) <input name="topic" value="${v("topic")}" placeholder="orders.*"></label>
      <label>Partition key <input name="key" value="${v("key")}" placeholder="order id"></label>
      <label>Message id <input name="message_id" value="${v("message_id")}"></label>
      <label>Error contains <input name="error" value="${v("error")}"></label>
      <label>Created after (RFC 3339) <input name="created_after" value="${v("created_after")}" placeholder="2026-12-01T00:00:00Z"></label>
      <label>Created before (RFC 3339) <input name="created_before" value="${v("created_before")}"></label>
      <div class="row-end"><button class="primary" type="submit" id="search">Search</button>
        <button type="button" id="clear">Clear</button></div>
    </form>
    <div class="actions">
      <span class="muted" id="picked">0 selected</span>
      <button type="button" data-action="requeue" data-scope="ids" disabled>Requeue selected</button>
      <button type="button" data-action="publish-now" data-scope="ids" disabled>Publish selected now</button>
      <button type="button" data-action="discard" data-scope="ids" class="danger" disabled>Discard selected</button>
      <button type="button" data-action="resume" data-scope="ids" disabled>Resume selected</button>
      <span class="muted">|</span>
      <button type="button" data-action="requeue" data-scope="filter">Requeue all matching</button>
      <button type="button" data-action="discard" data-scope="filter">Discard all matching</button>
    </div>
    <table id="results"><thead><tr><th><input type="checkbox" id="pick-all" aria-label="select all"></th><th class="num">Id</th><th>State</th><th>Topic</th><th>Key</th><th class="num">Att.</th><th>Created</th><th>Last error</th></tr></thead>
    <tbody>${rows || `<tr><td colspan="8" class="muted">No messages match.</td></tr>`}</tbody></table>
    <div class="pager">
      ${params.get("before") ? `<button type="button" id="first">First page</button>` : ""}
      ${page.next ? `<button type="button" id="next">Next page</button>` : `<span class="muted">${page.messages.length} shown, end of results</span>`}
      <span class="muted" id="order">newest first by ${page.order === "created_at" ? "creation time" : page.order === "sent_at" ? "publication time" : "id"}</span>
    </div>`;

  const form = document.getElementById("filters");
  form.onsubmit = (ev) => {
    ev.preventDefault();
    const q = new URLSearchParams();
    const states = [...form.querySelectorAll("input[name=state]:checked")].map((i) => i.value);
    if (states.length) q.set("state", states.join(","));
    ["topic", "key", "message_id", "error", "created_after", "created_before"].forEach((k) => {
      const val = form.elements[k].value.trim();
      if (val) q.set(k, val);
    });
    location.hash = "#/messages?" + q.toString();
  };
  document.getElementById("clear").onclick = () => { location.hash = "#/messages"; };
  const next = document.getElementById("next");
  if (next) next.onclick = () => { params.set("before", page.next); location.hash = "#/messages?" + params.toString(); };
  const first = document.getElementById("first");
  if (first) first.onclick = () => { params.delete("before"); location.hash = "#/messages?" + params.toString(); };

  const picks = () => [...document.querySelectorAll("input.pick:checked")].map((i) => Number(i.value));
  const refresh = () => {
    const n = picks().length;
    document.getElementById("picked").textContent = `${n} selected`;
    document.querySelectorAll("button[data-scope=ids]").forEach((b) => { b.disabled = n === 0; });
  };
  document.querySelectorAll("input.pick").forEach((i) => { i.onchange = refresh; });
  document.getElementById("pick-all").onchange = (ev) => {
    document.querySelectorAll("input.pick").forEach((i) => { i.checked = ev.target.checked; });
    refresh();
  };
  document.querySelectorAll("button[data-action]").forEach((b) => {
    b.onclick = async () => {
      const action = b.dataset.action;
      const body = b.dataset.scope === "ids" ? { ids: picks() } : { filter: filterToBody(params) };
      const what = b.dataset.scope === "ids" ? `${body.ids.length} selected message(s)` : "every message the current filter matches";
      await act(action, body, what);
    };
  });
}

async function act(action, body, what) {
  const verbs = { requeue: "Requeue", "publish-now": "Publish now", discard: "Discard", resume: "Resume" };
  const notes = {
    requeue: "FAILED, REJECTED and SENT messages go back to PENDING and are published again.",
    "publish-now": "Delayed PENDING messages become due now.",
    discard: "FAILED messages move to the archive table.",
    resume: "UNDECIDED two-phase messages are checked back again, with a fresh budget of checks.",
  };
  if (!(await confirmDialog(`${verbs[action]} ${what}?`, notes[action]))) return;
  try {
    const r = await api(`api/messages/${action}`, body);
    const lines = [`${verbs[action]}: ${r.changed} changed`].concat(r.not_changed.map((n) => `id ${n.id}: ${n.reason}`));
    toast(lines.join("\n"), r.not_changed.length > 0);
    route();
  } catch (e) {
    toast(e.message, true);
  }
}

async function detail(id) {
  setNav("messages");
  const m = await api(`api/messages/${encodeURIComponent(id)}`);
  const fields = [
    ["Row id", m.id], ["Message id", m.message_id], ["State", badge(m.status, m.status_number)],
    ["Topic", esc(m.topic)], ["Partition key", esc(m.partition_key || "–")],
    ["Attempts", `${m.attempts}${m.max_attempts ? " of " + m.max_attempts : ""}`],
    ["Check-backs", m.check_backs], ["Redelivery", m.redelivery],
    ["Created", when(m.created_at)], ["Available", when(m.available_at)], ["Sent", when(m.sent_at)],
    ["Confirmed", when(m.confirmed_at)], ["Confirm deadline", when(m.confirm_deadline)], ["Updated", when(m.updated_at)],
    ["Last error", `<span class="c-FAILED">${esc(m.last_error || "–")}</span>`],
  ].concat(m.check_back ? [["Check-back", `<code>${esc(m.check_back)}</code>`]] : []);
  const hdrs = Object.entries(m.headers).map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("");
  main.innerHTML = `<h1>Message ${m.id} ${badge(m.status, m.status_number)}</h1>
    <div class="actions">
      <button type="button" data-one="requeue">Requeue</button>
      <button type="button" data-one="publish-now">Publish now</button>
      <button type="button" data-one="discard" class="danger">Discard</button>
      ${m.status === "UNDECIDED" ? `<button type="button" data-one="resume">Resume check-backs</button>` : ""}
      <a href="#/messages">Back to messages</a>
    </div>
    <dl class="fields">${fields.map(([k, v]) => `<dt>${k}</dt><dd>${v === "" ? "–" : v}</dd>`).join("")}</dl>
    <h2>Headers</h2>
    ${m.headers_error ? `<div class="error-box">${esc(m.headers_error)}<br><code>${esc(m.headers_raw)}</code></div>` : ""}
    <table><thead><tr><th>Name</th><th>Value</th></tr></thead><tbody>${hdrs || `<tr><td colspan="2" class="muted">None.</td></tr>`}</tbody></table>
    <h2>Payload <span class="muted">(${esc(m.payload.kind)}, ${m.payload.bytes} bytes)</span></h2>
    <pre id="payload">${esc(m.payload.text)}</pre>`;
  document.querySelectorAll("button[data-one]").forEach((b) => {
    b.onclick = () => act(b.dataset.one, { ids: [m.id] }, `message ${m.id}`);
  });
}

async function relays() {
  setNav("relays");
  const r = await api("api/relays");
  const now = r.now ? Date.parse(r.now) : Date.now();
  const ago = (t) => (t ? `${((now - Date.parse(t)) / 1000).toFixed(1)} s ago` : "–");
  const live = (b) => b.expires_at && Date.parse(b.expires_at) > now;
  const rows = r.relays.map((x) => {
    const alive = x.heartbeat_at && now - Date.parse(x.heartbeat_at) < r.lease_seconds * 1000;
    const held = r.buckets.filter((b) => b.owner === x.name && live(b)).length;
    return `<tr><td>${esc(x.name)}</td><td>${alive ? '<span class="badge b-CONFIRMED">alive</span>' : '<span class="badge b-unknown">gone</span>'}</td>
      <td>${ago(x.heartbeat_at)}</td><td class="num">${held}</td><td>${esc(x.routes || "(not advertised)")}</td></tr>`;
  }).join("");
  // Consecutive buckets with the same lease (owner, token, hand-off) as one row.
  const groups = [];
  for (const b of r.buckets) {
    const owner = live(b) ? b.owner : null;
    const last = groups[groups.length - 1];
    if (last && last.owner === owner && last.token === (owner ? b.token : null) && last.handoff === b.handoff) {
      last.to = b.bucket;
      last.takeovers += b.takeovers;
      if (b.expires_at && (!last.expires || Date.parse(b.expires_at) < Date.parse(last.expires))) last.expires = b.expires_at;
    } else {
      groups.push({ from: b.bucket, to: b.bucket, owner, token: owner ? b.token : null, handoff: b.handoff, takeovers: b.takeovers, expires: b.expires_at });
    }
  }
  const cells = groups.map((g) => `<tr><td class="num">${g.from === g.to ? g.from : `${g.from}–${g.to}`}</td><td class="num">${g.to - g.from + 1}</td>
      <td>${esc(g.owner || "(none)")}</td><td class="num">${esc(g.token ?? "")}</td>
      <td>${g.owner ? `in ${((Date.parse(g.expires) - now) / 1000).toFixed(1)} s` : "expired or never leased"}</td>
      <td class="num">${g.takeovers}</td><td>${esc(g.handoff || "")}</td></tr>`).join("");
  main.innerHTML = `<h1>Relays</h1>
    <table id="relays"><thead><tr><th>Name</th><th>State</th><th>Heartbeat</th><th class="num">Buckets held</th><th>Routes</th></tr></thead>
    <tbody>${rows || `<tr><td colspan="5" class="muted">No relay has joined.</td></tr>`}</tbody></table>
    <h2>Buckets</h2>
    <table id="buckets"><thead><tr><th class="num">Buckets</th><th class="num">Count</th><th>Owner</th><th class="num">Fencing token</th><th>Lease ends</th><th class="num">Takeovers</th><th>Hand-off to</th></tr></thead>
    <tbody>${cells}</tbody></table>`;
}

async function keys() {
  setNav("keys");
  const r = await api("api/keys/blocked");
  const rows = r.keys.map((k) => `<tr><td>${esc(k.key)}</td><td class="num"><a href="#/messages/${k.held_by}">${k.held_by}</a></td>
      <td>${when(k.since)}</td><td class="num">${k.waiting}</td>
      <td><span class="err" title="${esc(k.last_error || "")}">${esc(k.last_error || "")}</span></td>
      <td><button type="button" data-key-action="requeue" data-id="${k.held_by}">Requeue head</button>
          <button type="button" data-key-action="discard" data-id="${k.held_by}" class="danger">Discard head</button></td></tr>`).join("");
  main.innerHTML = `<h1>Blocked keys</h1>
    <p class="muted">Partition keys whose dead letter holds later messages back (routes with <code>dead_letter = "block"</code>).</p>
    <table id="keys"><thead><tr><th>Key</th><th class="num">Held by</th><th>Since</th><th class="num">Waiting</th><th>Reason</th><th></th></tr></thead>
    <tbody>${rows || `<tr><td colspan="6" class="muted">No key is held back.</td></tr>`}</tbody></table>`;
  document.querySelectorAll("button[data-key-action]").forEach((b) => {
    b.onclick = () => act(b.dataset.keyAction, { ids: [Number(b.dataset.id)] }, `message ${b.dataset.id}`);
  });
}

async function inboxAct(action, consumer, ids, nextHash) {
  const notes = {
    replay: "The consumer's runner runs them again with its handler, within its maintenance interval.",
    discard: "The dead letters are deleted; the inbox keeps their rejected verdict.",
  };
  const verb = action === "replay" ? "Replay" : "Discard";
  if (!(await confirmDialog(`${verb} ${ids.length} dead letter(s) of ${consumer}?`, notes[action]))) return;
  try {
    const r = await api(`api/inbox/${action}`, { consumer, message_ids: ids });
    const lines = [`${verb}: ${r.changed} changed`].concat(r.not_changed.map(([id, why]) => `${id}: ${why}`));
    toast(lines.join("\n"), r.not_changed.length > 0);
    if (nextHash && location.hash !== nextHash) location.hash = nextHash;
    else route();
  } catch (e) {
    toast(e.message, true);
  }
}

async function inbox(query) {
  setNav("inbox");
  const params = new URLSearchParams(query);
  const consumer = params.get("consumer") || "";
  const c = await api("api/inbox");
  const r = await api(`api/inbox/dead-letters?limit=200${consumer ? "&consumer=" + encodeURIComponent(consumer) : ""}`);
  const consumers = c.consumers.map((x) => `<tr><td><a href="#/inbox?consumer=${encodeURIComponent(x.consumer)}">${esc(x.consumer)}</a></td>
      <td class="num">${x.dead_letters}</td><td class="num">${x.replay_requested}</td><td>${when(x.oldest_failed_at)}</td><td>${when(x.newest_failed_at)}</td></tr>`).join("");
  const rows = r.dead_letters.map((d) => `<tr><td><input type="checkbox" class="dl-pick" data-consumer="${esc(d.consumer)}" value="${esc(d.message_id)}"></td>
      <td>${esc(d.consumer)}</td>
      <td><a href="#/inbox/${encodeURIComponent(d.consumer)}/${esc(d.message_id)}"><code>${esc(d.message_id)}</code></a></td>
      <td>${esc(d.topic)}</td><td>${esc(d.partition_key || "")}</td><td class="num">${d.deliveries}</td><td>${when(d.failed_at)}</td>
      <td>${d.replay_requested_at ? '<span class="badge b-PENDING">replay requested</span>' : ""}</td>
      <td><span class="err" title="${esc(d.error)}">${esc(d.error)}</span></td></tr>`).join("");
  main.innerHTML = `<h1>Inbox dead letters</h1>
    <p class="muted">Messages a consumer's handler could not apply (<code>&lt;inbox&gt;_dlq</code>). Replay runs one again through the consumer's handler; discard deletes it.</p>
    <table id="consumers"><thead><tr><th>Consumer</th><th class="num">Dead letters</th><th class="num">Replays requested</th><th>Oldest</th><th>Newest</th></tr></thead>
    <tbody>${consumers || `<tr><td colspan="5" class="muted">No consumer has dead letters.</td></tr>`}</tbody></table>
    <h2>${consumer ? "Dead letters of " + esc(consumer) + ' <a href="#/inbox" class="small">all consumers</a>' : "Latest dead letters"}</h2>
    <div class="actions">
      <button type="button" id="dl-replay">Replay selected</button>
      <button type="button" id="dl-discard" class="danger">Discard selected</button>
    </div>
    <table id="dead-letters"><thead><tr><th></th><th>Consumer</th><th>Message id</th><th>Topic</th><th>Key</th><th class="num">Deliveries</th><th>Failed</th><th></th><th>Error</th></tr></thead>
    <tbody>${rows || `<tr><td colspan="9" class="muted">None.</td></tr>`}</tbody></table>`;
  const run = (action) => {
    const picked = [...document.querySelectorAll("input.dl-pick:checked")];
    if (picked.length === 0) { toast("Select dead letters first.", true); return; }
    const consumers = [...new Set(picked.map((i) => i.dataset.consumer))];
    if (consumers.length > 1) { toast("Select dead letters of one consumer.", true); return; }
    inboxAct(action, consumers[0], picked.map((i) => i.value));
  };
  document.getElementById("dl-replay").onclick = () => run("replay");
  document.getElementById("dl-discard").onclick = () => run("discard");
}

async function inboxDetail(consumer, id) {
  setNav("inbox");
  const d = await api(`api/inbox/dead-letters/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`);
  let hdrs = [];
  try { hdrs = Object.entries(JSON.parse(d.headers || "{}")); } catch (_) { hdrs = [["(unreadable)", d.headers]]; }
  const fields = [
    ["Consumer", esc(d.consumer)], ["Message id", `<code>${esc(d.message_id)}</code>`], ["Topic", esc(d.topic)],
    ["Partition key", esc(d.partition_key || "–")], ["Deliveries", d.deliveries], ["Failed", when(d.failed_at)],
    ["Replay requested", when(d.replay_requested_at) || "–"], ["Error", `<span class="c-FAILED">${esc(d.error)}</span>`],
  ];
  main.innerHTML = `<h1>Dead letter of ${esc(d.consumer)}</h1>
    <div class="actions">
      <button type="button" data-dl="replay">Replay</button>
      <button type="button" data-dl="discard" class="danger">Discard</button>
      <a href="#/inbox?consumer=${encodeURIComponent(d.consumer)}">Back to the inbox</a>
    </div>
    <dl class="fields">${fields.map(([k, v]) => `<dt>${k}</dt><dd>${v === "" ? "–" : v}</dd>`).join("")}</dl>
    <h2>Headers</h2>
    <table><thead><tr><th>Name</th><th>Value</th></tr></thead><tbody>${hdrs.map(([k, v]) => `<tr><td>${esc(k)}</td><td>${esc(v)}</td></tr>`).join("") || `<tr><td colspan="2" class="muted">None.</td></tr>`}</tbody></table>
    <h2>Payload <span class="muted">(${esc(d.payload.kind)}, ${d.payload.bytes} bytes)</span></h2>
    <pre id="payload">${esc(d.payload.text)}</pre>`;
  document.querySelectorAll("button[data-dl]").forEach((b) => {
    const list = `#/inbox?consumer=${encodeURIComponent(d.consumer)}`;
    b.onclick = () => inboxAct(b.dataset.dl, d.consumer, [d.message_id], b.dataset.dl === "discard" ? list : undefined);
  });
}

async function route() {
  drawing.abort();
  drawing = new AbortController();
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  try {
    if (path === "/messages") await messages(query || "");
    else if (path.startsWith("/messages/")) await detail(decodeURIComponent(path.slice("/messages/".length)));
    else if (path === "/relays") await relays();
    else if (path === "/keys") await keys();
    else if (path === "/inbox") await inbox(query || "");
    else if (path.startsWith("/inbox/")) {
      const [consumer, id] = path.slice("/inbox/".length).split("/").map(decodeURIComponent);
      await inboxDetail(consumer, id);
    }
    else await overview();
  } catch (e) {
    if (e.name !== "AbortError") showError(e);
  }
}

window.addEventListener("hashchange", route);
route();

// Served by a daemon relaying several databases, under /databases/<name>/: say which, with a way
// back to the list.
(function () {
  const m = location.pathname.match(/\/databases\/([^/]+)\/$/);
  if (!m) return;
  const name = decodeURIComponent(m[1]).replace("~", "/");
  const brand = document.querySelector("header .brand");
  brand.innerHTML = `<a href="../../" class="back" title="all databases">outbox</a> · <span class="db">${esc(name)}</span>`;
  document.title = `outbox · ${name}`;
})();
