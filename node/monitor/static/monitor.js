// The murmur monitor page: loads the JSON API once, then follows /api/events (server-sent events).
// Charts and the graph are plain SVG drawn here; nothing is loaded from elsewhere.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const STALE_AFTER_MS = 3500; // the node pushes an update every second; silence this long means trouble
const LOG_KEEP = 100;

const state = { status: null, peers: [], topology: null, samples: [], log: [], lastUpdate: 0, online: null,
                capacity: 1800, swarm: null, swarmPoints: [] };

function $(id) { return document.getElementById(id); }

function el(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function shortId(id) { return id ? id.slice(-8) : "?"; }

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "—";
  if (Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toString();
}

function fmtBytes(v) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return `${fmt(v, 3)} ${units[i]}`;
}

function fmtDuration(s) {
  s = Math.max(0, Math.floor(s));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
  return h ? `${h} h ${m} min` : m ? `${m} min ${s % 60} s` : `${s} s`;
}

function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

async function getJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// ---- header and connection ------------------------------------------------------------------------

function renderHeader() {
  const s = state.status;
  if (!s) return;
  $("swarm").textContent = s.swarm;
  $("node-id").textContent = s.peer_id;
  $("node-id").title = s.peer_id;
  $("peers-alive").textContent = state.peers.length;
  $("step").textContent = s.step;
  $("round").textContent = s.round;
  $("loss").textContent = s.loss === null ? "no model" : fmt(s.loss);
  $("throughput").textContent = s.tokens_per_s === null ? "—" : fmt(s.tokens_per_s, 3);
  $("experts").textContent = s.experts.length ? s.experts.join(", ") : "none";
  const training = s.training || {};
  $("bytes-per-token").textContent = training.bytes_per_token == null ? "—" : fmt(training.bytes_per_token, 3);
  const outer = training.diloco;  // gossip DiLoCo's outer loop; absent for the other optimizers
  $("outer-fact").hidden = $("in-flight-fact").hidden = !outer;
  if (outer) {
    $("outer-step").textContent = `${outer.outer_step} (H ${outer.sync_period})`;
    $("in-flight").textContent = `${outer.fragments_in_flight} of ${outer.fragments}`;
  }
  const join = s.join;  // a catch-up's downloads while they run; null otherwise
  $("download-fact").hidden = !join;
  if (join) {
    const pct = join.bytes_total ? Math.floor(100 * join.bytes_done / join.bytes_total) : 0;
    const eta = join.eta_s == null ? "" : `, ${fmtDuration(join.eta_s)} left`;
    $("download").textContent = `${fmtBytes(join.bytes_done)} / ${fmtBytes(join.bytes_total)} (${pct}%) ` +
      `at ${fmtBytes(join.rate_bps)}/s${eta}`;
    $("download").title = `from ${join.donors.join(", ")}`;
  }
  $("uptime").textContent = fmtDuration(s.uptime_s);
  $("reach").textContent = reachText(s.reachability);
  $("reach").title = s.reachability ? s.reachability.detail : "";
  const errors = Object.entries(s.errors);
  $("errors-caption").textContent = errors.length
    ? "errors so far: " + errors.map(([k, n]) => `${k} ${n}`).join(", ") : "no errors so far";
  document.title = `murmur ${s.swarm} · ${state.peers.length} peers · step ${s.step}`;
}

function setOnline(online, why) {
  if (online === state.online && online) return;
  state.online = online;
  const line = $("connection");
  line.dataset.state = online ? "live" : "offline";
  line.textContent = online ? "live" : "NOT ANSWERING";
  $("offline").hidden = online;
  if (!online) {
    const since = state.lastUpdate ? `No update since ${new Date(state.lastUpdate).toLocaleTimeString()}` : "No answer yet";
    $("offline-detail").textContent = `${since}${why ? ` (${why})` : ""}.`;
  }
}

