// The router's dashboard: one admin event stream (GET /v1/router/events), read with fetch() so
// that a key can go in the Authorization header (EventSource cannot send one). Read-only: it
// never sends anything but that GET. Every value from the router is put in the page as text
// (textContent), never as HTML: box and model names come from boxes and callers.
"use strict";

const KEY_ITEM = "router.adminKey"; // sessionStorage: this tab only, gone when it closes
const EVENTS_PATH = "/v1/router/events";
const KEYS_USAGE_PATH = "/v1/keys/usage"; // the keys panel, polled while the stream is live
const KEYS_EVERY_MS = 5000;
const BATCHES_PATH = "/v1/batches?limit=20"; // the batches panel: the newest 20 (an admin caller sees every owner's)
const BATCHES_EVERY_MS = 2000;
const RATE_WINDOW_MS = 10000; // a batch's lines per second: over its polls of the last 10 s
const RETRY_MS = 2000;
const STALE_MS = 3500; // the router sends the state every second
const MAX_CALLS = 200;
const MAX_SNAPSHOTS = 30;
const MAX_POINTS = 300; // five minutes of one-second points, as the router keeps
const MIN_PLOT_POINTS = 60; // a plot spans at least a minute, so a fresh page does not stretch 3 points
const LABEL_POINTS = 10; // the numbers beside a plot: the last ten seconds
const SVG_NS = "http://www.w3.org/2000/svg";

const view = {
  points: [], boxes: [], snapshots: [], snapshotTimes: [], lastEventAt: 0, connecting: false,
  routersHeard: 0, // routers on the shared server (state.shared), 0 for one router alone
  routersInCalls: new Set(), // routers named by the calls since the page connected (one PostgreSQL route log)
  batches: [], // the last GET /v1/batches page
  batchSamples: new Map(), // live batch id -> [[ms, lines done]], its polls of the last RATE_WINDOW_MS
  batchLines: null, // this router's batch lines (the state's `batches`): in flight, and by state since start
};

// --- building the page ---------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function tag(text, cls) {
  return el("span", { class: "tag " + cls }, text);
}

function replaceRows(tbody, rows) {
  tbody.replaceChildren(...rows);
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "—";
  const value = seconds * 1000;
  return value < 10 ? value.toFixed(1) + " ms" : value < 10000 ? Math.round(value) + " ms" : (value / 1000).toFixed(1) + " s";
}

function bytes(count) {
  if (count === null || count === undefined) return "—";
  const gib = count / 1024 ** 3;
  return gib >= 1 ? gib.toFixed(1) + " GiB" : Math.round(count / 1024 ** 2) + " MiB";
}

function clock(epochSeconds) {
  return new Date(epochSeconds * 1000).toLocaleTimeString([], { hour12: false });
}

function boxLabel(name) {
  return name === "" ? "no box" : name;
}

// --- the boxes, the models -------------------------------------------------------------------

function settingsText(resident) {
  if (resident.settings) return "settings " + resident.settings;
  return resident.settings_sent ? "default settings" : "default settings (none sent by this router yet)";
}

function residentCell(box) {
  if (!box.residents.length) return el("td", { class: "muted" }, "none");
  return el("td", {}, ...box.residents.map((resident) => el("span", { class: "resident", "data-model": resident.key },
    el("span", { class: "mono" }, resident.key), " ",
    el("span", { class: "settings", "data-settings": resident.settings || "" }, settingsText(resident)), " ",
    resident.loading ? tag("loading", "loading") : null,
    resident.busy ? tag("busy", "busy") : null,
    resident.healthy ? null : tag("unhealthy", "unhealthy"))));
}

function statusCell(box) {
  const word = box.online ? "online" : "offline";
  const cell = el("td", {}, tag(word, word));
  if (box.blocked) cell.append(" ", tag("blocked", "blocked"));
  if (box.down) cell.append(" ", el("span", { class: "muted down" }, box.down));
  if (box.online && box.health_age_s !== null && box.health_age_s > 3) {
    cell.append(" ", el("span", { class: "muted" }, `no answer for ${Math.round(box.health_age_s)} s`));
  }
  return cell;
}

