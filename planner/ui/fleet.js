// The rfork fleet page: polls /v1/fleet with the reader token kept in sessionStorage (this tab only)
// and draws it. Plain JS and inline SVG, no library. Every name the planner sends is put in the page
// as text (textContent, setAttribute), never parsed as markup.
"use strict";

const TOKEN_KEY = "rfork.fleet.token";
const POLL_MS = 1000;
const SVG = "http://www.w3.org/2000/svg";
let timer = null;

function el(tag, attrs, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function short(id) { return id ? String(id).slice(0, 8) : "?"; }

function fmtBytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  let v = Number(n);
  while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
  return (i === 0 ? v.toFixed(0) : v.toFixed(2)) + " " + units[i];
}

function fmtSeconds(s) {
  if (s === null || s === undefined) return "?";
  return s < 10 ? s.toFixed(2) + " s" : s < 120 ? s.toFixed(1) + " s" : (s / 60).toFixed(1) + " min";
}

function fmtRate(g) { return g === null || g === undefined ? "?" : g.toFixed(2); }

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

function setStatus(text, isError) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = isError ? "error" : "";
}

function fill(tableId, rows) {
  const body = document.querySelector("#" + tableId + " tbody");
  body.replaceChildren(...rows);
}

function cell(value, cls) { return el("td", cls ? { class: cls } : {}, value); }

// ---- identities, instances --------------------------------------------------------------------

function drawIdentities(view) {
  const count = {};
  for (const i of view.instances) count[i.identity_key] = (count[i.identity_key] || 0) + 1;
  fill("identities", view.identities.map((d) => {
    const anchor = d.anchors.length
      ? d.anchors.map((a) => "rank " + a.rank + " " + a.checksum_algorithm + (a.cryptographic ? " (cryptographic) " : " (not cryptographic) ") + a.digest_set + " by " + short(a.anchored_by)).join("; ")
      : "not anchored";
    return el("tr", { "data-identity": d.identity_key },
      cell(d.model, "model"), cell(d.revision), cell(d.framework), cell(d.dtype), cell(d.layout),
      cell(anchor, d.anchors.length ? "ok" : "bad"), cell(count[d.identity_key] || 0, "num"));
  }));
}

function modelOf(view) {
  const m = {};
  for (const d of view.identities) m[d.identity_key] = d.model;
  return m;
}

function drawInstances(view) {
  const model = modelOf(view);
  fill("instances", view.instances.map((i) => el("tr", { "data-instance": i.id, "data-state": i.status },
    cell(short(i.id), "id"), cell(model[i.identity_key] || short(i.identity_key)),
    cell(i.quarantine_reason !== null ? i.status + " (quarantined)" : i.status, "state-" + i.status),
    cell(i.labels.node), cell(i.labels.rack), cell(i.labels.zone),
    cell(i.pulls + " / " + i.max_concurrent_pulls, "num"), cell(fmtSeconds(i.heartbeat_age_s), "num"))));
}

// ---- the fan-out tree -------------------------------------------------------------------------

function treeOf(view) {
  const nodes = new Map();
  for (const i of view.instances) {
    nodes.set(i.id, { id: i.id, label: short(i.id), sub: i.status + (i.labels.node ? " @" + i.labels.node : ""),
      cls: i.quarantine_reason !== null ? "quarantined" : i.status, children: [], parent: null });
  }
  const pairs = new Map();  // seed|loader -> merged edge (one per rank)
  for (const e of view.edges) {
    const loader = e.loader_id || "pull:" + e.assignment_id;
    if (!nodes.has(e.seed_id)) continue;  // the seed was deleted: nothing to hang the edge on
    if (!nodes.has(loader)) {
      if (!e.live) continue;  // a finished pull whose loader did not become a seed
      nodes.set(loader, { id: loader, label: "loader", sub: "pulling rank " + e.rank, cls: "pulling", children: [], parent: null });
    }
    const key = e.seed_id + "|" + loader;
    const p = pairs.get(key) || { seed: e.seed_id, loader: loader, live: false, done: 0, total: 0, gbps: 0, transports: new Set(), ranks: [] };
    p.live = p.live || e.live;
    p.done += e.bytes_done;
    p.total += e.bytes_total || 0;
    p.gbps += e.gbps || 0;
    p.transports.add(e.transport);
    p.ranks.push(e.rank);
    pairs.set(key, p);
  }
  for (const p of pairs.values()) {
    const child = nodes.get(p.loader);
    if (child.parent !== null || p.seed === p.loader) continue;  // one parent per node: keep the newest
    child.parent = p;
    nodes.get(p.seed).children.push(child);
  }
  // nodes on a cycle (real pulls make none) have parents and so are not drawn; `place` never loops
  const roots = [...nodes.values()].filter((n) => n.parent === null);
  return roots;
}

