// starpo-jax run report: draws curves and trajectories from the JSON block #report-data.
// Plain DOM and SVG, no library, no network. Model text is only ever set as textContent.
"use strict";

const DATA = JSON.parse(document.getElementById("report-data").textContent);
const RUNS = DATA.runs;
const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"];
const DASHES = ["", "6 4", "2 3", "8 3 2 3", "1 5"];
const PAGE_SIZE = 10;
const STORE_KEY = "starpo-report-ui";

// ---- small DOM helpers -------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else if (k === "on") for (const [ev, fn] of Object.entries(v)) node.addEventListener(ev, fn);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c) node.append(c);
  return node;
}

function fmt(v, digits = 3) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
  return String(Number(v.toFixed(digits)));
}

function select(label, options, value, onChange, cls = "") {
  const s = el("select", { "aria-label": label, class: cls, on: { change: (e) => onChange(e.target.value) } });
  for (const [v, text] of options) {
    const o = el("option", { value: v, text });
    if (String(v) === String(value)) o.selected = true;
    s.append(o);
  }
  return el("label", { class: "filter" }, el("span", { text: label }), s);
}

// ---- UI state (kept across the reloads of --serve) ------------------------------------------------

const UI = Object.assign(
  { cmpRun: 0, cmpTag: "", cmpSeed: "", explore: "" },
  (() => { try { return JSON.parse(sessionStorage.getItem(STORE_KEY)) || {}; } catch (e) { return {}; } })(),
);
// The filters of each trajectory section (KINDS), apart.
const VIEW = () => ({ run: 0, step: "all", tag: "all", outcome: "all", search: "", page: 0 });
UI.views = Object.assign({ val: VIEW(), train: VIEW() }, UI.views);
function saveUI() { try { sessionStorage.setItem(STORE_KEY, JSON.stringify(UI)); } catch (e) { /* file:// in some browsers */ } }

// ---- curves --------------------------------------------------------------------------------------

function metricNames() {
  const names = new Set();
  for (const run of RUNS) for (const row of run.metrics) for (const k of Object.keys(row)) if (k !== "step") names.add(k);
  return [...names].sort();
}

function tagsOf(pattern) {
  const tags = new Set();
  for (const name of metricNames()) { const m = name.match(pattern); if (m) tags.add(m[1]); }
  return [...tags].sort();
}

// What success means in an env (its contract's success_meaning), from the first run that knows it.
function successMeaning(tag) {
  for (const run of RUNS) { const env = run.envs[tag]; if (env && env.success) return env.success; }
  return null;
}

// Each panel: a title, an optional caption and its series (metric name, legend label, dashed for validation).
function panels() {
  const list = [];
  const trainTags = tagsOf(/^train\/([^/]+)\/success$/), valTags = tagsOf(/^val-env\/([^/]+)\/success$/);
  for (const tag of [...new Set([...trainTags, ...valTags])].sort()) {
    const meaning = successMeaning(tag);
    list.push({ title: `Success: ${tag}`, caption: meaning && `success: ${meaning}`, series: [
      { key: `train/${tag}/success`, label: "train" }, { key: `val-env/${tag}/success`, label: "validation", val: true }] });
  }
  list.push(
    { title: "Reward (mean per trajectory)", series: [
      { key: "train/reward/mean", label: "train" }, { key: "val-env/reward/mean", label: "validation", val: true }] },
    { title: "In-group reward std", series: [
      { key: "rollout/in_group_std", label: "all groups" }, { key: "rollout/chosen_in_group_std", label: "kept groups" }] },
    { title: "Entropy", series: [{ key: "actor/entropy_loss", label: "actor entropy" }] },
    { title: "Template collapse: MI of answer and board (0: answers ignore the board)", series:
      tagsOf(/^(?:train|val-env)\/([^/]+)\/mi$/).flatMap((tag) => [
        { key: `train/${tag}/mi`, label: `train ${tag}` }, { key: `val-env/${tag}/mi`, label: `validation ${tag}`, val: true }]) },
    { title: "Gradient norm", series: [
      { key: "actor/grad_norm", label: "actor" }, { key: "critic/grad_norm", label: "critic" }] },
    { title: "Response length (tokens)", series: [
      { key: "train/response_length", label: "train" }, { key: "val-env/response_length", label: "validation", val: true }] },
    { title: "Think length (tokens)", series: [
      { key: "train/think_length", label: "train" }, { key: "val-env/think_length", label: "validation", val: true }] },
    { title: "Reasoning diversity (distinct 2-grams of think texts, validation)", series:
      diversityTags().map((tag) => ({ key: `val-env/${tag}/think_distinct_2gram`, label: tag, val: true, fromDumps: tag })) },
    { title: "Generated tokens / s", series: [{ key: "perf/generated_tokens_per_s", label: "rollout" }] },
    { title: "Env steps / s", series: [{ key: "perf/env_steps_per_s", label: "rollout" }] },
    { title: "Seconds per step", series: [
      { key: "timing_s/gen", label: "rollout" }, { key: "timing_s/update", label: "update" }, { key: "timing_s/step", label: "step" }] },
  );
  return list;
}

