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
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) =>
  ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
const fmt = (x, d) => (x === null || x === undefined ? "–" : Number(x).toFixed(d));
const version = (d) => (d.model && d.active != null ? `${d.model} v${d.active}` : "none");

// A small inline SVG line of `values` (oldest first), scaled to [lo, hi]; its label says the
// first and last values, so the trend is there without seeing the line.
function spark(values, lo, hi, what) {
  if (!values || values.length < 2) return "";
  const w = 64, h = 18, n = values.length;
  const span = hi - lo || 1;
  const pts = values.map((v, i) => {
    const y = h - 1 - ((Math.min(Math.max(v, lo), hi) - lo) / span) * (h - 2);
    return `${((i / (n - 1)) * (w - 2) + 1).toFixed(1)},${y.toFixed(1)}`;
  }).join(" ");
  const label = `${what}, last ${n} windows: ${values[0].toFixed(2)} to ${values[n - 1].toFixed(2)}`;
  return `<svg class="spark" width="${w}" height="${h}" viewBox="0 0 ${w} ${h}" role="img" aria-label="${esc(label)}"><title>${esc(label)}</title><polyline points="${pts}"/></svg>`;
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
  const online = d.online === true ? '<span class="ok">● online</span>'
    : d.online === false ? '<span class="bad">○ offline</span>' : '<span class="muted">? unknown</span>';
  const state = d.progress ? `${d.state} ${d.progress[0]}/${d.progress[1]}` : (d.state ?? "no status");
  const active = d.active != null ? `${esc(d.model)} v${d.active}` : "–";
  const conf = d.confidence == null ? "–"
    : `${fmt(d.confidence, 3)}${d.reference_confidence != null ? ` <span class="muted">(ref ${fmt(d.reference_confidence, 3)})</span>` : ""} ${spark(d.confidence_history, 0, 1, "confidence")}`;
  const drift = d.drift_z == null ? "–"
    : `${d.drift_flagged ? '<span class="bad">⚑ flagged</span> ' : ""}${fmt(d.drift_z, 2)} ${spark(d.drift_history, 0, Math.max(4, ...(d.drift_history || [0])), "drift z")}`;
  const err = d.last_error ? `<span class="bad">⚠ ${esc(d.last_error)}</span>` : "";
  return `<tr data-device="${esc(d.id)}"${d.last_error ? ' class="has-error"' : ""}>` +
    `<th scope="row">${esc(d.id)}</th><td>${esc((d.groups || []).join(", "))}</td><td>${online}</td>` +
    `<td data-col="state">${esc(state)}${d.shadow ? `<br><span class="muted">shadow ${esc(d.shadow)}</span>` : ""}</td>` +
    `<td data-col="active">${active}</td><td>${d.previous != null ? "v" + d.previous : "–"}</td>` +
    `<td class="num">${fmt(d.p50_ms, 1)}</td><td>${conf}</td><td>${drift}</td><td data-col="error">${err}</td></tr>`;
}

// Keeps a select's options equal to `values` (and its choice, if still offered).
function options(id, values) {
  const sel = $(id);
  const want = ["", ...[...values].sort()];
  const have = [...sel.options].map((o) => o.value);
  if (want.join("\n") === have.join("\n")) return;
  const chosen = sel.value;
  sel.innerHTML = want.map((v) => `<option value="${esc(v)}">${v ? esc(v) : "all"}</option>`).join("");
  sel.value = want.includes(chosen) ? chosen : "";
}

function renderDevices() {
  const all = [...devices.values()].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  options("f-group", new Set(all.flatMap((d) => d.groups || [])));
  options("f-state", new Set(all.map((d) => d.state).filter(Boolean)));
  options("f-version", new Set(all.map(version)));
  const f = filters();
  const shown = all.filter((d) => accepts(d, f));
  $("device-rows").innerHTML = shown.map(deviceRow).join("");
  $("device-count").textContent = `${shown.length} devices shown of ${all.length}`;
  const online = all.filter((d) => d.online).length;
  const errors = all.filter((d) => d.last_error).length;
  const drifting = all.filter((d) => d.drift_flagged).length;
  $("summary").textContent = `${all.length} devices, ${online} online, ${errors} with an error, ` +
    `${drifting} drifting; ${[...rollouts.values()].filter((r) => r.state === "running").length} rollouts running`;
}