function drawTree(view) {
  const svg = document.getElementById("tree");
  const roots = treeOf(view);
  const W = 150, H = 40, GAPX = 170, GAPY = 62;
  const items = [];
  let row = 0;
  let depthMax = 0;
  const seen = new Set();
  function place(n, depth) {
    if (seen.has(n.id)) return null;
    seen.add(n.id);
    depthMax = Math.max(depthMax, depth);
    const kids = n.children.map((c) => place(c, depth + 1)).filter((y) => y !== null);
    const y = kids.length ? (kids[0] + kids[kids.length - 1]) / 2 : (row++) * GAPY;
    items.push({ n: n, x: 10 + depth * (W + GAPX), y: 10 + y, depth: depth });
    n.y = 10 + y;
    n.x = 10 + depth * (W + GAPX);
    return y;
  }
  for (const r of roots) place(r, 0);
  const width = 20 + (depthMax + 1) * W + depthMax * GAPX;
  const height = Math.max(60, 20 + row * GAPY);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  const out = [];
  for (const it of items) {
    const p = it.n.parent;
    if (!p) continue;
    const parent = items.find((o) => o.n.id === p.seed);
    if (!parent) continue;
    const x1 = parent.x + W, y1 = parent.y + H / 2, x2 = it.x, y2 = it.y + H / 2;
    const mid = (x1 + x2) / 2;
    const cls = p.live ? "edge live" : "edge";
    out.push(el("svg:path", { class: cls, d: `M${x1},${y1} C${mid},${y1} ${mid},${y2} ${x2},${y2}`,
      "data-seed": p.seed, "data-loader": p.loader, "data-live": p.live }));
    const bytes = p.total ? fmtBytes(p.done) + " / " + fmtBytes(p.total) : fmtBytes(p.done);
    const rate = (p.gbps ? p.gbps.toFixed(2) + " GB/s" : "? GB/s") + " · " + [...p.transports].join("+");
    const lc = p.live ? "edge-label live" : "edge-label";
    out.push(el("svg:text", { class: lc, x: x1 + 10, y: y2 - 18 }, bytes));
    out.push(el("svg:text", { class: lc, x: x1 + 10, y: y2 - 5 }, rate));
  }
  for (const it of items) {
    const n = it.n;
    out.push(el("svg:g", { class: "node " + n.cls, "data-node": n.id, transform: `translate(${it.x},${it.y})` },
      el("svg:rect", { width: W, height: H }),
      el("svg:text", { x: 8, y: 16 }, n.label),
      el("svg:title", {}, n.id + " " + n.sub),
      el("svg:text", { x: 8, y: 32 }, n.sub.length > 24 ? n.sub.slice(0, 23) + "…" : n.sub)));
  }
  svg.replaceChildren(...out);
}

// ---- transfers, plot, refusals -----------------------------------------------------------------

function drawTransfers(view) {
  fill("transfers", view.transfers.map((t) => el("tr", { "data-transfer": t.assignment_id, "data-outcome": t.outcome },
    cell(clock(t.ended_at)), cell(short(t.seed_id) + " → " + (t.loader_id ? short(t.loader_id) : "loader"), "id"),
    cell(t.rank, "num"), cell(t.transport), cell(fmtBytes(t.bytes), "num"), cell(fmtSeconds(t.seconds), "num"),
    cell(fmtRate(t.gbps), "num"),
    cell(t.outcome === "success" ? "verified" : t.outcome + (t.reason ? ": " + t.reason : ""), t.outcome === "success" ? "ok" : "bad"))));
  drawPlot(view);
}

