// Kestrel fleet console: one page fed by /api/stream (server-sent events). Each `delta` event
// holds the devices, rollouts and events that changed; the first one holds everything.
"use strict";

const devices = new Map();
const rollouts = new Map();
let events = [];
let actions = false;
let connected = false;
let dirty = false;
let eventsDirty = false;
let firstRender = true;

const $ = (id) => document.getElementById(id);
const fmt = (x, d) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
// A byte count as people read it (powers of 1000, as the CLI prints them).
const bytes = (n) => n < 1e3 ? `${n} B` : n < 1e6 ? `${(n / 1e3).toFixed(1)} KB`
  : n < 1e9 ? `${(n / 1e6).toFixed(1)} MB` : `${(n / 1e9).toFixed(2)} GB`;
const version = (d) => (d.model && d.active != null ? `${d.model} v${d.active}` : "none");

// Every value from the broker reaches the page as text: elements are built with the DOM and
// strings become text nodes (never HTML), so a device id, an error or a gate's bound that holds
// markup shows as that markup. The server's Content-Security-Policy forbids inline script too.
// h("td", { class: "num", data: { col: "state" } }, child, "text", ...): children are nodes,
// strings, numbers or arrays of them; null, undefined and false are left out.
function h(tag, attrs, ...kids) {
  return fill(document.createElement(tag), attrs, kids);
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs, ...kids) {
  return fill(document.createElementNS(SVG, tag), attrs, kids);
}

function fill(el, attrs, kids) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "data") for (const [dk, dv] of Object.entries(v)) el.dataset[dk] = String(dv);
    else el.setAttribute(k, String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid === null || kid === undefined || kid === false || kid === "") continue;
    el.append(kid instanceof Node ? kid : String(kid));
  }
  return el;
}

const span = (cls, ...kids) => h("span", { class: cls }, ...kids);

// A small SVG line of `values` (oldest first), scaled to [lo, hi]; its label says the first and
// last values, so the trend is there without seeing the line.
function spark(values, lo, hi, what) {
  if (!values || values.length < 2) return null;
  const w = 64, ht = 18, n = values.length;
  const span_ = hi - lo || 1;
  const pts = values.map((v, i) => {
    const y = ht - 1 - ((Math.min(Math.max(Number(v), lo), hi) - lo) / span_) * (ht - 2);
    return `${((i / (n - 1)) * (w - 2) + 1).toFixed(1)},${y.toFixed(1)}`;
  }).join(" ");
  const label = `${what}, last ${n} windows: ${Number(values[0]).toFixed(2)} to ${Number(values[n - 1]).toFixed(2)}`;
  return svg("svg", { class: "spark", width: w, height: ht, viewBox: `0 0 ${w} ${ht}`, role: "img", "aria-label": label },
    svg("title", {}, label), svg("polyline", { points: pts }));
}

function filters() {
  return {
    group: $("f-group").value, state: $("f-state").value, version: $("f-version").value,
    health: $("f-health").value, text: $("f-text").value.trim().toLowerCase(),
  };
}

function accepts(d, f) {
  if (f.group && !(d.groups || []).includes(f.group)) return false;
  if (f.state && d.state !== f.state) return false;
  if (f.version && version(d) !== f.version) return false;
  if (f.health === "error" && !d.last_error) return false;
  if (f.health === "offline" && d.online !== false) return false;
  if (f.health === "drift" && !d.drift_flagged) return false;
  if (f.text && !d.id.toLowerCase().includes(f.text)) return false;
  return true;
}