function pressureCell(level) {
  const meter = el("span", { class: "pressure", "data-level": level, title: `pressure ${level} of 3` }, el("i"), el("i"), el("i"));
  return el("td", {}, meter, String(level));
}

function backoffCell(box) {
  const cooling = Object.entries(box.cooling);
  const cell = el("td", {});
  if (box.unreachable) cell.append(tag("unreachable", "unreachable"), " ");
  if (!cooling.length && !box.unreachable) cell.append(el("span", { class: "muted" }, "—"));
  for (const [model, backoff] of cooling) {
    cell.append(el("span", { class: "mono" }, model), ` ≤ ${backoff.ceiling} in flight, ${backoff.seconds_left.toFixed(1)} s `);
  }
  return cell;
}

function renderQueue(queue) {
  const outcomes = Object.entries(queue.outcomes).map(([name, count]) => `${name} ${count}`).join(", ");
  // Retry-After is what a call the queue turns away (full, or waited out) is told; with nobody
  // waiting it is still there, so say what it is rather than show a bare number.
  document.querySelector("#queue-summary").textContent =
    (queue.size ? `${queue.size} waiting` : "Nobody waiting") +
    ` (room for ${queue.capacity}, a call waits at most ${queue.timeout_s} s). ` +
    `A call turned away now would be told Retry-After: ${queue.retry_after_s} s ` +
    "(the queue's length over its recent drain rate; the wait timeout when nothing has drained lately)." +
    (outcomes ? ` So far: ${outcomes}.` : "");
  replaceRows(document.querySelector("#queue tbody"), queue.waiting.map((waiter) => el("tr", { "data-call-id": waiter.call_id },
    el("td", { class: "mono" }, waiter.call_id),
    el("td", {}, tag(waiter.class, waiter.class)),
    el("td", { class: "mono" }, waiter.caller),
    el("td", { class: "mono" }, waiter.model),
    el("td", {}, waiter.boxes.join(", ")),
    el("td", { class: "num" }, `${waiter.waited_s.toFixed(1)} s`))));
}

// Several routers (GET /v1/router/state's `shared`, absent for one router): the shared server's
// mode and every router heard from lately, with its calls.
function renderRouters(shared) {
  const section = document.querySelector("#routers");
  section.hidden = !shared;
  view.routersHeard = shared ? shared.routers.length : 0;
  showRouterColumn();
  if (!shared) return;
  document.querySelector("#routers-summary").textContent =
    `this router: ${shared.instance}; shared server ${shared.url} ${shared.up ? "up" : "DOWN"}` +
    ` (--shared-down ${shared.down_mode}): counting ${shared.counting}`;
  const now = Date.now() / 1000;
  replaceRows(document.querySelector("#routers tbody"), shared.routers.map((router) => el("tr", { "data-router": router.instance },
    el("td", { class: "mono" }, router.instance === shared.instance ? el("strong", {}, router.instance) : router.instance),
    el("td", { class: "num" }, String(router.calls ?? "—")),
    el("td", { class: "num" }, String(router.in_flight ?? "—")),
    el("td", { class: "num" }, router.started ? `${Math.round(now - router.started)} s` : "—"),
    el("td", { class: "num" }, `${router.seen_s_ago.toFixed(1)} s ago`))));
}