function diversityTags() {
  const tags = new Set(tagsOf(/^val-env\/([^/]+)\/think_distinct_2gram$/));
  for (const run of RUNS) for (const byTag of Object.values(run.diversity)) for (const tag of Object.keys(byTag)) tags.add(tag);
  return [...tags].sort();
}

// Points of one series of one run: logged metrics, or (diversity of older runs) the dumps.
function points(run, s) {
  const pts = [];
  for (const row of run.metrics) if (typeof row[s.key] === "number") pts.push([row.step, row[s.key]]);
  if (!pts.length && s.fromDumps) {
    for (const [step, byTag] of Object.entries(run.diversity)) {
      const v = byTag[s.fromDumps] && byTag[s.fromDumps].distinct_2gram;
      if (typeof v === "number") pts.push([Number(step), v]);
    }
  }
  return pts.sort((a, b) => a[0] - b[0]);
}

// Whether a curve breaks between its consecutive points at steps a < b: a broken metrics line lies
// between them and they are further apart than the curve's closest two points (spacing), so a point
// of it may be what the line logged. A series logged every k steps (validation) whose points stay k
// apart lost nothing: the broken line was another series' (a training step's).
function brokenBetween(run, a, b, spacing) {
  return b - a > spacing && (run.gaps || []).some(([before, after]) => a <= before && after <= b);
}

function spacingOf(pts) {
  return Math.min(...pts.slice(1).map((p, j) => p[0] - pts[j][0]));
}

function niceTicks(lo, hi, n = 5, integer = false) {
  const scale = Math.max(Math.abs(lo), Math.abs(hi), 1e-12);
  if (hi - lo <= scale * 1e-6) { const pad = Math.abs(lo) * 0.1 || 0.5; lo -= pad; hi += pad; } // a flat line
  const raw = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  if (integer) step = Math.max(1, step); // steps are whole numbers
  const decimals = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(Number(t.toFixed(decimals)));
  const label = (t) => (Math.abs(t) >= 1e5 ? t.toExponential(1) : t.toFixed(decimals));
  return { lo: Math.min(lo, ticks[0]), hi: Math.max(hi, ticks[ticks.length - 1]), ticks, label };
}

