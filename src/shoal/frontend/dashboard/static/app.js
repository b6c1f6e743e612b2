// The shoal fleet dashboard: one snapshot, then server-sent changes applied in place.
// No framework, no build step: tables render only the visible page of their filtered rows.
"use strict";

const PAGE_SIZE = 50;
const STALE_AFTER_MS = 8000; // the server sends something at least every 5 s
const $ = (sel) => document.querySelector(sel);

const state = {
  frontend: null, membership: null, loops: [], totals: null,
  models: new Map(), instances: new Map(), incomplete: new Map(), routes: new Map(),
  series: { period: 2, points: [] },
};
const view = { filter: "", pages: {}, dirty: false };
let events = null;
let lastEvent = 0;
let lostSince = null;

// -- data ------------------------------------------------------------------------------------

function keyed(map, items) {
  for (const item of items) {
    item._text = JSON.stringify(item).toLowerCase();
    map.set(item.key, item);
  }
}

function loadSnapshot(snap) {
  state.frontend = snap.frontend;
  state.membership = snap.membership;
  state.loops = snap.loops;
  state.totals = snap.totals || null;
  for (const name of ["models", "instances", "incomplete", "routes"]) {
    state[name] = new Map();
    keyed(state[name], snap[name]);
  }
  state.series = snap.series;
}

function applyChange(change) {
  for (const [name, value] of Object.entries(change.set || {})) state[name] = value;
  for (const [name, items] of Object.entries(change.upsert || {})) keyed(state[name], items);
  for (const [name, keys] of Object.entries(change.remove || {})) {
    for (const key of keys) state[name].delete(key);
  }
  if (change.series) {
    state.series.points.push(...change.series);
    const keep = 300;
    if (state.series.points.length > keep) state.series.points.splice(0, state.series.points.length - keep);
  }
}

// -- connection ------------------------------------------------------------------------------

async function probe() {
  // EventSource cannot tell a refused key from a dead server: ask the snapshot route first.
  let response;
  try {
    response = await fetch("api/snapshot", { credentials: "same-origin", cache: "no-store" });
  } catch (err) {
    markLost("cannot reach the frontend");
    setTimeout(probe, 1000);
    return;
  }
  if (response.status === 401) {
    showLogin();
    return;
  }
  if (!response.ok) {
    markLost(`the frontend answered ${response.status}`);
    setTimeout(probe, 1000);
    return;
  }
  loadSnapshot(await response.json());
  markLive();
  showFleet();
  listen();
}

function listen() {
  if (events) events.close();
  events = new EventSource("api/events");
  events.addEventListener("snapshot", (e) => { loadSnapshot(JSON.parse(e.data)); markLive(); });
  events.addEventListener("change", (e) => { applyChange(JSON.parse(e.data)); markLive(); });
  events.addEventListener("ping", () => markLive());
  events.onerror = () => {
    markLost("the connection to the frontend broke");
    if (events.readyState === EventSource.CLOSED) {
      events = null;
      setTimeout(probe, 1000); // refused (key revoked?) or gone: find out which
    }
  };
}

function markLive() {
  lastEvent = Date.now();
  if (lostSince !== null) {
    lostSince = null;
    $("#lost").hidden = true;
    $("#fleet").classList.remove("stale");
  }
  const conn = $("#conn");
  conn.dataset.state = "live";
  conn.textContent = "live";
  schedule();
}

function markLost(why) {
  if (lostSince === null) lostSince = new Date();
  const conn = $("#conn");
  conn.dataset.state = "lost";
  conn.textContent = "disconnected";
  const banner = $("#lost");
  banner.hidden = false;
  banner.textContent = `Lost the frontend since ${lostSince.toLocaleTimeString()} (${why}). ` +
    "What is shown below is stale. Reconnecting…";
  $("#fleet").classList.add("stale");
}

setInterval(() => {
  if (events && lostSince === null && lastEvent && Date.now() - lastEvent > STALE_AFTER_MS) {
    markLost(`no update for ${Math.round((Date.now() - lastEvent) / 1000)} s`);
    listen();
  }
}, 1000);