function renderAffinity(affinity) {
  document.querySelector("#affinity-summary").textContent = affinity.on
    ? `on: slack ${affinity.slack.absolute} + ${Math.round(affinity.slack.relative * 100)} % of the best box's load; ` +
      `${affinity.index_entries} of ${affinity.index_capacity} index entries`
    : "off (--affinity off): the seeds' order";
  replaceRows(document.querySelector("#affinity tbody"), affinity.by_box.map((row) => el("tr", { "data-box": row.box, "data-model": row.model },
    el("td", {}, row.box),
    el("td", { class: "mono" }, row.model),
    el("td", { class: "num" }, row.hit_ratio === null ? "—" : `${Math.round(row.hit_ratio * 100)} %`),
    el("td", { class: "num" }, `${row.hit} / ${row.miss} / ${row.none}`),
    el("td", { class: "num" }, String(row.cached_tokens)))));
}

function renderState(state) {
  view.boxes = state.boxes;
  replaceRows(document.querySelector("#boxes tbody"), state.boxes.map((box) => el("tr",
    { "data-box": box.name, "data-status": box.online ? "online" : "offline" },
    el("td", { title: box.url }, el("strong", {}, box.name)),
    el("td", {}, box.kind),
    el("td", {}, box.pool || "—"),
    statusCell(box),
    pressureCell(box.pressure),
    el("td", { class: "num" }, box.pending),
    el("td", { class: "num" }, box.reservations),
    el("td", { class: "num", title: box.limit_source || "no limit" },
      box.max_inflight === null ? String(box.in_flight) : `${box.in_flight} / ${box.max_inflight}`,
      box.full ? " " : null, box.full ? tag("full", "full") : null),
    backoffCell(box),
    el("td", { class: "num" }, bytes(box.free_gpu_bytes)),
    residentCell(box))));
  renderQueue(state.queue);
  renderRouters(state.shared);
  renderAffinity(state.affinity);
  if (state.batches) { // between the panel's polls, the runner's counts move with the stream
    view.batchLines = state.batches;
    renderBatchesSummary();
  }
  replaceRows(document.querySelector("#models tbody"), state.models.map((model) => el("tr", { "data-model": model.model },
    el("td", { class: "mono" }, model.model, ...otherSpellings(model)),
    el("td", {}, model.resident_on.join(", ") || "—"),
    el("td", {}, model.available_on.join(", ") || "—"))));
  replaceRows(document.querySelector("#aliases tbody"), state.aliases.map((alias) => el("tr", { "data-alias": alias.name },
    el("td", { class: "mono" }, alias.name,
      alias.shadowed_by.length ? " " : null, alias.shadowed_by.length ? tag("shadowed", "full") : null),
    // a model no box lists now (a typo, not pulled yet) is marked
    el("td", { class: "mono" }, ...alias.chain.flatMap((model, i) => [i ? " → " : null, model,
      ...(alias.unlisted.includes(model) ? [" ", el("span", { class: "tag full", title: "no box lists it now" }, "unlisted")] : [])])),
    el("td", { class: "mono" }, alias.first_available || "none now"))));
  renderSeries();
}

// One model under several names: an Ollama box's `tiny-llama:latest` is another box's
// `tiny-llama` (the router's Ollama name rule, GET /v1/router/state's `names`).
function otherSpellings(model) {
  const others = model.names.filter((name) => name !== model.model);
  return others.length ? [el("span", { class: "settings" }, " also " + others.join(", "))] : [];
}

// --- the keys panel: usage against limits -----------------------------------------------------

function ofLimit(left, limit) {
  return limit === null || limit === undefined ? "—" : `${left} / ${limit}`;
}

function renderKeys(keys) {
  replaceRows(document.querySelector("#keys tbody"), keys.map((key) => {
    const now = key.current, limits = key.limits, left = key.left;
    const spent = now.prompt_tokens + now.completion_tokens;
    return el("tr", { "data-key": key.id },
      el("td", { class: "mono" }, key.id),
      el("td", {}, key.name),
      el("td", {}, `${key.period} from ${clock(now.start)}`),
      el("td", { class: "num" }, String(now.requests)),
      el("td", { class: "num" }, String(now.prompt_tokens)),
      el("td", { class: "num" }, String(now.completion_tokens)),
      el("td", { class: "num" }, String(now.cached_tokens)),
      el("td", { class: "num" }, limits.budget_tokens === null ? String(spent) : `${spent} / ${limits.budget_tokens}`),
      el("td", { class: "num" }, ofLimit(left.requests, limits.rpm)),
      el("td", { class: "num" }, ofLimit(left.tokens, limits.tpm)),
      el("td", { class: "num" }, ofLimit(left.parallel, limits.max_parallel)),
      el("td", {}, limits.models === null ? "all" : limits.models.join(", ")));
  }));
}