function chart(panel) {
  const W = 440, H = 230, L = 56, R = 12, T = 10, B = 34;
  const lines = [];
  RUNS.forEach((run, r) => panel.series.forEach((s, i) => {
    const pts = points(run, s);
    if (pts.length) lines.push({ run, r, s, i, pts });
  }));
  const box = el("div", { class: "panel" }, el("h3", { text: panel.title }),
    panel.caption ? el("p", { class: "muted caption", text: panel.caption }) : null);
  if (!lines.length) {
    box.classList.add("empty");
    box.append(el("p", { class: "muted", text: "not logged in " + (RUNS.length > 1 ? "these runs" : "this run") }));
    return box;
  }
  const all = lines.flatMap((l) => l.pts);
  const collapse = RUNS.flatMap((run) => run.collapse_steps);
  const xs = niceTicks(Math.min(...all.map((p) => p[0]), ...collapse), Math.max(...all.map((p) => p[0]), ...collapse), 6, true);
  const ys = niceTicks(Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1])), 4);
  const x = (v) => L + ((v - xs.lo) / (xs.hi - xs.lo || 1)) * (W - L - R);
  const y = (v) => H - B - ((v - ys.lo) / (ys.hi - ys.lo || 1)) * (H - T - B);
  const plot = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": panel.title });
  for (const t of ys.ticks) {
    plot.append(svg("line", { x1: L, x2: W - R, y1: y(t), y2: y(t), class: "grid" }));
    plot.append(svg("text", { x: L - 6, y: y(t) + 4, class: "tick", "text-anchor": "end", text: ys.label(t) }));
  }
  for (const t of xs.ticks) {
    plot.append(svg("line", { x1: x(t), x2: x(t), y1: T, y2: H - B, class: "grid" }));
    plot.append(svg("text", { x: x(t), y: H - B + 14, class: "tick", "text-anchor": "middle", text: xs.label(t) }));
  }
  plot.append(svg("text", { x: (L + W - R) / 2, y: H - 4, class: "axis-label", "text-anchor": "middle", text: "step" }));
  RUNS.forEach((run, r) => run.collapse_steps.forEach((step) => {
    const mark = svg("line", { x1: x(step), x2: x(step), y1: T, y2: H - B, class: "collapse" });
    if (RUNS.length > 1) mark.setAttribute("style", `stroke:${PALETTE[r % PALETTE.length]}`);
    mark.append(svg("title", { text: `collapse warning at step ${step}` + (RUNS.length > 1 ? ` (${run.name})` : "") }));
    plot.append(mark);
  }));
  const legend = el("div", { class: "legend" });
  for (const l of lines) {
    const color = PALETTE[(RUNS.length > 1 ? l.r : l.i) % PALETTE.length];
    const dash = RUNS.length > 1 ? DASHES[l.i % DASHES.length] : (l.s.val ? "6 4" : "");
    const spacing = spacingOf(l.pts);
    const d = l.pts.map((p, j) => `${j && !brokenBetween(l.run, l.pts[j - 1][0], p[0], spacing) ? "L" : "M"}${x(p[0]).toFixed(1)} ${y(p[1]).toFixed(1)}`).join("");
    plot.append(svg("path", { d, class: "series", stroke: color, "stroke-dasharray": dash, "data-key": l.s.key, "data-run": l.run.name }));
    const name = (RUNS.length > 1 ? l.run.name + " · " : "") + l.s.label;
    if (l.pts.length <= 400) {
      for (const p of l.pts) {
        const dot = svg("circle", { cx: x(p[0]).toFixed(1), cy: y(p[1]).toFixed(1), r: l.pts.length > 60 ? 1.5 : 2.5, fill: color, class: "dot" });
        dot.append(svg("title", { text: `${name}\nstep ${p[0]}: ${fmt(p[1], 4)}` }));
        plot.append(dot);
      }
    }
    const swatch = svg("svg", { width: 26, height: 10 }, svg("line", { x1: 0, x2: 26, y1: 5, y2: 5, stroke: color, "stroke-width": 2.5, "stroke-dasharray": dash }));
    legend.append(el("span", { class: "key", title: l.s.key }, swatch, el("span", { text: name })));
  }
  box.append(plot, legend);
  return box;
}

function curvesSection() {
  const section = el("section", { id: "curves" }, el("h2", { text: "Curves" }));
  if (!RUNS.some((r) => r.metrics.length)) {
    section.append(el("p", { class: "note", text: "No metrics to draw (see the notes above)." }));
    return section;
  }
  if (RUNS.some((r) => r.collapse_steps.length)) {
    section.append(el("p", { class: "muted" }, el("span", { class: "collapse-key", text: "┆ red lines" }),
      document.createTextNode(" mark steps with a collapse warning (reward std and entropy falling together, or a gradient-norm spike).")));
  }
  const grid = el("div", { class: "panels" });
  for (const p of panels()) grid.append(chart(p));
  // Any other logged metric, on demand.
  const names = metricNames();
  if (!UI.explore || !names.includes(UI.explore)) UI.explore = names.includes("actor/ppo_kl") ? "actor/ppo_kl" : names[0];
  const explore = el("div", { class: "panel-wrap" });
  const drawExplore = () => {
    explore.replaceChildren(chart({ title: UI.explore, series: [{ key: UI.explore, label: UI.explore }] }));
  };
  drawExplore();
  const picker = select("any metric", names.map((n) => [n, n]), UI.explore, (v) => { UI.explore = v; saveUI(); drawExplore(); }, "explore-select");
  grid.append(el("div", { class: "panel explore" }, picker, explore));
  section.append(grid);
  return section;
}

