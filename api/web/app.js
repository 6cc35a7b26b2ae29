// Kiln's monitoring page: plain JavaScript against the same REST API the SDK uses.
// The API key stays in sessionStorage and travels only in the Authorization header, so the
// live stream is read with fetch() (EventSource cannot send headers).
"use strict";

const $ = (id) => document.getElementById(id);
const state = { key: sessionStorage.getItem("kiln-key"), stream: null, points: [], valid: [] };

async function api(path, opts = {}) {
  const res = await fetch(path, { ...opts, headers: { Authorization: `Bearer ${state.key}`, ...(opts.headers || {}) } });
  if (!res.ok) {
    let body = {};
    try { body = await res.json(); } catch (_) {}
    const err = new Error((body.error && body.error.message) || `HTTP ${res.status}`);
    err.status = res.status; err.body = body;
    throw err;
  }
  return res;
}
const json = async (path, opts) => (await api(path, opts)).json();
const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "-");
const fmt = (x, d = 4) => (x === undefined || x === null ? "-" : Number(x).toFixed(d));

function show(section) {
  for (const id of ["login", "jobs", "job", "files"]) $(id).hidden = id !== section;
  $("logout").hidden = section === "login";
}

function stopStream() {
  if (state.stream) { state.stream.abort(); state.stream = null; }
}