function reachText(r) {
  if (!r) return "—";
  if (r.reach !== "private") return r.reach === "public" ? "directly" : "unknown";
  const lost = r.relays.filter((x) => x.lost_at !== null && !x.held).length;
  return `via ${r.relays_held} relay${r.relays_held === 1 ? "" : "s"}` + (lost ? ` (${lost} lost)` : "");
}

// ---- peers table --------------------------------------------------------------------------------

const LINK_TITLES = {
  direct: "a direct connection",
  relayed: "through a relay's circuit (one of the two is behind NAT)",
  holepunched: "direct, through a hole punched in both NATs",
  none: "no connection right now",
};

function renderPeers() {
  const body = $("peers");
  body.replaceChildren();
  const now = Date.now() / 1000;
  for (const p of state.peers) {
    const row = document.createElement("tr");
    row.dataset.peerId = p.peer_id;
    if (p.self) row.className = "self";
    const link = p.self ? "—" : (p.connection || "none");
    const cells = [
      [shortId(p.peer_id), "mono", p.peer_id], [p.address || "—", "mono"],
      [link, `link ${link}`, LINK_TITLES[link] || ""],
      [p.goodput_mbit_s == null ? "—" : `${fmt(p.goodput_mbit_s, 3)} Mbit/s`], [p.step], [p.round],
      [p.loss === null ? "—" : fmt(p.loss)], [`${fmt(Math.max(0, now - p.last_seen), 2)} s ago`, "", clock(p.last_seen)],
      [p.experts.length ? p.experts.join(", ") : "—"],
    ];
    for (const [text, cls, title] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      if (title) td.title = title;
      row.appendChild(td);
    }
    body.appendChild(row);
  }
  $("peers-caption").textContent = `${state.peers.length} alive (records expire after ${fmt(state.recordTtl ?? 0, 2)} s)`;
}

// ---- swarm view ---------------------------------------------------------------------------------

function fmtCount(v) { return Math.round(v).toLocaleString("en-US"); }

function renderSwarm() {
  const w = state.swarm;
  if (!w) return;
  $("swarm-peers-count").textContent = w.peers.length;
  $("swarm-loss").textContent = w.loss === null ? "—" : fmt(w.loss);
  $("swarm-throughput").textContent = fmt(w.tokens_per_s, 3);
  $("swarm-tokens").textContent = fmtCount(w.tokens);
  const body = $("swarm-peers");
  body.replaceChildren();
  for (const p of w.peers) {
    const row = document.createElement("tr");
    row.dataset.peerId = p.peer_id;
    row.dataset.step = p.step;
    row.dataset.tokens = p.tokens;
    row.dataset.points = p.points;
    if (p.self) row.className = "self";
    const link = p.self ? "—" : (p.connection || "none");
    const score = p.score === null ? "–" : fmt(p.score, 3);
    const cells = [
      [shortId(p.peer_id), "mono peer", p.peer_id], [p.step, "step"], [p.loss === null ? "—" : fmt(p.loss), "loss"],
      [fmt(p.tokens_per_s, 3), "rate"], [p.reach, "reach"], [link, `link ${link}`, LINK_TITLES[link] || ""],
      [fmtDuration(p.uptime_s), "uptime"], [fmtCount(p.tokens), "tokens"],
      [fmtCount(Math.round(p.points)), "points", "tokens weighed by the contribution score"],
      [`${(100 * p.share).toFixed(1)}%`, "share"],
      [score, "score", p.score_state ? `${p.score_state}, ${p.rated_rounds} rated round(s)` : "not rated by this node"],
    ];
    for (const [text, cls, title] of cells) {
      const td = document.createElement("td");
      td.textContent = text;
      if (cls) td.className = cls;
      if (title) td.title = title;
      if (cls === "score" && p.score_state) td.dataset.state = p.score_state;
      row.appendChild(td);
    }
    body.appendChild(row);
  }
  $("swarm-caption").textContent = "as this node's view of the peers' records has it";
  const points = state.swarmPoints;
  drawChart($("chart-swarm-loss"), [{ name: "mean loss", cls: "s0", points: pointsOf(points, "loss") }],
            { empty: "no peer has published a loss yet" });
  drawChart($("chart-swarm-throughput"), [{ name: "tokens/s", cls: "s2", points: pointsOf(points, "tokens_per_s") }],
            { empty: "no points yet" });
}