async function pollKeys() {
  if (view.lastEventAt && Date.now() - view.lastEventAt < STALE_MS) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const response = await fetch(KEYS_USAGE_PATH, { headers, cache: "no-store", credentials: "omit" });
      if (response.ok) renderKeys((await response.json()).keys);
    } catch (err) { /* the stream's own retry says the router is gone */ }
  }
  setTimeout(pollKeys, KEYS_EVERY_MS);
}

// --- the batches panel: progress, pace, status -------------------------------------------------

// Statuses a batch may still move from, and the tag colour of each.
const LIVE_BATCH = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const BATCH_TAG = {
  validating: "busy", in_progress: "busy", finalizing: "busy", completed: "online",
  cancelling: "blocked", cancelled: "blocked", expired: "offline", failed: "offline",
};

function linesDone(batch) {
  return batch.request_counts.completed + batch.request_counts.failed;
}

// Lines done per second over the batch's polls of the last RATE_WINDOW_MS (null: one poll so far).
function batchRate(batch, now) {
  const samples = view.batchSamples.get(batch.id) || [];
  samples.push([now, linesDone(batch)]);
  while (samples.length > 2 && samples[0][0] < now - RATE_WINDOW_MS) samples.shift();
  view.batchSamples.set(batch.id, samples);
  const [first, last] = [samples[0], samples[samples.length - 1]];
  return last[0] > first[0] ? (last[1] - first[1]) / ((last[0] - first[0]) / 1000) : null;
}

function progressCell(batch) {
  const counts = batch.request_counts;
  if (!counts.total) {
    const errors = batch.errors ? batch.errors.data.length : 0;
    return el("td", { class: "muted" }, errors ? `${errors}${errors === 100 ? "+" : ""} bad lines in its file` : "—");
  }
  return el("td", {}, progressBar(counts),
    el("span", { class: "batch-counts" }, `${counts.completed} + ${counts.failed} of ${counts.total}`));
}

// A bar of the lines done: the completed ones green, then the failed ones red, of the total.
function progressBar(counts) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "batch-bar");
  svg.setAttribute("viewBox", "0 0 100 8");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("data-done", String(counts.completed + counts.failed));
  svg.setAttribute("data-total", String(counts.total));
  let x = 0;
  for (const [part, width] of [["rest", 100], ["completed", (100 * counts.completed) / counts.total],
    ["failed", (100 * counts.failed) / counts.total]]) {
    const rect = document.createElementNS(SVG_NS, "rect");
    rect.setAttribute("class", part);
    rect.setAttribute("x", part === "rest" ? "0" : x.toFixed(2));
    rect.setAttribute("width", width.toFixed(2));
    rect.setAttribute("height", "8");
    if (part !== "rest") x += width;
    svg.append(rect);
  }
  return svg;
}

// The batches running (of those listed), and this router's lines: in flight, and by state.
function renderBatchesSummary() {
  const running = view.batches.filter((batch) => LIVE_BATCH.has(batch.status)).length;
  const lines = view.batchLines;
  const counted = lines ? Object.entries(lines.lines).filter(([, count]) => count).map(([state, count]) => `${count} ${state}`) : [];
  document.querySelector("#batches-summary").textContent =
    `${running} running` + (lines ? `; this router runs ${lines.inflight} of their lines now` : "") +
    (counted.length ? `; its lines since it started: ${counted.join(", ")}` : "") + ".";
}

