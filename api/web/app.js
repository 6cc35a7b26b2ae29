// Kiln's monitoring page: plain JavaScript against the same REST API the SDK uses.
// The API key stays in sessionStorage and travels only in the Authorization header, so the
// live stream is read with fetch() (EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("kiln-key"), stream: null, points: [], valid: [], reported: null, reportKey: null };
const TERMINAL = ["succeeded", "failed", "cancelled"];
const HYPERPARAMETERS = ["n_epochs", "batch_size", "learning_rate_multiplier", "max_steps", "max_seq_len"];

async function api(path, opts = {}) {
  const res = await fetch(path, { ...opts, headers: { Authorization: `Bearer ${state.key}`, ...(opts.headers || {}) } });
  if (!res.ok) {
    let body = {};
    try { body = await res.json(); } catch (_) {}
    const err = new Error((body.error && body.error.message) || `HTTP ${res.status}`);
    err.status = res.status; err.body = body; err.param = body.error && body.error.param;
    throw err;
  }
  return res;
}
const json = async (path, opts) => (await api(path, opts)).json();
const post = (path, body) =>
  json(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: body && JSON.stringify(body) });
const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "-");
const fmt = (x, d = 4) => (x === undefined || x === null ? "-" : Number(x).toFixed(d));

// A DOM element with properties and children (strings become text, never HTML).
function el(tag, props = {}, ...children) {
  const e = Object.assign(document.createElement(tag), props);
  e.append(...children);
  return e;
}

// A table row that opens something: the whole row reacts to a click, and to Enter from the keyboard.
function clickableRow(cells, open) {
  const tr = el("tr", { className: "clickable", tabIndex: 0 }, ...cells.map((c) => el("td", {}, c)));
  tr.addEventListener("click", (ev) => { if (!ev.target.closest("a")) open(); });
  tr.addEventListener("keydown", (ev) => { if (ev.key === "Enter") open(); });
  return tr;
}

async function listAll(path) {
  const out = [];
  let after = null;
  do {
    const page = await json(`${path}?limit=100${after ? `&after=${after}` : ""}`);
    out.push(...page.data);
    after = page.has_more ? page.last_id : null;
  } while (after);
  return out;
}

// An upload that is a zip without a JSONL is an archive of images for a dataset beside it.
const isImages = (f) => f.stats.examples === 0;
const fileOption = (f) => [f.id, `${f.filename} (${f.id})`];

// What the forms offer: base models (fine-tuned ones have a root), datasets and images archives.
async function choices() {
  const [models, files] = await Promise.all([json("/v1/models"), listAll("/v1/files")]);
  return {
    models: models.data.filter((m) => !m.root).map((m) => [m.id, m.id]),
    files,
    datasets: files.filter((f) => !isImages(f)).map(fileOption),
    images: files.filter(isImages).map(fileOption),
  };
}

// Options as [value, label]; `empty` labels a first "nothing chosen" option. The choice is kept.
function fillSelect(select, options, empty) {
  const keep = select.value;
  const all = empty ? [["", empty], ...options] : options;
  select.replaceChildren(...all.map(([value, label]) => el("option", { value }, label)));
  if (all.some(([value]) => value === keep)) select.value = keep;
}

function show(section) {
  for (const id of ["login", "jobs", "new", "job", "files", "playground"]) $(id).hidden = id !== section;
  $("logout").hidden = section === "login";
}

function stopStream() {
  if (state.stream) { state.stream.abort(); state.stream = null; }
}

async function route() {
  stopStream();
  stopAnswers();  // playground.js: answers still streaming are stopped when the page moves on
  if (!state.key) return show("login");
  const hash = location.hash || "#/";
  try {
    if (hash.startsWith("#/jobs/")) await showJob(hash.slice(7));
    else if (hash === "#/new") await showNew();
    else if (hash === "#/files") await showFiles();
    else if (hash.startsWith("#/playground")) await showPlayground(decodeURIComponent(hash.slice(13)));
    else await showJobs();
  } catch (e) {
    if (e.status === 401) { signOut(); $("login-error").textContent = e.message; } else throw e;
  }
}

function signOut() {
  sessionStorage.removeItem("kiln-key"); state.key = null; show("login");
}

$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  state.key = $("api-key").value.trim();
  try {
    await json("/v1/models");
    sessionStorage.setItem("kiln-key", state.key);
    $("login-error").textContent = "";
    route();
  } catch (e) {
    state.key = null;
    $("login-error").textContent = e.message;
  }
});
$("logout").addEventListener("click", signOut);
window.addEventListener("hashchange", route);