function gateRows(r) {
  if (!r.gates.length) return "";
  const verdict = (g) => (g.passed === true ? '<span class="ok">✓ ok</span>'
    : g.passed === false ? '<span class="bad">✗ breached</span>' : '<span class="muted">… waiting</span>');
  return `<div class="table-wrap"><table class="gates"><caption>Quality gates</caption><thead><tr><th scope="col">Phase</th>` +
    `<th scope="col">Gate</th><th scope="col">Value</th><th scope="col">Limit</th><th scope="col">Verdict</th></tr></thead><tbody>` +
    r.gates.map((g) => `<tr data-gate="${esc(g.name)}"><td>${g.phase}</td><td>${esc(g.name)}</td>` +
      `<td class="num">${fmt(g.value, 3)}</td><td class="num">${g.bound} ${fmt(g.limit, 3)}</td><td>${verdict(g)}</td></tr>`).join("") +
    "</tbody></table></div>";
}

// A rollout's header (name, model, state, reason) and body (phases, gates), as HTML.
function rolloutParts(r) {
  const badge = r.state === "running" && r.paused ? "⏸ paused"
    : { running: "▶ running", completed: "✓ completed", aborted: "✗ aborted" }[r.state] || r.state;
  const mark = { done: "✓ done", current: r.state === "running" ? "▶ current" : "■ stopped here", pending: "… pending" };
  const phases = r.phases.map((p) => `<tr data-phase="${p.index}" data-progress="${p.progress}">` +
    `<th scope="row">${p.index} ${esc(p.name)}${p.mode === "shadow" ? " (shadow)" : ""}</th><td>${mark[p.progress]}</td>` +
    `<td class="num">${p.devices}</td><td class="num">${p.waiting}</td><td class="num">${p.moved}</td>` +
    `<td class="num">${p.active}</td><td class="num">${p.failed}</td><td class="num">${p.rolled_back}</td></tr>` +
    (p.failures.length ? `<tr class="failures"><td colspan="8">${p.failures.map(([d, why]) =>
      `<span class="bad">⚠ ${esc(d)}: ${esc(why)}</span>`).join("<br>")}</td></tr>` : "")).join("");
  const head = `<h3>${esc(r.name)} <span class="muted">${esc(r.model)} v${r.version}</span> <span class="badge">${badge}</span></h3>` +
    (r.reason ? `<p class="bad reason">${esc(r.reason)}</p>` : "");
  const body = `<div class="table-wrap"><table class="phases"><caption class="sr">Phases of ${esc(r.name)}</caption><thead><tr>` +
    `<th scope="col">Phase</th><th scope="col">Progress</th><th scope="col">Devices</th><th scope="col">Waiting</th>` +
    `<th scope="col">Moved</th><th scope="col">Active</th><th scope="col">Failed</th><th scope="col">Rolled back</th>` +
    `</tr></thead><tbody>${phases}</tbody></table></div>${gateRows(r)}`;
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
  return { el, head, bar, buttons, body, html: "" };
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
  if (!list.length && !empty) box.innerHTML = '<p class="empty">No rollout on this broker.</p>';
  list.forEach((r, i) => {
    if (!cards.has(r.name)) cards.set(r.name, card(r));
    const c = cards.get(r.name);
    const [head, body] = rolloutParts(r);
    if (head + body !== c.html) {
      c.head.innerHTML = head;
      c.body.innerHTML = body;
      c.html = head + body;
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
  $("event-list").innerHTML = events.slice(-100).reverse().map((e) =>
    `<li data-kind="${esc(e.kind)}"><time>${esc(e.time)}</time> <strong>${esc(e.subject)}</strong> ` +
    `<span class="kind">${esc(e.kind)}</span> ${esc(e.text)}</li>`).join("");
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
  link.innerHTML = connected ? '<span aria-hidden="true">●</span> broker connected'
    : '<span aria-hidden="true">○</span> broker not connected';
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
  $("filters").addEventListener("reset", () => setTimeout(schedule, 0));
  $("rollout-list").addEventListener("click", (e) => {
    const b = e.target.closest("[data-action]");
    if (b) openConfirm(b.dataset.action, b.dataset.name);
  });
  $("confirm-form").addEventListener("submit", submitAbort);
  $("confirm-cancel").addEventListener("click", () => $("confirm").close());
}

start();