function renderBatches() {
  const now = Date.now();
  for (const id of view.batchSamples.keys()) {
    if (!view.batches.some((batch) => batch.id === id && LIVE_BATCH.has(batch.status))) view.batchSamples.delete(id);
  }
  renderBatchesSummary();
  replaceRows(document.querySelector("#batches tbody"), view.batches.map((batch) => {
    const rate = LIVE_BATCH.has(batch.status) ? batchRate(batch, now) : null;
    return el("tr", { "data-batch": batch.id, "data-status": batch.status },
      el("td", { class: "mono" }, batch.id),
      el("td", {}, tag(batch.status.replace("_", " "), BATCH_TAG[batch.status] || "normal")),
      progressCell(batch),
      el("td", { class: "num batch-rate" }, rate === null ? "—" : `${rate.toFixed(1)}/s`),
      el("td", { class: "mono" }, batch.endpoint),
      el("td", {}, clock(batch.created_at)));
  }));
}

async function pollBatches() {
  if (view.lastEventAt && Date.now() - view.lastEventAt < STALE_MS) {
    const key = sessionStorage.getItem(KEY_ITEM);
    const headers = key ? { Authorization: "Bearer " + key } : {};
    try {
      const response = await fetch(BATCHES_PATH, { headers, cache: "no-store", credentials: "omit" });
      if (response.ok) {
        view.batches = (await response.json()).data;
        renderBatches();
      }
    } catch (err) { /* the stream's own retry says the router is gone */ }
  }
  setTimeout(pollBatches, BATCHES_EVERY_MS);
}

// --- the per-box plots ------------------------------------------------------------------------

function sparkline(lines) {
  // lines: [{values: [number|null], color}], plotted on one scale; a null leaves a gap.
  const width = 160, height = 28, pad = 2;
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("class", "spark");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const all = lines.flatMap((line) => line.values.filter((v) => v !== null));
  const top = Math.max(...all, 0) || 1;
  const slots = Math.min(MAX_POINTS, Math.max(MIN_PLOT_POINTS, ...lines.map((line) => line.values.length)));
  const step = width / (slots - 1);
  for (const line of lines) {
    const offset = slots - line.values.length; // the newest point sits at the right edge
    let segment = [];
    const flush = () => {
      if (segment.length) {
        const poly = document.createElementNS(SVG_NS, "polyline");
        poly.setAttribute("points", segment.join(" "));
        poly.setAttribute("stroke", line.color);
        svg.append(poly);
      }
      segment = [];
    };
    line.values.forEach((value, index) => {
      if (value === null) return flush();
      const x = (offset + index) * step;
      const y = height - pad - (value / top) * (height - 2 * pad);
      segment.push(`${x.toFixed(1)},${y.toFixed(1)}`);
    });
    flush();
  }
  return svg;
}

function seriesOf(box, field) {
  return view.points.map((point) => {
    const entry = point.boxes[box];
    if (!entry) return field === "calls" || field === "errors" ? 0 : null;
    return field === "calls" || field === "errors" ? entry[field] / point.step_s : entry[field];
  });
}

function recent(values, rate) {
  // the last LABEL_POINTS values: their mean for a rate, else the newest one there is
  const tail = values.slice(-LABEL_POINTS);
  if (rate) return tail.length ? tail.reduce((sum, v) => sum + v, 0) / tail.length : 0;
  const known = tail.filter((v) => v !== null);
  return known.length ? known[known.length - 1] : null;
}