// ---- jobs list --------------------------------------------------------------------------------

async function showJobs() {
  show("jobs");
  const jobs = await listAll("/v1/fine_tuning/jobs");
  $("jobs-body").replaceChildren(...jobs.map((j) => {
    const link = el("a", { href: `#/jobs/${j.id}` }, j.id);
    const status = el("span", { className: `status ${j.status}` }, j.status);
    const tr = clickableRow([link, j.model, status, when(j.created_at), j.fine_tuned_model || ""],
      () => { location.hash = `#/jobs/${j.id}`; });
    tr.dataset.job = j.id;
    return tr;
  }));
  $("jobs-empty").hidden = jobs.length > 0;
}

// ---- dataset reports (the datasets page and the new-job form) ---------------------------------

function reportUrl(fileId, { model, images, maxSeqLen, nEpochs }) {
  const q = new URLSearchParams({ model });
  if (images) q.set("images_file", images);
  if (maxSeqLen) q.set("max_seq_len", maxSeqLen);
  if (nEpochs) q.set("n_epochs", nEpochs);
  return `/v1/files/${fileId}/report?${q}`;
}

// A title, every problem by line and field (whatever the field: text, images, length), numbers.
function renderReport(box, title, ok, issues, stats = {}) {
  box.className = `report ${ok ? "good" : "bad"}`;
  const where = (i) => `${i.line ? `line ${i.line}: ` : ""}${i.field ? `${i.field}: ` : ""}`;
  const dl = el("dl", { className: "report-stats" });
  for (const [k, v] of Object.entries(stats)) dl.append(el("dt", {}, k), el("dd", {}, String(v)));
  box.replaceChildren(
    el("h2", { className: "report-title" }, title),
    el("ul", { className: "report-issues" }, ...issues.map((i) => el("li", {}, where(i) + i.message))),
    dl,
  );
}

// Fetches a report into `box`; a box replaced meanwhile by a newer one is simply left behind.
async function loadReport(box, fileId, name, params) {
  box.className = "report"; box.textContent = `Checking ${name}…`;
  let rep;
  try { rep = await json(reportUrl(fileId, params)); } catch (e) {
    return renderReport(box, `${name}: ${e.message}`, false, []);
  }
  const n = rep.issues.length;
  const title = rep.ok ? `${name}: ok for ${rep.model}`
    : `${name}: ${n}${rep.issues_truncated ? "+" : ""} problem(s) for ${rep.model}`;
  const { length_histogram: hist = [], ...counts } = rep.stats;
  renderReport(box, title, rep.ok, rep.issues, {
    ...counts,
    length_histogram: hist.map((b) => `<=${b.max_tokens}: ${b.examples}`).join(", "),
    max_seq_len: rep.max_seq_len,
    estimated_training_tokens: rep.estimate.training_tokens,
    estimated_seconds: rep.estimate.seconds,
  });
}

// ---- new job ----------------------------------------------------------------------------------

async function showNew() {
  show("new");
  const c = await choices();
  fillSelect($("new-model"), c.models);
  fillSelect($("new-training"), c.datasets);
  fillSelect($("new-validation"), c.datasets, "none");
  fillSelect($("new-images"), c.images, "none");
  state.reportKey = null;  // the files may have changed since the last visit
  await checkDataset();
}

const digits = (id) => (/^\d+$/.test($(id).value.trim()) ? $(id).value.trim() : "");

// The reports of the chosen training (and validation) file for the form's model, images zip,
// length and epochs; nothing is fetched again while those stay the same.
async function checkDataset() {
  const params = { model: $("new-model").value, images: $("new-images").value,
                   maxSeqLen: digits("new-max_seq_len"), nEpochs: digits("new-n_epochs") };
  const chosen = [["Training", $("new-training")], ["Validation", $("new-validation")]].filter(([, s]) => s.value);
  const key = JSON.stringify([params, chosen.map(([, s]) => s.value)]);
  if (key === state.reportKey) return;
  state.reportKey = key;
  if (!$("new-training").value) {
    const hint = el("p", { className: "report bad" }, "No dataset yet: ", el("a", { href: "#/files" }, "upload one"), ".");
    return $("new-report").replaceChildren(hint);
  }
  const boxes = chosen.map(() => el("div"));
  $("new-report").replaceChildren(...boxes);
  await Promise.all(chosen.map(([what, s], i) =>
    loadReport(boxes[i], s.value, `${what} file ${s.selectedOptions[0].text}`, params)));
}
for (const id of ["new-model", "new-training", "new-validation", "new-images", "new-max_seq_len", "new-n_epochs"]) {
  $(id).addEventListener("change", checkDataset);
}
$("new-check").addEventListener("click", () => { state.reportKey = null; checkDataset(); });