function deviceRow(d) {
  const online = d.online === true ? span("ok", "● online")
    : d.online === false ? span("bad", "○ offline") : span("muted", "? unknown");
  const state = d.progress ? `${d.state} ${d.progress[0]}/${d.progress[1]}` : (d.state ?? "no status");
  const active = d.active != null ? `${d.model} v${d.active}` : "–";
  const conf = d.confidence == null ? "–"
    : [fmt(d.confidence, 3), d.reference_confidence != null ? [" ", span("muted", `(ref ${fmt(d.reference_confidence, 3)})`)] : null,
      " ", spark(d.confidence_history, 0, 1, "confidence")];
  const drift = d.drift_z == null ? "–"
    : [d.drift_flagged ? [span("bad", "⚑ flagged"), " "] : null, fmt(d.drift_z, 2), " ",
      spark(d.drift_history, 0, Math.max(4, ...(d.drift_history || [0]).map(Number)), "drift z")];
  return h("tr", { data: { device: d.id }, class: d.last_error ? "has-error" : null },
    h("th", { scope: "row" }, d.id), h("td", {}, (d.groups || []).join(", ")), h("td", {}, online),
    h("td", { data: { col: "state" } }, state, d.shadow ? [h("br"), span("muted", `shadow ${d.shadow}`)] : null),
    h("td", { data: { col: "active" } }, active), h("td", {}, d.previous != null ? `v${d.previous}` : "–"),
    h("td", { class: "num", data: { col: "fetched" } }, d.state == null ? "–"
      : [bytes(d.counters.bytes_fetched), " ", span("muted", `(${bytes(d.counters.bytes_reused)} reused)`)]),
    h("td", { class: "num" }, fmt(d.p50_ms, 1)), h("td", {}, conf), h("td", {}, drift),
    h("td", { data: { col: "error" } }, d.last_error ? span("bad", `⚠ ${d.last_error}`) : null));
}

// Keeps a select's options equal to `values` (and its choice, if still offered).
function options(id, values) {
  const sel = $(id);
  const want = ["", ...[...values].sort()];
  const have = [...sel.options].map((o) => o.value);
  if (want.join("\n") === have.join("\n")) return;
  const chosen = sel.value;
  sel.replaceChildren(...want.map((v) => h("option", { value: v }, v || "all")));
  sel.value = want.includes(chosen) ? chosen : "";
}

const PAGE = 250;
let page = 0;

function renderDevices() {
  const all = [...devices.values()].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  options("f-group", new Set(all.flatMap((d) => d.groups || [])));
  options("f-state", new Set(all.map((d) => d.state).filter(Boolean)));
  options("f-version", new Set(all.map(version)));
  const f = filters();
  const shown = all.filter((d) => accepts(d, f));
  // A page of rows at a time: a fleet of thousands is read through its filters and pages.
  const pages = Math.max(1, Math.ceil(shown.length / PAGE));
  page = Math.min(page, pages - 1);
  $("device-rows").replaceChildren(...shown.slice(page * PAGE, (page + 1) * PAGE).map(deviceRow));
  $("device-count").textContent = `${shown.length} devices shown of ${all.length}` +
    (pages > 1 ? `, page ${page + 1} of ${pages} (${PAGE} a page)` : "");
  $("pager").hidden = pages < 2;
  $("page-prev").disabled = page === 0;
  $("page-next").disabled = page >= pages - 1;
  const online = all.filter((d) => d.online).length;
  const errors = all.filter((d) => d.last_error).length;
  const drifting = all.filter((d) => d.drift_flagged).length;
  $("summary").textContent = `${all.length} devices, ${online} online, ${errors} with an error, ` +
    `${drifting} drifting; ${[...rollouts.values()].filter((r) => r.state === "running").length} rollouts running`;
}

function gateRows(r) {
  if (!r.gates.length) return null;
  const verdict = (g) => (g.passed === true ? span("ok", "✓ ok")
    : g.passed === false ? span("bad", "✗ breached") : span("muted", "… waiting"));
  const cols = ["Phase", "Gate", "Value", "Limit", "Verdict"].map((c) => h("th", { scope: "col" }, c));
  return h("div", { class: "table-wrap" }, h("table", { class: "gates" }, h("caption", {}, "Quality gates"),
    h("thead", {}, h("tr", {}, cols)),
    h("tbody", {}, r.gates.map((g) => h("tr", { data: { gate: g.name } },
      h("td", {}, g.phase), h("td", {}, g.name), h("td", { class: "num" }, fmt(g.value, 3)),
      h("td", { class: "num" }, `${g.bound} ${fmt(g.limit, 3)}`), h("td", {}, verdict(g)))))));
}

