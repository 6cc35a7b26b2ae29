// The playground: a fine-tuned model and its base answer the same message side by side, each
// streamed token by token from POST /v1/chat/completions (stream: true, Server-Sent Events read
// with fetch like the job page's events, so the API key stays in the header). Each side keeps its
// own conversation: its next request carries its own earlier answers. Uses app.js's helpers.
"use strict";

const SIDES = ["base", "tuned"];
const play = {
  ctrl: null,  // the AbortController of the answers streaming now, or null
  roots: {},  // fine-tuned model -> its base
  base: { model: "", messages: [] },
  tuned: { model: "", messages: [] },
};

// The fine-tuned models (GET /v1/models lists them with their base as `root`), newest first;
// `pick` (from #/playground/<model>, the job page's link) is chosen when it is among them.
async function showPlayground(pick) {
  show("playground");
  $("play-error").textContent = "";
  const tuned = (await json("/v1/models")).data.filter((m) => m.root).reverse();
  play.roots = Object.fromEntries(tuned.map((m) => [m.id, m.root]));
  const select = $("play-model");
  select.replaceChildren(...tuned.map((m) => el("option", { value: m.id }, m.id)));
  select.value = pick || play.tuned.model;
  if (!select.value && tuned.length) select.value = tuned[0].id;
  $("play-none").hidden = tuned.length > 0;
  if (pick && select.value !== pick) {
    $("play-error").textContent = `${pick} is not one of your fine-tuned models that has succeeded`;
  }
  setModels(select.value, play.roots[select.value] || "");
}

// A new pair of models starts a new conversation; the same pair keeps the one on screen.
function setModels(tuned, base) {
  if (tuned === play.tuned.model && base === play.base.model) return;
  play.tuned.model = tuned; play.base.model = base;
  clearConversation();
}

function clearConversation() {
  stopAnswers();
  for (const name of SIDES) {
    play[name].messages = [];
    $(`play-${name}-model`).textContent = play[name].model || "-";
    $(`play-${name}-chat`).replaceChildren();
    $(`play-${name}-error`).textContent = "";
  }
}

function stopAnswers() {
  if (play.ctrl) { play.ctrl.abort(); play.ctrl = null; }
}

function busy(on) {
  $("play-send").disabled = on;
  $("play-stop").disabled = !on;
  $("play-model").disabled = on;
}

// The `data:` payloads of a Server-Sent Events answer, parsed, up to `data: [DONE]`; an answer
// that ends before it broke off.
async function* sseData(res) {
  const reader = res.body.getReader(), dec = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value: bytes, done } = await reader.read();
      if (done) throw new Error("the answer broke off before its end");
      buf += dec.decode(bytes, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data: ")) continue;
          if (line === "data: [DONE]") return;
          yield JSON.parse(line.slice(6));
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});  // an answer left early (an error) lets its connection go
  }
}

const turn = (role, text) => el("li", { className: `turn ${role}` }, text);

// One side's answer to `text`, streamed into its column. Returns whether the turn joined that
// side's conversation: it does when the answer ended, or was stopped with some text; a refusal
// or a failure is shown in the column and leaves the conversation as it was. A conversation
// cleared meanwhile (a new one, another model) is left alone.
async function answer(name, text, settings, signal) {
  const side = play[name], chat = $(`play-${name}-chat`), error = $(`play-${name}-error`);
  const before = side.messages;
  const messages = [...before, { role: "user", content: text }];
  const asked = turn("user", text), said = turn("assistant streaming", "");
  said.dataset.chunks = 0;
  error.textContent = "";
  chat.append(asked, said);
  let content = "";
  const current = () => side.messages === before;
  const keep = () => {
    said.classList.remove("streaming");
    if (!current()) return false;
    side.messages = [...messages, { role: "assistant", content }];
    return true;
  };
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST", signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: side.model, messages, stream: true, ...settings }),
    });
    for await (const chunk of sseData(res)) {
      if (chunk.error) throw new Error(chunk.error.message);
      for (const c of chunk.choices) {
        if (c.delta && c.delta.content) {
          content += c.delta.content;
          said.textContent = content;
          said.dataset.chunks = Number(said.dataset.chunks) + 1;
          chat.scrollTop = chat.scrollHeight;
        }
        if (c.finish_reason) said.dataset.finish = c.finish_reason;
      }
    }
    return keep();
  } catch (e) {
    if (e.name === "AbortError" && content) {
      said.dataset.finish = "stopped";
      return keep();
    }
    asked.remove(); said.remove();
    if (current()) error.textContent = e.name === "AbortError" ? "Stopped before any answer" : e.message;
    return false;
  }
}

$("play-model").addEventListener("change", () => {
  $("play-error").textContent = "";
  setModels($("play-model").value, play.roots[$("play-model").value] || "");
});

$("play-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  if ($("play-send").disabled) return;  // answers still streaming: Ctrl+Enter submits past a disabled Send
  const text = $("play-message").value.trim();
  $("play-error").textContent = "";
  if (!play.tuned.model) { $("play-error").textContent = "Choose a fine-tuned model first"; return; }
  if (!text) { $("play-error").textContent = "Type a message first"; return; }
  // Empty: the server's default; anything else as typed, for the API to check.
  const settings = { temperature: value("play-temperature"), max_tokens: value("play-max_tokens") };
  const ctrl = new AbortController();
  play.ctrl = ctrl;
  busy(true);
  $("play-message").value = "";
  const kept = await Promise.all(SIDES.map((name) => answer(name, text, settings, ctrl.signal)));
  if (!kept.some(Boolean) && !$("play-message").value) $("play-message").value = text;  // to send again
  if (play.ctrl === ctrl) play.ctrl = null;
  busy(false);
});
$("play-message").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); $("play-form").requestSubmit(); }
});
$("play-stop").addEventListener("click", stopAnswers);
$("play-clear").addEventListener("click", clearConversation);