class FormError extends Error {
  constructor(message, param) { super(message); this.param = param; }
}

// Empty: left to the server. A number goes as a number, anything else as typed ("auto", or a
// mistake the API will name).
function value(id) {
  const s = $(id).value.trim();
  if (!s) return undefined;
  const n = Number(s);
  return Number.isFinite(n) ? n : s;
}

function jobBody() {
  let hp = {};
  const advanced = $("new-advanced").value.trim();
  if (advanced) {
    try { hp = JSON.parse(advanced); } catch (e) {
      throw new FormError(`Advanced hyperparameters are not valid JSON: ${e.message}`, "hyperparameters");
    }
    if (!hp || typeof hp !== "object" || Array.isArray(hp)) {
      throw new FormError("Advanced hyperparameters must be a JSON object", "hyperparameters");
    }
  }
  for (const k of HYPERPARAMETERS) if (value(`new-${k}`) !== undefined) hp[k] = value(`new-${k}`);
  const targets = $("new-targets").value.split(",").map((s) => s.trim()).filter(Boolean);
  return {  // JSON.stringify leaves out what is undefined
    model: $("new-model").value,
    training_file: $("new-training").value,
    validation_file: $("new-validation").value || undefined,
    images_file: $("new-images").value || undefined,
    hyperparameters: hp,
    lora: { rank: value("new-rank"), alpha: value("new-alpha"), target_modules: targets.length ? targets : undefined },
    suffix: $("new-suffix").value.trim() || undefined,
  };
}

// The message beside the form, and the field it names marked: "lora.target_modules[1]" marks
// the target modules, "hyperparameters.warmup_ratio" the advanced JSON.
function formError(message, param) {
  for (const e of document.querySelectorAll("#new-form .invalid")) e.classList.remove("invalid");
  $("new-error").textContent = param ? `${message} (field: ${param})` : message;
  let p = (param || "").replace(/\[\d+\]/g, "");
  while (p) {
    const field = document.querySelector(`#new-form [data-param="${CSS.escape(p)}"]`);
    if (field) {
      field.classList.add("invalid");
      const details = field.closest("details");
      if (details) details.open = true;
      return;
    }
    p = p.includes(".") ? p.slice(0, p.lastIndexOf(".")) : "";
  }
}

$("new-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  formError("");
  $("new-submit").disabled = true;
  try {
    const body = jobBody();
    await checkDataset();  // the report is on screen before the job is created
    const job = await post("/v1/fine_tuning/jobs", body);
    location.hash = `#/jobs/${job.id}`;
  } catch (e) {
    formError(e.message, e.param);
  } finally {
    $("new-submit").disabled = false;
  }
});

// ---- one job ----------------------------------------------------------------------------------

function renderJob(j) {
  $("job-id").textContent = j.id;
  const st = $("job-status"); st.textContent = j.status; st.className = `status ${j.status}`;
  $("job-model").textContent = j.model;
  $("job-ft").textContent = j.fine_tuned_model || "-";
  $("job-error").textContent = j.error ? `${j.error.code}: ${j.error.message}` : "";
  $("pause").hidden = !["running", "queued"].includes(j.status);
  $("resume").hidden = !["paused", "pausing"].includes(j.status);  // while pausing, resume withdraws the pause
  $("cancel").disabled = TERMINAL.includes(j.status);
  $("download").disabled = j.status !== "succeeded";
  $("job-play").hidden = j.status !== "succeeded" || !j.fine_tuned_model;
  $("job-play").href = `#/playground/${encodeURIComponent(j.fine_tuned_model || "")}`;
}

// Pause, resume, cancel: the job as the API answers, or its refusal beside the buttons.
async function jobAction(id, action) {
  $("action-error").textContent = "";
  try {
    renderJob(await post(`/v1/fine_tuning/jobs/${id}/${action}`));
  } catch (e) {
    $("action-error").textContent = e.message;
  }
}

const savesCheckpoint = (ev) => ev.type === "message" && /^Checkpoint saved/.test(ev.message);

function addEvent(ev) {
  $("events").append(el("li", { className: ev.level }, `${when(ev.created_at)}  ${ev.message}`));
  if (ev.type === "metrics" && ev.data) {
    const d = ev.data;
    state.points.push([d.step, d.train_loss]);
    if (d.valid_loss !== undefined) state.valid.push([d.step, d.valid_loss]);
    $("job-step").textContent = `${d.step} / ${d.total_steps}`;
    $("job-loss").textContent = fmt(d.train_loss);
    if (d.valid_loss !== undefined) $("job-valid").textContent = fmt(d.valid_loss);
    $("job-tps").textContent = fmt(d.tokens_per_second, 0);
    $("job-progress").value = d.total_steps ? d.step / d.total_steps : 0;
    drawPlot();
  }
}