function drawPlot(view) {
  const svg = document.getElementById("plot");
  const W = 640, H = 170, L = 44, B = 24, T = 10, R = 10;
  const pts = view.transfers.filter((t) => t.gbps !== null);
  const out = [el("svg:line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }),
    el("svg:line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }),
    el("svg:text", { x: L + 6, y: T + 10 }, "GB/s")];
  if (pts.length) {
    const t0 = Math.min(...pts.map((p) => p.ended_at)), t1 = Math.max(...pts.map((p) => p.ended_at), t0 + 1);
    const g1 = Math.max(...pts.map((p) => p.gbps)) * 1.1 || 1;
    const x = (t) => L + (t - t0) / (t1 - t0) * (W - L - R);
    const y = (g) => H - B - g / g1 * (H - B - T);
    out.push(el("svg:text", { x: 4, y: y(g1 / 1.1) + 4 }, g1 > 10 ? (g1 / 1.1).toFixed(0) : (g1 / 1.1).toFixed(2)));
    out.push(el("svg:text", { x: L, y: H - 6 }, clock(t0)));
    out.push(el("svg:text", { x: W - R - 60, y: H - 6 }, clock(t1)));
    for (const p of pts) {
      out.push(el("svg:circle", { class: p.outcome, cx: x(p.ended_at).toFixed(1), cy: y(p.gbps).toFixed(1), r: 3.5 },
        el("svg:title", {}, fmtRate(p.gbps) + " GB/s, " + short(p.seed_id))));
    }
  } else {
    out.push(el("svg:text", { x: L + 10, y: H / 2 }, "no finished pulls yet"));
  }
  svg.replaceChildren(...out);
}

function drawRefusals(view) {
  const model = modelOf(view);
  const rows = [];
  for (const i of view.instances) {
    if (i.quarantine_reason === null) continue;
    rows.push(el("tr", { "data-quarantine": i.id },
      cell(i.quarantined_for_s === null ? "until re-verified" : "for " + fmtSeconds(i.quarantined_for_s)),
      cell(i.accused ? "accused" : "quarantine", "bad"), cell(short(i.id), "id"), cell(""),
      cell(i.quarantine_reason || ""), cell(model[i.identity_key] || "")));
  }
  for (const f of view.flagged_reporters || []) {
    rows.push(el("tr", { "data-flagged": f.reporter },
      cell("ignored"), cell("flagged reporter", "bad"), cell(f.reporter, "id"), cell(""),
      cell(f.disproved + " checksum claim(s) disproved"), cell("its checksum reports are ignored")));
  }
  for (const r of view.refusals) {
    rows.push(el("tr", { "data-refusal": r.reason },
      cell(clock(r.at)), cell("refused"), cell(model[r.identity_key] || short(r.identity_key)), cell(r.rank, "num"),
      cell(r.reason), cell(r.detail)));
  }
  fill("refusals", rows);
}

// ---- polling and the token ---------------------------------------------------------------------

function hide() {
  document.getElementById("fleet").hidden = true;
  for (const id of ["identities", "instances", "transfers", "refusals"]) fill(id, []);
  for (const id of ["tree", "plot"]) document.getElementById(id).replaceChildren();
}

// Why the last token was refused: shown until the user gives another token (a poll without one
// would otherwise replace it with the generic prompt a second later).
let refused = null;

async function poll() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  let resp;
  try {
    // without a token too: an insecure planner (planner serve --insecure) answers anyone
    const headers = token ? { Authorization: "Bearer " + token } : {};
    resp = await fetch("/v1/fleet", { headers: headers, cache: "no-store" });
  } catch (err) {
    setStatus("planner unreachable: " + err, true);
    return;
  }
  if (resp.status === 401 || resp.status === 403) {
    if (token) {
      sessionStorage.removeItem(TOKEN_KEY);
      refused = "The planner refused this token (" + resp.status + "). Paste a reader token.";
    }
    hide();
    document.getElementById("login").hidden = false;
    setStatus(refused || "Paste a reader token to see the fleet.", refused !== null);
    return;
  }
  if (!resp.ok) { setStatus("planner answered " + resp.status, true); return; }
  const view = await resp.json();
  drawIdentities(view);
  drawInstances(view);
  drawTree(view);
  drawTransfers(view);
  drawRefusals(view);
  document.getElementById("fleet").hidden = false;
  document.getElementById("login").hidden = !token;  // no token and an answer: the planner needs none
  const live = view.edges.filter((e) => e.live).length;
  const open = token ? "" : " · this planner runs without auth (no token needed)";
  setStatus("updated " + clock(view.now) + " · " + view.instances.length + " instances · " + live + " pulls in progress" + open, false);
  document.body.setAttribute("data-updated", String(view.now));
}

function schedule() {
  if (timer !== null) clearTimeout(timer);
  poll().finally(() => { timer = setTimeout(schedule, POLL_MS); });
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const input = document.getElementById("token");
    const token = input.value.trim();
    input.value = "";
    if (token) {
      sessionStorage.setItem(TOKEN_KEY, token);
      refused = null;  // a new token: the old refusal no longer applies
    }
    schedule();
  });
  document.getElementById("forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    refused = null;
    hide();
    setStatus("Token forgotten. Paste a reader token to see the fleet.", false);
  });
  schedule();
});