// A rollout's header (name, model, state, reason) and body (phases, gates), as elements.
function rolloutParts(r) {
  const badge = r.state === "running" && r.paused ? "⏸ paused"
    : { running: "▶ running", completed: "✓ completed", aborted: "✗ aborted" }[r.state] || r.state;
  const mark = { done: "✓ done", current: r.state === "running" ? "▶ current" : "■ stopped here", pending: "… pending" };
  const num = (x) => h("td", { class: "num" }, x);
  const phases = r.phases.map((p) => [
    h("tr", { data: { phase: p.index, progress: p.progress } },
      h("th", { scope: "row" }, `${p.index} ${p.name}${p.mode === "shadow" ? " (shadow)" : ""}`),
      h("td", {}, mark[p.progress] ?? p.progress),
      num(p.devices), num(p.waiting), num(p.moved), num(p.active), num(p.failed), num(p.rolled_back),
      num(p.late ?? 0), num(p.offline ?? 0)),
    p.failures.length ? h("tr", { class: "failures" }, h("td", { colspan: 10 },
      p.failures.map(([d, why], i) => [i ? h("br") : null, span("bad", `⚠ ${d}: ${why}`)]))) : null,
    p.late_devices?.length ? h("tr", { class: "late" }, h("td", { colspan: 10 },
      span("muted", `joined late: ${p.late_devices.join(", ")}${p.late > p.late_devices.length
        ? ` and ${p.late - p.late_devices.length} more` : ""}`))) : null,
    p.excluded?.length ? h("tr", { class: "excluded" }, h("td", { colspan: 10 },
      p.excluded.map(([d, why], i) => [i ? h("br") : null,
        span("bad", `⊘ ${d} excluded from the quality gates: ${why}`)]))) : null,
  ]);
  const head = [h("h3", {}, r.name, " ", span("muted", `${r.model} v${r.version}`), " ", span("badge", badge)),
    r.reason ? h("p", { class: "bad reason" }, r.reason) : null];
  const cols = ["Phase", "Progress", "Devices", "Waiting", "Moved", "Active", "Failed", "Rolled back", "Late", "Offline"]
    .map((c) => h("th", { scope: "col" }, c));
  const body = [h("div", { class: "table-wrap" }, h("table", { class: "phases" },
    h("caption", { class: "sr" }, `Phases of ${r.name}`), h("thead", {}, h("tr", {}, cols)), h("tbody", {}, phases))),
  gateRows(r)];
  return [head, body];
}

// One card per rollout, kept across updates: only its text is replaced, so its Abort button
// (and the keyboard focus on it) stays while the rollout's state changes under it.
const cards = new Map();

const ACTIONS = {
  pause: { label: "Pause", text: "The current phase goes on; the next one does not start until resumed." },
  resume: { label: "Resume", text: "The rollout goes on from its current phase." },
  abort: { label: "Abort", text: "Every device already moved goes back to its previous model. This cannot be undone." },
};

function card(r) {
  const el = document.createElement("article");
  el.dataset.rollout = r.name;
  const head = document.createElement("div");
  const bar = document.createElement("div");
  bar.className = "actions";
  const buttons = {};
  for (const [action, a] of Object.entries(ACTIONS)) {
    const b = document.createElement("button");
    if (action === "abort") b.className = "danger";
    b.dataset.action = action;
    b.dataset.name = r.name;
    b.textContent = `${a.label} ${r.name}…`;
    buttons[action] = b;
    bar.append(b);
  }
  const body = document.createElement("div");
  el.append(head, bar, body);
  return { el, head, bar, buttons, body, shown: "" };
}

function renderRollouts() {
  const box = $("rollout-list");
  for (const [name, c] of cards) {
    if (!rollouts.has(name)) {
      c.el.remove();
      cards.delete(name);
    }
  }
  const list = [...rollouts.values()].sort((a, b) => (a.state === "running") - (b.state === "running") || (a.name < b.name ? -1 : 1)).reverse();
  const empty = box.querySelector(".empty");
  if (empty && list.length) empty.remove();
  if (!list.length && !empty) box.replaceChildren(h("p", { class: "empty" }, "No rollout on this broker."));
  list.forEach((r, i) => {
    if (!cards.has(r.name)) cards.set(r.name, card(r));
    const c = cards.get(r.name);
    // Rebuilt only when the rollout changed, so the page does not redo it twice a second.
    const shown = JSON.stringify(r);
    if (shown !== c.shown) {
      const [head, body] = rolloutParts(r);
      c.head.replaceChildren(...head.filter(Boolean));
      c.body.replaceChildren(...body.filter(Boolean));
      c.shown = shown;
    }
    c.el.className = `rollout ${r.state}`;
    c.el.dataset.state = r.state;
    const running = actions && r.state === "running";
    c.bar.hidden = !running;
    c.buttons.pause.hidden = !running || r.paused;
    c.buttons.resume.hidden = !running || !r.paused;
    if (box.children[i] !== c.el) box.insertBefore(c.el, box.children[i] || null);
  });
}