// About `count` round tick values over [lo, hi]: 1, 2 or 5 times a power of ten apart, never
// closer than `minStep`. Returns the values and the decimals their labels need.
function ticks(lo, hi, count, minStep = 0) {
  const raw = Math.max((hi - lo) / count, minStep) || 1;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw * (1 - 1e-9));
  const values = [];
  for (let i = Math.ceil(lo / step - 1e-9); i * step <= hi + step * 1e-9; i++) values.push(i * step);
  return { values, decimals: Math.max(0, -Math.floor(Math.log10(step) + 1e-9)) };
}

function drawPlot() {
  const c = $("loss-plot");
  const fit = Math.max(240, Math.min(720, c.parentElement.clientWidth - 2));  // narrow screens redraw small
  if (c.width !== fit) c.width = fit;
  const g = c.getContext("2d");
  const W = c.width, H = c.height, L = 50, R = 12, T = 10, B = 34;
  g.clearRect(0, 0, W, H);
  const all = state.points.concat(state.valid);
  c.dataset.points = state.points.length; c.dataset.validPoints = state.valid.length;
  c.dataset.xTicks = c.dataset.yTicks = "";
  if (!all.length) return;
  const xmax = Math.max(...all.map((p) => p[0]), 1);
  const ymin = Math.min(...all.map((p) => p[1])), ymax = Math.max(...all.map((p) => p[1]));
  const span = ymax - ymin || 1;
  const X = (x) => L + (W - L - R) * (x / xmax);
  const Y = (y) => T + (H - T - B) * (1 - (y - ymin) / span);
  // Axes and ticks on half pixels, so that one-pixel lines stay sharp.
  const x0 = L + 0.5, y0 = H - B + 0.5;
  g.strokeStyle = "#9ca3af"; g.lineWidth = 1; g.fillStyle = "#6b7280"; g.font = "11px sans-serif";
  g.beginPath(); g.moveTo(x0, T); g.lineTo(x0, y0); g.lineTo(W - R, y0);
  const xt = ticks(0, xmax, Math.max(2, Math.floor((W - L - R) / 70)), 1);
  g.textAlign = "center"; g.textBaseline = "top";
  for (const t of xt.values) {
    const x = Math.round(X(t)) + 0.5;
    g.moveTo(x, y0); g.lineTo(x, y0 + 6); g.fillText(String(t), x, y0 + 8);
  }
  const yt = ticks(ymin, ymin + span, 5);
  g.textAlign = "right"; g.textBaseline = "middle";
  for (const t of yt.values) {
    const y = Math.round(Y(t)) + 0.5;
    g.moveTo(x0 - 6, y); g.lineTo(x0, y); g.fillText(t.toFixed(yt.decimals), x0 - 8, y);
  }
  g.stroke();
  g.textBaseline = "bottom"; g.fillText("step", W - R, H - 1);
  c.dataset.xTicks = xt.values.join(" ");
  c.dataset.yTicks = yt.values.map((t) => t.toFixed(yt.decimals)).join(" ");
  const line = (pts, color, width) => {
    g.strokeStyle = color; g.lineWidth = width; g.beginPath();
    pts.forEach(([x, y], i) => (i ? g.lineTo(X(x), Y(y)) : g.moveTo(X(x), Y(y))));
    g.stroke();
    g.fillStyle = color;
    if (pts.length < 40) pts.forEach(([x, y]) => { g.beginPath(); g.arc(X(x), Y(y), 3, 0, 7); g.fill(); });
  };
  line(state.points, "#2563eb", 2);
  line(state.valid, "#ea580c", 2);
}
window.addEventListener("resize", () => { if (!$("job").hidden) drawPlot(); });

async function showCheckpoints(id) {
  const page = await json(`/v1/fine_tuning/jobs/${id}/checkpoints?limit=100`);
  $("ckpt-body").replaceChildren(...page.data.map((c) => {
    const button = el("button", {}, "Download");
    button.addEventListener("click", () =>
      download(`/v1/fine_tuning/jobs/${id}/checkpoints/${c.id}/adapter`, `${id}-step-${c.step_number}.zip`));
    const m = c.metrics;  // the last checkpoint's answers to the validation prompts: full_valid_* (engine.inference.evaluate)
    const share = (v) => (v === undefined || v === null ? "" : `${(100 * v).toFixed(1)}%`);
    return el("tr", {}, ...[c.step_number, fmt(m.train_loss), fmt(m.valid_loss),
      share(m.full_valid_mean_token_accuracy ?? m.valid_mean_token_accuracy), share(m.full_valid_exact_match), button]
      .map((v) => el("td", {}, v)));
  }));
}