function addSwarm(swarm) {
  state.swarm = swarm;
  const last = state.swarmPoints[state.swarmPoints.length - 1];
  for (const p of swarm.history) {
    if (last && p.t < last.t) state.swarmPoints = []; // the node restarted: its history began anew
    const newest = state.swarmPoints[state.swarmPoints.length - 1];
    if (!newest || p.t > newest.t) state.swarmPoints.push(p);
  }
  state.swarmPoints = state.swarmPoints.slice(-swarm.capacity);
}

// ---- topology graph -----------------------------------------------------------------------------

function renderTopology() {
  const t = state.topology, svg = $("topology");
  if (!t) return;
  svg.replaceChildren();
  const defs = el("defs");
  for (const [id, color] of [["arrow", "#2563eb"], ["arrow-mine", "#dc2626"]]) {
    const marker = el("marker", { id, viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 6, markerHeight: 6,
                                  orient: "auto-start-reverse" });
    marker.appendChild(el("path", { d: "M0,0 L10,5 L0,10 z", fill: color }));
    defs.appendChild(marker);
  }
  svg.appendChild(defs);
  const n = t.nodes.length, cx = 160, cy = 160, r = n > 1 ? 115 : 0, nodeR = 18;
  const pos = new Map();
  t.nodes.forEach((node, i) => {
    const a = -Math.PI / 2 + (2 * Math.PI * i) / Math.max(n, 1);
    pos.set(node.peer_id, [cx + r * Math.cos(a), cy + r * Math.sin(a)]);
  });
  const edges = el("g", { class: "edges" });
  for (const e of t.edges) {
    const [x1, y1] = pos.get(e.source), [x2, y2] = pos.get(e.target);
    const dx = x2 - x1, dy = y2 - y1, len = Math.hypot(dx, dy) || 1;
    // both directions of a pair are drawn side by side, not on top of each other
    const ox = (-dy / len) * 4, oy = (dx / len) * 4;
    const mine = e.source === t.self || e.target === t.self;
    const line = el("line", {
      class: `edge current${mine ? " mine" : ""}`, "data-source": e.source, "data-target": e.target,
      x1: x1 + (dx / len) * nodeR + ox, y1: y1 + (dy / len) * nodeR + oy,
      x2: x2 - (dx / len) * (nodeR + 2) + ox, y2: y2 - (dy / len) * (nodeR + 2) + oy,
      "stroke-width": 1 + 4 * e.weight, "marker-end": `url(#${mine ? "arrow-mine" : "arrow"})`,
    });
    line.appendChild(el("title", {}, `${shortId(e.target)} mixes in ${shortId(e.source)} with weight ${fmt(e.weight, 3)}`));
    edges.appendChild(line);
  }
  svg.appendChild(edges);
  for (const node of t.nodes) {
    const [x, y] = pos.get(node.peer_id);
    const g = el("g", { class: `node${node.self ? " self" : ""}${node.rank === null ? " idle" : ""}`,
                        "data-peer-id": node.peer_id });
    g.appendChild(el("circle", { cx: x, cy: y, r: nodeR }));
    g.appendChild(el("text", { x, y: y + 4, "text-anchor": "middle" }, node.rank === null ? "–" : node.rank));
    g.appendChild(el("text", { x, y: y + nodeR + 13, "text-anchor": "middle" }, shortId(node.peer_id)));
    g.appendChild(el("title", {}, `${node.peer_id}${node.self ? " (this node)" : ""}` +
                                  (node.rank === null ? ", not in this round" : `, rank ${node.rank}`)));
    svg.appendChild(g);
  }
  const parts = [`round ${t.round}`];
  if (t.topology) parts.push(`${t.topology} (${t.weights})`, `rho ${fmt(t.rho, 3)}`);
  else parts.push("gossip has not started");
  if (t.self_weight !== null) parts.push(`own weight ${fmt(t.self_weight, 3)}`);
  $("topology-caption").textContent = parts.join(" · ");
}