function renderEvents() {
  $("event-list").replaceChildren(...events.slice(-100).reverse().map((e) =>
    h("li", { data: { kind: e.kind } }, h("time", {}, e.time), " ", h("strong", {}, e.subject), " ",
      span("kind", e.kind), " ", e.text)));
}

function render() {
  dirty = false;
  const t0 = performance.now();
  const focused = document.activeElement && document.activeElement.id;
  renderDevices();
  renderRollouts();
  if (eventsDirty) {
    eventsDirty = false;
    renderEvents();
  }
  const link = $("link");
  link.replaceChildren(h("span", { "aria-hidden": "true" }, connected ? "●" : "○"),
    connected ? " broker connected" : " broker not connected");
  link.className = "link " + (connected ? "ok" : "bad");
  if (focused && $(focused)) $(focused).focus();
  // Render times, for scripts/bench_console.py (it sets window.kestrelRenders = []).
  if (Array.isArray(window.kestrelRenders) && window.kestrelRenders.length < 10000) {
    window.kestrelRenders.push(performance.now() - t0);
  }
  if (firstRender && devices.size) {
    firstRender = false;
    performance.mark("kestrel-first-render");
    document.documentElement.dataset.firstRenderMs = performance.now().toFixed(0);
  }
}

function schedule() {
  if (!dirty) {
    dirty = true;
    requestAnimationFrame(render);
  }
}

function onDelta(msg) {
  const d = JSON.parse(msg.data);
  if (d.full) {
    devices.clear();
    rollouts.clear();
    events = [];
  }
  for (const x of d.devices) devices.set(x.id, x);
  for (const r of d.rollouts) rollouts.set(r.name, r);
  if (d.full || d.events.length) {
    events = events.concat(d.events).slice(-500);
    eventsDirty = true;
  }
  connected = d.connected;
  schedule();
}

function openConfirm(action, name) {
  $("confirm-action").textContent = ACTIONS[action].label;
  $("confirm-text").textContent = ACTIONS[action].text;
  $("confirm-ok").textContent = `${ACTIONS[action].label} rollout`;
  $("confirm-ok").className = action === "abort" ? "danger" : "";
  $("confirm").dataset.action = action;
  $("confirm-name").textContent = name;
  $("confirm-input").value = "";
  $("confirm-error").textContent = "";
  $("confirm").dataset.rollout = name;
  $("confirm").showModal();
  $("confirm-input").focus();
}

async function submitAbort(ev) {
  ev.preventDefault();
  const dlg = $("confirm");
  const name = dlg.dataset.rollout;
  const action = dlg.dataset.action;
  const r = await fetch(`api/rollouts/${encodeURIComponent(name)}/${action}`, {
    method: "POST", headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ confirm: $("confirm-input").value, reason: $("confirm-reason").value }),
  });
  if (r.ok) {
    dlg.close();
  } else {
    $("confirm-error").textContent = await r.text();
  }
}

async function start() {
  try {
    const info = await (await fetch("api/info")).json();
    actions = info.actions;
  } catch (e) {
    $("summary").textContent = "Cannot reach the console's API: " + e;
  }
  const es = new EventSource("api/stream");
  es.addEventListener("delta", onDelta);
  es.onerror = () => { connected = false; schedule(); };
  for (const id of ["f-group", "f-state", "f-version", "f-health"]) $(id).addEventListener("change", schedule);
  $("f-text").addEventListener("input", schedule);
  $("filters").addEventListener("reset", () => { page = 0; setTimeout(schedule, 0); });
  $("filters").addEventListener("input", () => { page = 0; });
  $("page-prev").addEventListener("click", () => { page = Math.max(0, page - 1); schedule(); });
  $("page-next").addEventListener("click", () => { page += 1; schedule(); });
  $("rollout-list").addEventListener("click", (e) => {
    const b = e.target.closest("[data-action]");
    if (b) openConfirm(b.dataset.action, b.dataset.name);
  });
  $("confirm-form").addEventListener("submit", submitAbort);
  $("confirm-cancel").addEventListener("click", () => $("confirm").close());
}

start();