async function download(path, name) {
  const blob = await (await api(path)).blob();
  const a = el("a", { href: URL.createObjectURL(blob), download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 10000);
}

async function follow(id, ctrl) {
  // Server-Sent Events over fetch: frames are separated by a blank line.
  const res = await api(`/v1/fine_tuning/jobs/${id}/events/stream`, { signal: ctrl.signal });
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
      let kind = "message", data = null;
      for (const line of frame.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data = JSON.parse(line.slice(6));
      }
      if (!data) continue;
      if (kind === "message" || kind === "metrics") {
        addEvent(data);
        if (savesCheckpoint(data)) await showCheckpoints(id);  // the row and its event commit together
      } else if (kind === "status" || kind === "end") {
        renderJob(await json(`/v1/fine_tuning/jobs/${id}`));
        await showCheckpoints(id);
        if (kind === "end") return;
      }
    }
  }
}

async function showJob(id) {
  show("job");
  state.points = []; state.valid = [];
  $("events").replaceChildren(); $("ckpt-body").replaceChildren();
  for (const f of ["job-step", "job-loss", "job-valid", "job-tps"]) $(f).textContent = "-";
  $("job-progress").value = 0; $("action-error").textContent = "";
  drawPlot();
  const job = await json(`/v1/fine_tuning/jobs/${id}`);
  renderJob(job);
  await showCheckpoints(id);
  for (const action of ["pause", "resume", "cancel"]) $(action).onclick = () => jobAction(id, action);
  $("download").onclick = () => download(`/v1/fine_tuning/jobs/${id}/adapter`, `${job.fine_tuned_model || id}.zip`.replace(/[^\w.-]/g, "_"));
  const ctrl = new AbortController();
  state.stream = ctrl;
  follow(id, ctrl).catch((e) => { if (e.name !== "AbortError") $("job-error").textContent = e.message; });
}

// ---- datasets ---------------------------------------------------------------------------------

async function showFiles() {
  show("files");
  const c = await choices();
  fillSelect($("report-model"), c.models);
  fillSelect($("report-images"), c.images, "none");
  $("files-body").replaceChildren(...c.files.map((f) => {
    const cells = [f.id, f.filename, f.bytes, f.stats.examples ?? "-", f.stats.images ?? "-", when(f.created_at)];
    const tr = clickableRow(cells.map(String), () => (isImages(f) ? useImages(f.id) : reportFile(f)));
    tr.dataset.file = f.id;
    tr.title = isImages(f) ? "Use these images in the report" : "Show this dataset's report";
    return tr;
  }));
}

// The report of a stored dataset for the chosen model and images zip.
async function reportFile(f) {
  state.reported = f;
  const box = el("div");
  $("report").replaceChildren(box);
  await loadReport(box, f.id, f.filename, { model: $("report-model").value, images: $("report-images").value });
}

async function useImages(id) {
  $("report-images").value = id;
  if (state.reported) await reportFile(state.reported);
}
for (const id of ["report-model", "report-images"]) {
  $(id).addEventListener("change", () => state.reported && reportFile(state.reported));
}

$("upload-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const file = $("upload-file").files[0];
  const form = new FormData(); form.append("purpose", "fine-tune"); form.append("file", file);
  const result = $("upload-result");
  result.className = ""; result.textContent = `Uploading ${file.name}…`;
  let f;
  try {
    f = await json("/v1/files", { method: "POST", body: form });
  } catch (e) {
    const issues = (e.body && e.body.error && e.body.error.issues) || [];
    result.className = "error"; result.textContent = `${file.name} was refused: nothing was stored`;
    const box = el("div");
    $("report").replaceChildren(box);
    state.reported = null;
    return renderReport(box, issues.length ? `${file.name}: ${issues.length} problem(s), nothing was stored` : e.message, false, issues);
  }
  result.textContent = `${f.filename} is valid: stored as ${f.id}${isImages(f) ? ", an images zip" : ""}`;
  await showFiles();
  if (isImages(f)) await useImages(f.id); else await reportFile(f);
});

// Once every script has run: playground.js, loaded after this file, adds a route.
document.addEventListener("DOMContentLoaded", route);