// ---- charts -------------------------------------------------------------------------------------

function drawChart(svg, series, { empty, format = fmt }) {
  svg.replaceChildren();
  const W = 600, H = 180, left = 58, right = 8, top = 22, bottom = 22;
  const drawn = series.filter((s) => s.points.length > 0);
  const all = drawn.flatMap((s) => s.points);
  svg.dataset.points = String(all.length);
  if (all.length === 0) {
    svg.appendChild(el("text", { class: "empty", x: W / 2, y: H / 2, "text-anchor": "middle" }, empty));
    return;
  }
  const ts = all.map((p) => p[0]), vs = all.map((p) => p[1]);
  let t0 = Math.min(...ts), t1 = Math.max(...ts), v0 = Math.min(...vs), v1 = Math.max(...vs);
  if (t1 - t0 < 1) t0 = t1 - 1;
  if (v1 - v0 < 1e-12) { const pad = Math.abs(v1) * 0.1 || 1; v0 -= pad; v1 += pad; }
  const x = (t) => left + ((t - t0) / (t1 - t0)) * (W - left - right);
  const y = (v) => top + (1 - (v - v0) / (v1 - v0)) * (H - top - bottom);
  const axes = el("g");
  for (const v of [v0, (v0 + v1) / 2, v1]) {
    axes.appendChild(el("line", { class: "axis", x1: left, x2: W - right, y1: y(v), y2: y(v) }));
    axes.appendChild(el("text", { x: left - 4, y: y(v) + 4, "text-anchor": "end" }, format(v)));
  }
  axes.appendChild(el("text", { x: left, y: H - 6 }, clock(t0)));
  axes.appendChild(el("text", { x: W - right, y: H - 6, "text-anchor": "end" }, clock(t1)));
  svg.appendChild(axes);
  drawn.forEach((s) => {
    const line = el("polyline", { class: `series ${s.cls}`, "data-series": s.name, "data-points": s.points.length,
                                  points: s.points.map(([t, v]) => `${x(t).toFixed(1)},${y(v).toFixed(1)}`).join(" ") });
    line.appendChild(el("title", {}, s.name));
    svg.appendChild(line);
    if (s.points.length === 1) {
      const [t, v] = s.points[0];
      svg.appendChild(el("circle", { class: `series ${s.cls}`, cx: x(t), cy: y(v), r: 2.5 }));
    }
  });
  const key = el("g", { class: "key" });
  drawn.forEach((s, i) => {
    const x0 = left + i * 100;
    key.appendChild(el("line", { class: `series ${s.cls}`, x1: x0, x2: x0 + 18, y1: 8, y2: 8 }));
    key.appendChild(el("text", { x: x0 + 22, y: 12 }, s.name));
  });
  svg.appendChild(key);
}

function pointsOf(samples, field) {
  return samples.filter((s) => s[field] !== null).map((s) => [s.t, s[field]]);
}

function rates(samples, field) {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = samples[i].t - samples[i - 1].t, db = samples[i][field] - samples[i - 1][field];
    if (dt > 0 && db >= 0) out.push([samples[i].t, db / dt]); // a restart resets the counters: skip the drop
  }
  return out;
}