// ---- diversity table -----------------------------------------------------------------------------

function diversitySection() {
  const section = el("section", { id: "diversity" }, el("h2", { text: "Diversity of reasoning (validation think texts)" }));
  section.append(el("p", { class: "muted", text:
    "Distinct n-grams: distinct word n-grams over all n-grams of a tag's think texts at one step (1.0: nothing repeats). " +
    "A falling value and one opening shared by most texts is the Echo Trap: one reasoning template whatever the level." }));
  const rows = [];
  RUNS.forEach((run) => {
    for (const [step, byTag] of Object.entries(run.diversity)) for (const [tag, d] of Object.entries(byTag)) rows.push({ run, step: Number(step), tag, d });
  });
  if (!rows.length) { section.append(el("p", { class: "note", text: "No validation dumps: nothing to measure." })); return section; }
  rows.sort((a, b) => a.run.name.localeCompare(b.run.name) || a.tag.localeCompare(b.tag) || a.step - b.step);
  const table = el("table", { class: "diversity" });
  const head = ["step", "env", "think texts", "distinct 1-grams", "distinct 2-grams", "most common opening (first 8 words)", "share"];
  if (RUNS.length > 1) head.unshift("run");
  table.append(el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { text: h })))));
  const body = el("tbody");
  for (const { run, step, tag, d } of rows) {
    const cells = [step, tag, d.texts, fmt(d.distinct_1gram), fmt(d.distinct_2gram), d.texts ? d.top_opening : "(no think text)", d.top_share === null ? "–" : `${Math.round(100 * d.top_share)} %`];
    if (RUNS.length > 1) cells.unshift(run.name);
    const tr = el("tr", {}, ...cells.map((c) => el("td", { text: String(c) })));
    if (d.top_share !== null && d.top_share >= 0.5 && d.texts > 1) tr.classList.add("echo");
    body.append(tr);
  }
  table.append(body);
  section.append(el("div", { class: "table-wrap" }, table));
  return section;
}

// ---- boards ----------------------------------------------------------------------------------------

const CELL = 24;

function gridBoard(state, roles) {
  const ice = Object.values(roles).includes("hole"); // FrozenLake's floor is ice
  const rows = state.split("\n").filter((r) => r.length);
  const cols = Math.max(0, ...rows.map((r) => [...r].length));
  const board = svg("svg", { class: "board grid-board", width: cols * CELL, height: rows.length * CELL, viewBox: `0 0 ${cols * CELL} ${rows.length * CELL}`, role: "img" });
  rows.forEach((row, i) => [...row].forEach((ch, j) => {
    const role = roles[ch];
    board.append(cell(role || "unknown", j * CELL, i * CELL, ch, ice));
  }));
  board.setAttribute("aria-label", state);
  board.append(svg("title", { text: state }));
  return board;
}