function renderSeries() {
  const names = new Set(view.boxes.map((box) => box.name));
  for (const point of view.points) for (const name of Object.keys(point.boxes)) names.add(name);
  replaceRows(document.querySelector("#series tbody"), [...names].map((name) => {
    const plot = (fields, text) => {
      const lines = fields.map(([field, color]) => ({ values: seriesOf(name, field), color }));
      return el("td", {}, sparkline(lines), el("span", { class: "spark-label" }, text(lines.map((l) => l.values))));
    };
    return el("tr", { "data-box": name },
      el("td", {}, el("strong", {}, boxLabel(name))),
      plot([["calls", "var(--calls)"], ["errors", "var(--errors)"]],
        ([calls, errors]) => `${recent(calls, true).toFixed(1)}/s · ${recent(errors, true).toFixed(1)} err/s`),
      plot([["ttfb_p50_s", "var(--p50)"], ["ttfb_p99_s", "var(--p99)"]],
        ([p50, p99]) => `${ms(recent(p50))} · ${ms(recent(p99))}`),
      plot([["latency_p50_s", "var(--p50)"], ["latency_p99_s", "var(--p99)"]],
        ([p50, p99]) => `${ms(recent(p50))} · ${ms(recent(p99))}`));
  }));
}

function addPoints(points) {
  view.points.push(...points);
  view.points.splice(0, Math.max(0, view.points.length - MAX_POINTS));
  renderSeries();
}

// --- recent calls -----------------------------------------------------------------------------

function attemptsCell(row) {
  const cell = el("td", {});
  (row.attempts || []).forEach((attempt, index) => {
    if (index) cell.append(" → ");
    cell.append(attempt.box, " ", attempt.status === null || attempt.status === undefined ? "" : String(attempt.status));
    if (attempt.refusal) cell.append(" ", el("span", { class: "refusal" }, attempt.refusal));
  });
  if (!(row.attempts || []).length) cell.append(el("span", { class: "muted" }, row.error || "—"));
  return cell;
}

// The router column shows once there are several routers: on the shared server, or in the calls.
function showRouterColumn() {
  const several = view.routersHeard > 1 || view.routersInCalls.size > 1;
  document.querySelector("#calls").classList.toggle("several-routers", several);
}

const AFFINITY_TITLE = {
  hit: "affinity: went to the box its key pointed to",
  miss: "affinity: had a key, went elsewhere (or its key pointed nowhere yet)",
  none: "affinity: no key",
};

function affinityCell(affinity) {
  if (!affinity) return el("td", { class: "muted affinity", title: "affinity off" }, "—");
  const [outcome, kind] = affinity.split(":");
  const title = (AFFINITY_TITLE[outcome] || "affinity") + (kind ? ` (key from: ${kind})` : "");
  return el("td", { class: "muted affinity", title }, affinity);
}

function addCalls(rows) {
  const tbody = document.querySelector("#calls tbody");
  for (const row of rows) {
    if (row.router) view.routersInCalls.add(row.router);
    const ok = row.http_status !== null && row.http_status < 400 && row.state === "done";
    const firstByte = row.first_byte_at ? row.first_byte_at - row.received_at : null;
    const total = row.responded_at ? row.responded_at - row.received_at : null;
    tbody.prepend(el("tr", { class: "fresh", "data-call-id": row.request_id },
      el("td", {}, clock(row.received_at)),
      el("td", { class: "mono" }, row.request_id),
      el("td", { class: "router" }, row.router || "—"),
      el("td", {}, row.facade || "—"),
      el("td", { class: "mono" }, row.model || "—", row.options ? el("span", { class: "settings" }, " @" + row.options) : null),
      el("td", {}, row.box || "—"),
      affinityCell(row.affinity),
      el("td", { class: ok ? "status-ok" : "status-err" }, `${row.http_status ?? "—"} ${row.state}`),
      attemptsCell(row),
      el("td", { class: "num" }, ms(firstByte)),
      el("td", { class: "num" }, ms(total))));
  }
  while (tbody.rows.length > MAX_CALLS) tbody.deleteRow(tbody.rows.length - 1);
  showRouterColumn();
}

// --- scheduler snapshots ------------------------------------------------------------------------

let scheduleDrawPending = false;