function renderCharts() {
  const samples = state.samples, trains = state.status && state.status.training !== null;
  const neighbours = new Map();
  for (const s of samples) {
    for (const [peer, loss] of Object.entries(s.peer_loss)) {
      if (!neighbours.has(peer)) neighbours.set(peer, []);
      neighbours.get(peer).push([s.t, loss]);
    }
  }
  const lossSeries = [{ name: "loss", cls: "s0", points: pointsOf(samples, "loss") },
                      { name: "validation", cls: "s1", points: pointsOf(samples, "val_loss") }];
  [...neighbours.entries()].slice(0, 4).forEach(([peer, points], i) =>
    lossSeries.push({ name: shortId(peer), cls: `s${i + 2} neighbour`, points }));
  const noModel = "no loss: this node gossips a test vector and trains no model";
  drawChart($("chart-loss"), lossSeries, { empty: trains || samples.some((s) => s.loss !== null) ? "no loss yet" : noModel });
  drawChart($("chart-throughput"), [{ name: "tokens/s", cls: "s0", points: pointsOf(samples, "tokens_per_s") }],
            { empty: trains ? "no steps yet" : "no training: no tokens" });
  drawChart($("chart-traffic"), [{ name: "in", cls: "s0", points: rates(samples, "bytes_received") },
                                 { name: "out", cls: "s1", points: rates(samples, "bytes_sent") }],
            { empty: "no traffic yet", format: (v) => fmtBytes(v) + "/s" });
  drawChart($("chart-consensus"), [{ name: "distance", cls: "s2", points: pointsOf(samples, "consensus_distance") }],
            { empty: "no estimate yet (gossip has not mixed)" });
}

// ---- events log ---------------------------------------------------------------------------------

function addLog(entries) {
  const seen = new Set(state.log.map((e) => e.id));
  for (const e of entries) if (!seen.has(e.id)) state.log.push(e);
  state.log.sort((a, b) => a.id - b.id);
  state.log = state.log.slice(-LOG_KEEP);
}

function renderLog() {
  const list = $("log");
  list.replaceChildren();
  for (const e of [...state.log].reverse()) {
    const li = document.createElement("li");
    li.className = e.level;
    li.dataset.kind = e.kind;
    const time = document.createElement("time");
    time.textContent = clock(e.t);
    li.append(time, e.message);
    list.appendChild(li);
  }
  if (state.log.length === 0) {
    const li = document.createElement("li");
    li.textContent = "nothing yet";
    list.appendChild(li);
  }
}

function renderAll() { renderHeader(); renderSwarm(); renderPeers(); renderTopology(); renderCharts(); renderLog(); }

// ---- data flow ----------------------------------------------------------------------------------

async function loadAll() {
  const [status, peers, topology, history, log, swarm] = await Promise.all(
    ["/api/status", "/api/peers", "/api/topology", "/api/history", "/api/log", "/api/swarm"].map(getJSON));
  state.swarmPoints = [];
  addSwarm(swarm);
  state.status = status;
  state.peers = peers.peers;
  state.recordTtl = peers.record_ttl_s;
  state.topology = topology;
  state.samples = history.samples;
  state.capacity = history.capacity;
  addLog(log.entries);
  renderAll();
}

function applyUpdate(msg) {
  const last = state.samples[state.samples.length - 1];
  if (last && msg.sample.t < last.t) state.samples = []; // the node restarted: its history began anew
  if (!last || msg.sample.t > last.t) state.samples.push(msg.sample);
  state.samples = state.samples.slice(-state.capacity);
  state.status = msg.status;
  state.peers = msg.peers;
  state.topology = msg.topology;
  if (msg.swarm) addSwarm(msg.swarm);
  addLog(msg.log);
  renderAll();
}

function follow() {
  const source = new EventSource("/api/events");
  source.addEventListener("update", (event) => {
    state.lastUpdate = Date.now();
    setOnline(true);
    applyUpdate(JSON.parse(event.data));
  });
  source.addEventListener("open", () => {
    // after an outage the node may have restarted: take its whole state again
    if (state.online === false) loadAll().catch(() => {});
  });
  source.onerror = () => setOnline(false, "the event stream broke; retrying");
}

setInterval(() => {
  if (state.lastUpdate && Date.now() - state.lastUpdate > STALE_AFTER_MS) setOnline(false, "no updates");
}, 500);

window.addEventListener("DOMContentLoaded", () => {
  loadAll().then(() => setOnline(true)).catch((err) => setOnline(false, String(err.message || err)));
  follow();
});