// One cell: layers drawn bottom-up (floor, target or hole or goal, then box or player).
function cell(role, x, y, ch, ice) {
  const g = svg("g", { class: `cell ${role}`, transform: `translate(${x},${y})` });
  const c = CELL, h = c / 2;
  const floor = (fill) => g.append(svg("rect", { width: c, height: c, fill, stroke: "#0001" }));
  const target = () => g.append(svg("rect", { x: 5, y: 5, width: c - 10, height: c - 10, fill: "none", stroke: "#e0443e", "stroke-width": 2, "stroke-dasharray": "3 2" }));
  const box = (fill) => { g.append(svg("rect", { x: 3, y: 3, width: c - 6, height: c - 6, rx: 2, fill, stroke: "#6b4423", "stroke-width": 1.5 }));
    g.append(svg("path", { d: `M5 5L${c - 5} ${c - 5}M${c - 5} 5L5 ${c - 5}`, stroke: "#6b4423", "stroke-width": 1.2 })); };
  const player = (fill) => { g.append(svg("circle", { cx: h, cy: 8, r: 4, fill }));
    g.append(svg("path", { d: `M${h - 6} ${c - 3}Q${h} 8 ${h + 6} ${c - 3}Z`, fill })); };
  const hole = () => g.append(svg("ellipse", { cx: h, cy: h, rx: h - 3, ry: h - 5, fill: "#173a5e" }));
  const goal = () => { g.append(svg("rect", { x: 7, y: 5, width: 2, height: c - 9, fill: "#555" }));
    g.append(svg("path", { d: `M9 5L${c - 5} 9L9 13Z`, fill: "#f2b01e" })); };
  const floorColor = ice ? "#dff1fb" : "#f3efe6", iceColor = "#dff1fb", tiles = "#f3efe6";
  switch (role) {
    case "wall": g.append(svg("rect", { width: c, height: c, fill: "#5b5b66" }));
      g.append(svg("path", { d: `M0 ${h}H${c}M${h} 0V${h}M${c / 4} ${h}V${c}M${(3 * c) / 4} ${h}V${c}`, stroke: "#44444d", "stroke-width": 1.5 })); break;
    case "empty": floor(floorColor); break;
    case "target": floor(tiles); target(); break;
    case "box": floor(tiles); box("#d99a4e"); break;
    case "box_on_target": floor(tiles); target(); box("#6cbf5a"); break;
    case "player": floor(floorColor); player("#2565c7"); break;
    case "player_on_target": floor(tiles); target(); player("#2565c7"); break;
    case "hole": floor(iceColor); hole(); break;
    case "goal": floor(iceColor); goal(); break;
    case "player_in_hole": floor(iceColor); hole(); player("#e0443e"); break;
    case "player_on_goal": floor(iceColor); goal(); player("#2a9d4b"); break;
    default: floor("#fff"); g.append(svg("text", { x: h, y: h + 5, "text-anchor": "middle", class: "glyph", text: ch }));
  }
  return g;
}