async function route() {
  stopStream();
  if (!state.key) return show("login");
  const hash = location.hash || "#/";
  try {
    if (hash.startsWith("#/jobs/")) await showJob(hash.slice(7));
    else if (hash === "#/files") await showFiles();
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

async function showJobs() {
  show("jobs");
  const body = $("jobs-body");
  body.replaceChildren();
  let after = null, count = 0;
  do {
    const page = await json(`/v1/fine_tuning/jobs?limit=100${after ? `&after=${after}` : ""}`);
    for (const j of page.data) {
      const tr = document.createElement("tr");
      tr.className = "clickable"; tr.dataset.job = j.id;
      for (const v of [j.id, j.model, j.status, when(j.created_at), j.fine_tuned_model || ""]) {
        const td = document.createElement("td"); td.textContent = v; tr.append(td);
      }
      tr.children[2].innerHTML = `<span class="status ${j.status}">${j.status}</span>`;
      tr.addEventListener("click", () => { location.hash = `#/jobs/${j.id}`; });
      body.append(tr); count++;
    }
    after = page.has_more ? page.last_id : null;
  } while (after);
  $("jobs-empty").hidden = count > 0;
}

function renderJob(j) {
  $("job-id").textContent = j.id;
  const st = $("job-status"); st.textContent = j.status; st.className = `status ${j.status}`;
  $("job-model").textContent = j.model;
  $("job-ft").textContent = j.fine_tuned_model || "-";
  $("job-error").textContent = j.error ? `${j.error.code}: ${j.error.message}` : "";
  const done = ["succeeded", "failed", "cancelled"].includes(j.status);
  $("cancel").disabled = done;
  $("download").disabled = j.status !== "succeeded";
}

function addEvent(ev) {
  const li = document.createElement("li");
  li.className = ev.level;
  li.textContent = `${when(ev.created_at)}  ${ev.message}`;
  $("events").append(li);
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

function drawPlot() {
  const c = $("loss-plot"), g = c.getContext("2d");
  const W = c.width, H = c.height, L = 50, R = 10, T = 10, B = 30;
  g.clearRect(0, 0, W, H);
  const all = state.points.concat(state.valid);
  c.dataset.points = state.points.length; c.dataset.validPoints = state.valid.length;
  if (!all.length) return;
  const xmax = Math.max(...all.map((p) => p[0]), 1);
  const ymin = Math.min(...all.map((p) => p[1])), ymax = Math.max(...all.map((p) => p[1]));
  const span = ymax - ymin || 1;
  const X = (x) => L + (W - L - R) * (x / xmax);
  const Y = (y) => T + (H - T - B) * (1 - (y - ymin) / span);
  g.strokeStyle = "#9ca3af"; g.lineWidth = 1; g.fillStyle = "#6b7280"; g.font = "11px sans-serif";
  g.beginPath(); g.moveTo(L, T); g.lineTo(L, H - B); g.lineTo(W - R, H - B); g.stroke();
  for (let i = 0; i <= 4; i++) {
    const y = ymin + (span * i) / 4;
    g.fillText(y.toFixed(2), 4, Y(y) + 4);
  }
  g.fillText("step " + xmax, W - R - 50, H - 8);
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

async function showCheckpoints(id) {
  const page = await json(`/v1/fine_tuning/jobs/${id}/checkpoints?limit=100`);
  const body = $("ckpt-body"); body.replaceChildren();
  for (const c of page.data) {
    const tr = document.createElement("tr");
    tr.innerHTML = `<td>${c.step_number}</td><td>${fmt(c.metrics.train_loss)}</td><td>${fmt(c.metrics.valid_loss)}</td><td><button>Download</button></td>`;
    tr.querySelector("button").addEventListener("click", () =>
      download(`/v1/fine_tuning/jobs/${id}/checkpoints/${c.id}/adapter`, `${id}-step-${c.step_number}.zip`));
    body.append(tr);
  }
}

async function download(path, name) {
  const blob = await (await api(path)).blob();
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob); a.download = name;
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
      if (kind === "message" || kind === "metrics") addEvent(data);
      else if (kind === "status" || kind === "end") {
        const job = await json(`/v1/fine_tuning/jobs/${id}`);
        renderJob(job);
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
  $("job-progress").value = 0;
  drawPlot();
  const job = await json(`/v1/fine_tuning/jobs/${id}`);
  renderJob(job);
  await showCheckpoints(id);
  $("cancel").onclick = async () => renderJob(await json(`/v1/fine_tuning/jobs/${id}/cancel`, { method: "POST" }));
  $("download").onclick = () => download(`/v1/fine_tuning/jobs/${id}/adapter`, `${job.fine_tuned_model || id}.zip`.replace(/[^\w.-]/g, "_"));
  const ctrl = new AbortController();
  state.stream = ctrl;
  follow(id, ctrl).catch((e) => { if (e.name !== "AbortError") $("job-error").textContent = e.message; });
}

async function showFiles() {
  show("files");
  const page = await json("/v1/files?limit=100");
  const body = $("files-body"); body.replaceChildren();
  for (const f of page.data) {
    const tr = document.createElement("tr");
    for (const v of [f.id, f.filename, f.bytes, f.stats.examples ?? "-", f.stats.images ?? "-", when(f.created_at)]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td);
    }
    body.append(tr);
  }
}

$("upload-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const file = $("upload-file").files[0];
  const form = new FormData(); form.append("purpose", "fine-tune"); form.append("file", file);
  const report = $("report"), issues = $("report-issues"), stats = $("report-stats");
  issues.replaceChildren(); stats.replaceChildren(); report.hidden = false;
  try {
    const f = await json("/v1/files", { method: "POST", body: form });
    report.className = "report good";
    $("report-title").textContent = `${f.filename} is valid: stored as ${f.id}`;
    let shown = f.stats;
    if (f.stats.examples) {  // a dataset: the token report for the base model
      const rep = await json(`/v1/files/${f.id}/report?model=kiln-tiny`).catch(() => null);
      if (rep && rep.ok) {
        const { length_histogram, ...rest } = rep.stats;
        shown = { ...rest, estimated_training_tokens: rep.estimate.training_tokens,
                  estimated_seconds: rep.estimate.seconds,
                  length_histogram: length_histogram.map((b) => `<=${b.max_tokens}: ${b.examples}`).join(", ") };
      }
    }
    for (const [k, v] of Object.entries(shown)) {
      const dt = document.createElement("dt"); dt.textContent = k;
      const dd = document.createElement("dd"); dd.textContent = v;
      stats.append(dt, dd);
    }
    await showFiles();
  } catch (e) {
    report.className = "report bad";
    const list = (e.body && e.body.error && e.body.error.issues) || [];
    $("report-title").textContent = list.length ? `${file.name}: ${list.length} problem(s), nothing was stored` : e.message;
    for (const i of list) {
      const li = document.createElement("li");
      li.textContent = `line ${i.line}: ${i.field ? i.field + ": " : ""}${i.message}`;
      issues.append(li);
    }
  }
});

route();