// -- login -----------------------------------------------------------------------------------

function showLogin(message) {
  if (events) { events.close(); events = null; }
  $("#fleet").hidden = true;
  $("#login").hidden = false;
  $("#lost").hidden = true;
  lostSince = null;
  const conn = $("#conn");
  conn.dataset.state = "locked";
  conn.textContent = "API key required";
  const error = $("#login-error");
  error.hidden = !message;
  error.textContent = message || "";
  $("#key").focus();
}

function showFleet() {
  $("#login").hidden = true;
  $("#fleet").hidden = false;
}

$("#login-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  let response;
  try {
    response = await fetch("api/login", {
      method: "POST", credentials: "same-origin",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ key: $("#key").value }),
    });
  } catch (err) {
    showLogin("Cannot reach the frontend.");
    return;
  }
  if (response.status === 401) {
    showLogin("Refused: that is not one of this frontend's API keys.");
    return;
  }
  $("#key").value = "";
  probe();
});

$("#logout").addEventListener("click", async () => {
  await fetch("api/logout", { method: "POST", credentials: "same-origin" });
  $("#logout").hidden = true;
  showLogin();
});

// -- rendering -------------------------------------------------------------------------------

function esc(value) {
  return String(value ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

function badge(word) {
  return `<span class="state state-${esc(word)}">${esc(word)}</span>`;
}

function ago(seconds) {
  return seconds < 60 ? `${seconds.toFixed(1)} s` : `${Math.round(seconds / 60)} min`;
}

function schedule() {
  if (!view.dirty) {
    view.dirty = true;
    requestAnimationFrame(render);
  }
}

function render() {
  view.dirty = false;
  if (!state.frontend) return;
  const f = state.frontend;
  $("#logout").hidden = !f.protected;
  const scope = f.follows_membership ? "membership" : (f.namespaces.length ? f.namespaces.join(", ") : "all namespaces");
  $("#frontend-info").textContent = `v${f.version} · router ${f.router} · scope: ${scope}` +
    (f.draining ? " · DRAINING" : "") + (f.loaded ? "" : " · loading discovery…");
  // The server sends at most `rows_max` rows a table (the most severe first) and counts all.
  const t = state.totals;
  const counts = t ? t.by_state : {};
  if (!t) for (const inst of state.instances.values()) counts[inst.state] = (counts[inst.state] || 0) + 1;
  const total = t ? t.instances : state.instances.size;
  $("#summary").textContent = `${total} instances` +
    Object.entries(counts).filter(([, n]) => n).map(([s, n]) => ` · ${n} ${s}`).join("") +
    (total > state.instances.size ? ` · ${state.instances.size} shown, the most severe first` : "");
  renderModels();
  renderTable("instances", [...state.instances.values()], instanceRow, t ? t.instances : undefined);
  renderTable("incomplete", [...state.incomplete.values()], (r) =>
    `<td class="mono">${esc(r.key)}</td><td>${esc(r.model)}</td><td>${badge(r.state)}</td><td class="wrap">${esc(r.error || "metadata files not fetched yet")}</td>`, t ? t.incomplete : undefined);
  renderTable("routes", [...state.routes.values()], (r) =>
    `<td>${esc(r.workspace)}</td><td>${esc(r.name)}</td><td class="wrap">${(r.targets || []).map(target).join("<br>") || "nowhere (no target)"}${more(r)}</td>`);
  renderLoops();
  renderMembership();
  renderCharts();
}

function target(t) {
  // A route target (shoal/v1/routes/): a fleet model, or an external OpenAI-compatible provider.
  const weight = `<span class="count">weight ${esc(t.weight ?? 1)}</span>`;
  if (t.kind === "fleet") return `fleet model ${esc(t.model)} ${weight}`;
  if (t.kind === "url") return `${esc(t.provider || t.base_url)}: ${esc(t.model)} <span class="mono">${esc(t.base_url)}</span> ${weight}`;
  return `<span class="mono">${esc(JSON.stringify(t))}</span>`;
}

function more(route) {
  // The targets the frontend did not describe (it describes the first few of a route).
  const rest = (route.targets_total ?? 0) - (route.targets || []).length;
  return rest > 0 ? `<br><span class="count">and ${esc(rest)} more</span>` : "";
}

function listed(row, field) {
  // A row's list as the server sent it (its first few) and how many it did not send.
  const items = row[field] || [];
  const rest = (row[`${field}_total`] ?? items.length) - items.length;
  return esc(items.join(", ")) + (rest > 0 ? ` <span class="count">and ${esc(rest)} more</span>` : "");
}

function servingWord(model) {
  // "disaggregated" when served in two stages; "incomplete" when a stage waits for its partner.
  if (model.disaggregated) return "disaggregated";
  if (model.serving) return "yes";
  return model.incomplete ? "incomplete" : "no";
}

function renderModels() {
  const rows = [];
  for (const model of state.models.values()) {
    const rest = (model.sets_total ?? model.sets.length) - model.sets.length;
    model.sets.forEach((ws, i) => {
      const hidden = i === model.sets.length - 1 && rest > 0 ? rest : 0;
      rows.push({ key: model.key, _text: model._text, model, ws, hidden });
    });
  }
  renderTable("models", rows, ({ model, ws, hidden }) =>
    `<td>${esc(model.name)}${model.parent ? ` <span class="count">(adapter of ${esc(model.parent)})</span>` : ""}</td>` +
    `<td${model.incomplete ? ` title="${esc(model.incomplete)}"` : ""}>${badge(servingWord(model))}</td><td>${esc(ws.namespace)}</td><td>${esc(ws.component)}</td>` +
    `<td>${esc(ws.role)}</td><td class="mono" title="${esc(ws.mdcsum)}">${esc(ws.mdcsum.slice(0, 12))}</td>` +
    `<td>${ws.routable} / ${ws.members}${hidden ? ` <span class="count">(and ${esc(hidden)} more worker sets)</span>` : ""}</td>`, state.totals ? state.totals.models : state.models.size);
}

function instanceRow(r) {
  const hit = r.kv_hit_rate == null ? "–" : `${(100 * r.kv_hit_rate).toFixed(0)} %`;
  return `<td class="mono">${esc(r.instance_id)}</td><td>${badge(r.state)}</td>` +
    `<td>${esc(r.namespace)} / ${esc(r.component)} / ${esc(r.endpoint)}</td>` +
    `<td class="wrap">${listed(r, "models")}</td><td>${r.in_flight}</td><td>${r.errors}</td>` +
    `<td>${hit}</td><td>${listed(r, "taints")}</td><td class="mono">${esc(r.url)}</td>`;
}

function renderTable(id, rows, cells, total) {
  const section = document.getElementById(id);
  const needle = view.filter;
  const shown = needle ? rows.filter((r) => r._text.includes(needle)) : rows;
  shown.sort((a, b) => (a.key < b.key ? -1 : a.key > b.key ? 1 : 0));
  const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
  const page = Math.min(view.pages[id] || 0, pages - 1);
  view.pages[id] = page;
  const slice = shown.slice(page * PAGE_SIZE, (page + 1) * PAGE_SIZE);
  section.querySelector("tbody").innerHTML = slice.map((r) =>
    `<tr data-key="${esc(r.key)}"${r.state ? ` data-state="${esc(r.state)}"` : ""}>${cells(r)}</tr>`).join("");
  const count = section.querySelector(".count");
  const all = total ?? rows.length;
  const cut = all > rows.length; // the server sent the first rows only
  if (count) {
    count.textContent = needle
      ? `(${shown.length} of ${rows.length}${cut ? " shown" : ""} match)`
      : `(${cut ? `${rows.length} shown of ${all}` : all})`;
  }
  const empty = section.querySelector(".empty");
  empty.dataset.text ??= empty.innerHTML;
  empty.innerHTML = needle && rows.length ? "Nothing matches the filter." : empty.dataset.text;
  empty.hidden = shown.length > 0;
  const pager = section.querySelector(".pager");
  if (pager) {
    pager.innerHTML = pages > 1
      ? `<button data-page="${page - 1}" ${page === 0 ? "disabled" : ""}>‹ previous</button>` +
        `<span>page ${page + 1} of ${pages} · rows ${page * PAGE_SIZE + 1}–${page * PAGE_SIZE + slice.length} of ${shown.length}</span>` +
        `<button data-page="${page + 1}" ${page + 1 >= pages ? "disabled" : ""}>next ›</button>`
      : "";
  }
}

document.addEventListener("click", (e) => {
  const button = e.target.closest(".pager button");
  if (!button) return;
  view.pages[button.closest("section").id] = Number(button.dataset.page);
  schedule();
});

$("#filter").addEventListener("input", (e) => {
  view.filter = e.target.value.trim().toLowerCase();
  view.pages = {};
  schedule();
});

function renderLoops() {
  const section = $("#loops");
  section.querySelector("tbody").innerHTML = state.loops.map((l) =>
    `<tr data-key="${esc(l.name)}"><td>${esc(l.name)}</td><td>${badge(l.healthy ? "healthy" : "unhealthy")}</td>` +
    `<td>${ago(l.heartbeat_age)} <span class="count">(every ${l.interval} s, max ${l.max_silence} s)</span></td>` +
    `<td class="wrap">${esc(l.reason || "")}</td></tr>`).join("");
  section.querySelector(".empty").hidden = state.loops.length > 0;
}

function renderMembership() {
  const m = state.membership;
  const f = state.frontend;
  let rows;
  if (!m) {
    rows = [["source", "static scope (--namespace)"],
      ["namespaces", f.namespaces.length ? f.namespaces.join(", ") : "all"]];
  } else {
    const s = m.status;
    rows = [["desired revision", s.desired_revision ?? "–"], ["applied revision", s.applied_revision ?? "–"],
      ["in sync", s.desired_revision === s.applied_revision ? "yes" : "no, applying"],
      ["namespaces", `${s.count}: ${m.namespaces.join(", ") || "none"}`],
      ["last error", s.last_error ?? "none"]];
  }
  $("#membership dl").innerHTML = rows.map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("");
}

function renderCharts() {
  const points = state.series.points;
  const last = points[points.length - 1];
  chart("#chart-rps", points, [["rps", "line-rps"]]);
  chart("#chart-errors", points, [["client_errors", "line-client"], ["server_errors", "line-server"]]);
  chart("#chart-ttft", points, [["ttft_p50", "line-p50"], ["ttft_p95", "line-p95"]]);
  $("#now-rps").textContent = last ? last.rps.toFixed(1) : "";
  $("#now-errors").textContent = last ? (last.client_errors + last.server_errors).toFixed(1) : "";
  $("#now-ttft").textContent = last && last.ttft_p50 != null ? `${(last.ttft_p50 * 1000).toFixed(0)} ms` : "";
}

function chart(sel, points, series) {
  // The newest point at the right edge; the x axis spans 1 minute at first, 10 at most.
  const svg = $(sel);
  const width = 300, height = 60;
  const span = Math.min(300, Math.max(30, points.length));
  const start = Math.max(0, points.length - span);
  let max = 0;
  for (let i = start; i < points.length; i++) {
    for (const [field] of series) max = Math.max(max, points[i][field] ?? 0);
  }
  max = max || 1;
  const x = (i) => width - ((points.length - 1 - i) * width) / (span - 1);
  svg.innerHTML = series.map(([field, cls]) => {
    const coords = [];
    for (let i = start; i < points.length; i++) {
      const v = points[i][field];
      if (v != null) coords.push(`${x(i).toFixed(1)},${(height - 2 - (v / max) * (height - 4)).toFixed(1)}`);
    }
    return `<polyline class="${cls}" points="${coords.join(" ")}"></polyline>`;
  }).join("");
  svg.dataset.points = String(points.length);
  svg.dataset.max = String(max);
}

probe();