function banditBoard(state, turn) {
  const m = state.match(/named (\S+?) and (\S+?)(?:\s|$)/);
  const arms = m ? [m[1], m[2]] : null;
  if (!arms) return textBoard(state);
  const chosen = turn.actions[0];
  const W = 240, H = 104;
  const board = svg("svg", { class: "board bandit-board", width: W, height: H, viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": `arms ${arms.join(", ")}` });
  arms.forEach((name, i) => {
    const x0 = 14 + i * 116, picked = name === chosen;
    const g = svg("g", { class: "arm" + (picked ? " chosen" : ""), transform: `translate(${x0},6)` });
    g.append(svg("rect", { x: 0, y: 10, width: 80, height: 66, rx: 8, fill: picked ? "#ffe7a8" : "#eceff3", stroke: picked ? "#d08b00" : "#9aa3ad", "stroke-width": picked ? 3 : 1.5 }));
    g.append(svg("rect", { x: 12, y: 22, width: 56, height: 24, rx: 3, fill: "#fff", stroke: "#9aa3ad" }));
    g.append(svg("text", { x: 40, y: 39, "text-anchor": "middle", class: "arm-name", text: name }));
    g.append(svg("line", { x1: 86, y1: 44, x2: 92, y2: picked ? 64 : 18, stroke: "#555", "stroke-width": 3, "stroke-linecap": "round" }));
    g.append(svg("circle", { cx: 92, cy: picked ? 64 : 18, r: 5, fill: "#e0443e" }));
    if (picked) g.append(svg("text", { x: 40, y: 66, "text-anchor": "middle", class: "arm-reward", text: `reward ${fmt(turn.reward)}` }));
    board.append(g);
  });
  board.append(svg("title", { text: state }));
  return board;
}

function textBoard(state) { return el("pre", { class: "board text-board", text: state }); }

function drawBoard(spec, turn) {
  if (!spec || spec.kind === "text") return textBoard(turn.state);
  if (spec.kind === "bandit") return banditBoard(turn.state, turn);
  return gridBoard(turn.state, spec.roles);
}

// ---- trajectories ----------------------------------------------------------------------------------

// The dumps drawn as trajectories, each in a section of its own, by the same code: a run's
// validations (val/step_N.jsonl: the fixed validation levels, by seed) and its training samples
// (train/step_N.jsonl: the first trainer.log_trajectories trajectories of a training step's batch).
const KINDS = {
  val: {
    id: "trajectories", field: "trajectories", prefix: "f", title: "Trajectories (validation)", what: "validation trajectories",
    none: "No validation trajectories to show (see the notes above).",
    about: "Each turn: the board as the agent saw it, then what it thought, answered and did, and the turn's reward.",
  },
  train: {
    id: "training", field: "train_trajectories", prefix: "tf", title: "Trajectories (training samples)", what: "training samples",
    none: "No training samples to show: no train/step_N.jsonl (trainer.log_trajectories=0, or a run from before they were written).",
    about: "Training samples, not validation: the first trainer.log_trajectories trajectories of each training step's batch, " +
      "as that step's policy played them, on the levels the step drew (not the fixed validation levels, so no level seed). " +
      "Each turn: the board as the agent saw it, then what it thought, answered and did, and the turn's reward.",
  },
};

function trajectoryCard(run, t, compact = false) {
  const env = run.envs[t.tag] || {};
  const train = t.kind === "train";
  const head = el("div", { class: "traj-head" },
    el("span", { class: "badge " + (t.success ? "ok" : "fail"), text: t.success ? "success" : "failure", title: env.success ? `success in ${t.tag}: ${env.success}` : "" }),
    train ? el("span", { class: "badge kind-train", text: "training sample", title: "a trajectory of the training batch, not a validation level" }) : null,
    el("b", { text: t.tag }),
    el("span", { text: `${train ? "training " : ""}step ${t.step}` }),
    el("span", { text: train ? `group ${t.group ?? "?"}` : `level seed ${t.seed ?? "?"}` }),
    el("span", { text: `reward ${fmt(t.reward)}` + (t.penalty ? ` (format penalty ${fmt(t.penalty)})` : "") }),
    el("span", { text: `${t.actions ?? "?"} action(s), ${t.turns.length} turn(s)` }),
  );
  if (RUNS.length > 1 && !compact) head.append(el("span", { class: "muted", text: run.name }));
  const card = el("article", { class: "trajectory" + (compact ? " compact" : "") + (train ? " train" : ""), "data-tag": t.tag, "data-step": t.step, "data-success": t.success, "data-kind": t.kind || "val" }, head);
  t.turns.forEach((turn, i) => {
    const said = el("div", { class: "dialogue" });
    said.append(el("div", { class: "bubble think" }, el("span", { class: "who", text: "think" }),
      el("span", { class: turn.think ? "" : "muted", text: turn.think || "(no think text)" })));
    said.append(el("div", { class: "bubble answer" }, el("span", { class: "who", text: "answer" }),
      el("span", { class: turn.answer ? "" : "muted", text: turn.answer || "(no answer)" })));
    const acts = el("div", { class: "actions" }, el("span", { class: "who", text: "actions" }));
    if (turn.actions.length) for (const a of turn.actions) acts.append(el("span", { class: "chip", text: a }));
    else acts.append(el("span", { class: "muted", text: "none executed" }));
    acts.append(el("span", { class: "turn-reward", text: `reward ${fmt(turn.reward)}` + (turn.penalty ? " · format penalty" : "") }));
    if (turn.penalty && turn.why) acts.append(el("span", { class: "format-why", text: turn.why }));
    said.append(acts);
    if (turn.response) {
      said.append(el("details", { class: "raw" }, el("summary", { text: "raw response" }), el("pre", { text: turn.response })));
    }
    const label = el("div", { class: "turn-no", title: "the board as the agent saw it, before this turn's actions" }, el("span", { text: `turn ${i + 1}` }));
    card.append(el("div", { class: "turn" }, label, drawBoard(env.board, turn), said));
  });
  if (!t.turns.length) card.append(el("p", { class: "muted", text: "no turn recorded" }));
  return card;
}

function filtered(list, V) {
  const q = V.search.trim().toLowerCase();
  return list.filter((t) =>
    (V.step === "all" || String(t.step) === V.step) &&
    (V.tag === "all" || t.tag === V.tag) &&
    (V.outcome === "all" || (V.outcome === "success") === t.success) &&
    (!q || t.turns.some((u) => (u.think + " " + u.answer + " " + u.response).toLowerCase().includes(q))));
}

// One section of trajectories of a kind (KINDS): filters by run, step, env, outcome and text, pages of PAGE_SIZE.
function trajectoriesSection(kind) {
  const K = KINDS[kind], V = UI.views[kind];
  const of = (run) => run[K.field] || [];
  const section = el("section", { id: K.id, class: `trajectories ${kind}` }, el("h2", { text: K.title }));
  if (!RUNS.some((r) => of(r).length)) {
    section.append(el("p", { class: "note", text: K.none }));
    return section;
  }
  const p = K.prefix;
  const bar = el("div", { class: "filters" }), count = el("p", { class: "count" }), list = el("div", { class: "traj-list" }), pager = el("div", { class: "pager" });
  const draw = () => {
    saveUI();
    if (V.run >= RUNS.length) V.run = 0;
    const run = RUNS[V.run], all = of(run);
    const steps = [...new Set(all.map((t) => t.step))].sort((a, b) => a - b);
    const tags = [...new Set(all.map((t) => t.tag))].sort();
    if (V.step !== "all" && !steps.map(String).includes(V.step)) V.step = "all";
    if (V.tag !== "all" && !tags.includes(V.tag)) V.tag = "all";
    const reset = (f) => (v) => { f(v); V.page = 0; draw(); };
    const search = el("input", { type: "search", placeholder: "search think / answer", value: V.search, "aria-label": "search", class: `${p}-text` });
    search.addEventListener("change", (e) => reset((v) => { V.search = v; })(e.target.value));
    const stepName = kind === "train" ? "training step" : "step";
    bar.replaceChildren(...[
      RUNS.length > 1 ? select("run", RUNS.map((r, i) => [i, r.name]), V.run, reset((v) => { V.run = Number(v); }), `${p}-run`) : null,
      select(stepName, [["all", "all steps"], ...steps.map((s) => [String(s), `${stepName} ${s}`])], V.step, reset((v) => { V.step = v; }), `${p}-step`),
      select("env", [["all", "all envs"], ...tags.map((t) => [t, t])], V.tag, reset((v) => { V.tag = v; }), `${p}-env`),
      select("outcome", [["all", "all"], ["success", "success"], ["failure", "failure"]], V.outcome, reset((v) => { V.outcome = v; }), `${p}-outcome`),
      el("label", { class: "filter" }, el("span", { text: "text" }), search),
    ].filter(Boolean));
    const shown = filtered(all, V);
    const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
    V.page = Math.min(V.page, pages - 1);
    const first = V.page * PAGE_SIZE;
    const page = shown.slice(first, first + PAGE_SIZE);
    count.textContent = shown.length
      ? `${shown.length} of ${all.length} ${K.what} match; showing ${first + 1}–${first + page.length}`
      : `no trajectory matches (of ${all.length} ${K.what})`;
    list.replaceChildren(...page.map((t) => trajectoryCard(run, t)));
    pager.replaceChildren(
      el("button", { text: "◀ previous", class: "prev", on: { click: () => { V.page = Math.max(0, V.page - 1); draw(); } } }),
      el("span", { text: ` page ${V.page + 1} of ${pages} ` }),
      el("button", { text: "next ▶", class: "next", on: { click: () => { V.page = Math.min(pages - 1, V.page + 1); draw(); } } }),
    );
  };
  draw();
  const tags = [...new Set(RUNS.flatMap((run) => of(run).map((t) => t.tag)))].sort();
  const prompts = RUNS.flatMap((run) => Object.entries(run.prompts || {}).filter(([tag]) => tags.includes(tag)).map(([tag, text]) => [run, tag, text]));
  const seen = new Set();
  const promptBox = el("div", { class: "prompts" });
  for (const [run, tag, text] of prompts) {
    if (seen.has(tag + "\n" + text)) continue; // runs sharing a prompt show it once
    seen.add(tag + "\n" + text);
    promptBox.append(el("details", { class: "prompt" }, el("summary", { text: `prompt of ${tag}` + (RUNS.length > 1 ? ` (${run.name})` : "") }), el("pre", { text })));
  }
  const meanings = tags.filter(successMeaning).map((tag) =>
    el("li", { "data-tag": tag }, el("b", { text: tag }), document.createTextNode(`: ${successMeaning(tag)}`)));
  section.append(el("p", { class: "muted about", text: K.about }),
    meanings.length ? el("div", { class: "success-key" },
      el("span", { text: "What counts as success (each env's own rule, whatever the reward):" }), el("ul", {}, ...meanings)) : null,
    promptBox, bar, count, list, pager);
  return section;
}

// ---- the same level across steps -----------------------------------------------------------------

function compareSection() {
  const section = el("section", { id: "compare" }, el("h2", { text: "One level across training steps" }));
  if (!RUNS.some((r) => new Set(r.trajectories.map((t) => t.step)).size > 0)) {
    section.append(el("p", { class: "note", text: "No validation trajectories to compare." }));
    return section;
  }
  section.append(el("p", { class: "muted", text: "The validation levels are fixed (same seeds every validation): watch the reasoning on one level change as training goes on." }));
  const bar = el("div", { class: "filters" }), row = el("div", { class: "compare-row" });
  const draw = () => {
    saveUI();
    if (UI.cmpRun >= RUNS.length) UI.cmpRun = 0;
    const run = RUNS[UI.cmpRun];
    const tags = [...new Set(run.trajectories.map((t) => t.tag))].sort();
    if (!tags.includes(UI.cmpTag)) UI.cmpTag = tags[0] || "";
    const levels = [...new Set(run.trajectories.filter((t) => t.tag === UI.cmpTag).map((t) => `${t.seed}|${t.group}`))];
    if (!levels.includes(UI.cmpSeed)) UI.cmpSeed = levels[0] || "";
    bar.replaceChildren(...[
      RUNS.length > 1 ? select("run", RUNS.map((r, i) => [i, r.name]), UI.cmpRun, (v) => { UI.cmpRun = Number(v); draw(); }) : null,
      select("env", tags.map((t) => [t, t]), UI.cmpTag, (v) => { UI.cmpTag = v; draw(); }, "c-env"),
      select("level", levels.map((l) => [l, `seed ${l.split("|")[0]} (group ${l.split("|")[1]})`]), UI.cmpSeed, (v) => { UI.cmpSeed = v; draw(); }, "c-level"),
    ].filter(Boolean));
    const same = run.trajectories.filter((t) => t.tag === UI.cmpTag && `${t.seed}|${t.group}` === UI.cmpSeed).sort((a, b) => a.step - b.step);
    row.replaceChildren(...same.map((t) => el("div", { class: "compare-col" }, el("h3", { text: `step ${t.step}` }), trajectoryCard(run, t, true))));
  };
  draw();
  section.append(bar, row);
  return section;
}

// ---- page ------------------------------------------------------------------------------------------

function header() {
  const h = el("header", {}, el("h1", { text: "starpo-jax run report" }));
  const runs = el("ul", { class: "runs" });
  RUNS.forEach((run, i) => {
    const steps = run.metrics.length ? Math.max(...run.metrics.map((r) => r.step)) : 0;
    const broken = (run.gaps || []).length ? ` (${run.gaps.length} broken metrics line(s) missing, see the notes)` : "";
    const samples = (run.train_trajectories || []).length;
    runs.append(el("li", {}, el("span", { class: "run-swatch", style: `background:${PALETTE[i % PALETTE.length]}` }),
      el("b", { text: run.name }), el("span", { class: "muted", text: ` ${run.path} · ${steps} step(s) logged${broken} · ${run.trajectories.length} validation trajectories` +
        (samples ? ` · ${samples} training samples` : "") })));
  });
  h.append(runs, el("p", { class: "muted", text: `generated ${DATA.generated}` + (DATA.live ? ` · live: checks for new data every ${DATA.live.interval} s` : "") }));
  const notes = RUNS.flatMap((r) => r.notes.map((n) => (RUNS.length > 1 ? `${r.name}: ` : "") + n));
  if (notes.length) h.append(el("div", { class: "notes", id: "notes" }, el("b", { text: "Notes" }), el("ul", {}, ...notes.map((n) => el("li", { text: n })))));
  h.append(el("nav", {}, ...[["#curves", "Curves"], ["#diversity", "Diversity"], ["#trajectories", "Trajectories"], ["#training", "Training samples"], ["#compare", "Across steps"]]
    .map(([href, text]) => el("a", { href, text }))));
  return h;
}

function live() {
  if (!DATA.live) return;
  setInterval(async () => {
    try {
      const r = await fetch("version", { cache: "no-store" });
      if (r.ok && (await r.text()).trim() !== DATA.live.signature) location.reload();
    } catch (e) { /* server stopped: keep the page as it is */ }
  }, DATA.live.interval * 1000);
}

document.getElementById("app").replaceChildren(header(), curvesSection(), diversitySection(), trajectoriesSection("val"), trajectoriesSection("train"), compareSection());
document.body.dataset.ready = "1";
live();