function addSnapshot(snapshot) {
  view.snapshots.unshift(snapshot);
  view.snapshots.length = Math.min(view.snapshots.length, MAX_SNAPSHOTS);
  const now = Date.now();
  view.snapshotTimes.push(now);
  while (view.snapshotTimes.length && view.snapshotTimes[0] < now - 10000) view.snapshotTimes.shift();
  if (!scheduleDrawPending) { // they can come ten a second: draw at most once a frame
    scheduleDrawPending = true;
    requestAnimationFrame(drawSchedule);
  }
}

function pairs(doc) {
  return Object.entries(doc).map(([box, value]) => `${box} ${value}`).join(", ") || "—";
}

function drawSchedule() {
  scheduleDrawPending = false;
  document.getElementById("schedule-rate").textContent =
    `${(view.snapshotTimes.length / 10).toFixed(1)} snapshots/s over the last 10 s`;
  replaceRows(document.getElementById("schedule"), view.snapshots.map((snap) => el("li", { value: snap.generation },
    el("strong", {}, "order "), snap.order.join(" › ") || "—",
    el("span", { class: "muted" }, " · pending "), pairs(snap.pending),
    el("span", { class: "muted" }, " · pressure "), pairs(snap.pressure))));
}

// --- the stream -------------------------------------------------------------------------------

function setLink(state, text) {
  const link = document.getElementById("link");
  link.dataset.link = state;
  link.textContent = text;
}

function dispatch(block) {
  let name = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) name = line.slice(6).trim();
    else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
  }
  if (!data.length) return;
  const doc = JSON.parse(data.join("\n"));
  view.lastEventAt = Date.now();
  setLink("live", "live");
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString([], { hour12: false });
  if (name === "state") renderState(doc);
  else if (name === "calls") addCalls(doc.rows);
  else if (name === "series") addPoints(doc.points);
  else if (name === "schedule:priority") addSnapshot(doc);
}

function askForKey(message) {
  setLink("key", "key needed");
  document.getElementById("key-reason").textContent = message;
  document.getElementById("key-form").hidden = false;
  document.getElementById("main").hidden = true;
  document.getElementById("key-input").focus();
}

function retry(why) {
  setLink("down", `disconnected (${why}); retrying`);
  setTimeout(connect, RETRY_MS);
}

async function connect() {
  if (view.connecting) return;
  view.connecting = true;
  try {
    await follow();
  } finally {
    view.connecting = false;
  }
}

async function follow() {
  setLink("connecting", "connecting…");
  const key = sessionStorage.getItem(KEY_ITEM);
  const headers = { Accept: "text/event-stream" };
  if (key) headers.Authorization = "Bearer " + key;
  let response;
  try {
    response = await fetch(EVENTS_PATH, { headers, cache: "no-store", credentials: "omit" });
  } catch (err) {
    retry("the router did not answer");
    return;
  }
  if (response.status === 401 || response.status === 403) {
    let message = "An admin key is needed from here.";
    try {
      message = (await response.json()).error.message || message;
    } catch (err) { /* not the router's JSON: keep the plain message */ }
    if (key) sessionStorage.removeItem(KEY_ITEM); // refused: ask again rather than retry it
    askForKey(message);
    return;
  }
  if (!response.ok) {
    retry(`HTTP ${response.status}`);
    return;
  }
  document.getElementById("key-form").hidden = true;
  document.getElementById("main").hidden = false;
  view.points = [];
  view.routersInCalls.clear();
  document.querySelector("#calls tbody").replaceChildren();
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        dispatch(buffer.slice(0, cut));
        buffer = buffer.slice(cut + 2);
      }
    }
  } catch (err) { /* the connection dropped: reconnect below */ }
  retry("the stream ended");
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("key-input");
  const key = input.value.trim();
  input.value = "";
  if (!key) return;
  sessionStorage.setItem(KEY_ITEM, key);
  connect();
});

setInterval(() => {
  const link = document.getElementById("link");
  if (link.dataset.link === "live" && Date.now() - view.lastEventAt > STALE_MS) setLink("stale", "no news from the router");
}, 1000);

connect();

pollKeys();

pollBatches();
